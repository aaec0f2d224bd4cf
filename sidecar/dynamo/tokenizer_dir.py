"""A Hugging Face tokenizer directory for the simulated engines' vocabulary.

Dynamo's frontend tokenizes prompts and detokenizes the token ids a worker returns with
the tokenizer found in the registered model directory. To serve the mock engines
(``sidecar/mock``) through a real Dynamo frontend, that tokenizer must have the mock's
exact vocabulary (``sidecar.mock.tokenizer``: 13 245 ids), so that the ids the mock
generates detokenize to the text the mock itself reports.

:func:`write_mock_tokenizer_dir` writes such a directory with the ``tokenizers`` library
(part of the ``dynamo`` extra): ``tokenizer.json``, ``tokenizer_config.json`` (with a
chat template), ``config.json`` and ``generation_config.json``. The model is a Unigram
model with byte fallback over the mock's pieces; a word token with a leading space is
spelled ``▁word`` (Metaspace), so decoding is ``Replace(▁→space) + ByteFallback + Fuse``
and equals ``sidecar.mock.tokenizer.decode`` id for id. Encoding is close to the mock's
own (longest words, byte fallback for anything else), not identical: the frontend's
token ids are what the engine receives, so nothing depends on the two encoders agreeing.

``vision=True`` makes the directory look, to Dynamo's frontend, like a Qwen2-VL model whose
image placeholder is the mock's ``<image>`` (id 3): ``config.json`` says ``model_type``
``qwen2_vl`` with ``image_token_id`` 3, and ``preprocessor_config.json`` has Qwen2-VL's
patching (14-pixel patches merged 2x2). The frontend then builds media-aware KV routing
information: it counts an image of WxH pixels as (W/28)·(H/28) tokens after Qwen2-VL's
resizing (sides rounded to multiples of 28, at least 56x56 pixels), so a 112x56 image
counts 8 tokens — exactly the mock's expansion of one image placeholder
(``sidecar.mock.flavors.MEDIA_TOKENS``) — and request-side and engine-side token positions
agree.

Run ``python -m sidecar.dynamo.tokenizer_dir [--vision] DIR`` to write one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sidecar.mock import tokenizer as tok

__all__ = ["VISION_PREPROCESSOR", "piece", "write_mock_tokenizer_dir"]

_SPACE = "\u2581"  # ▁, the Metaspace replacement character


def piece(token_id: int) -> str:
    """The tokenizer piece of one mock token id (``▁`` stands for a leading space)."""
    text = tok.token_text(token_id)
    if tok.BYTE_BASE <= token_id < tok.PUNCT_BASE:
        return text  # <0xNN>: ByteFallback decodes it
    return text.replace(" ", _SPACE)


def _tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = [(piece(i), 0.0 if i < tok.BYTE_BASE else -1.0) for i in range(tok.VOCAB_SIZE)]
    model = models.Unigram(vocab, unk_id=tok.PAD_ID, byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in tok.SPECIALS])
    text: str = tokenizer.to_str(pretty=False)
    return text


#: Qwen2-VL's image preprocessing as Dynamo's frontend reads it (``vision=True``).
VISION_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def write_mock_tokenizer_dir(path: str | Path, *, context_length: int = 8192, vision: bool = False) -> Path:
    """Write the tokenizer directory at ``path`` (created if needed); return it.

    Needs the ``tokenizers`` package (``ImportError`` otherwise).
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    specials = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(tok.SPECIALS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.SPECIALS[tok.BOS_ID],
        "eos_token": tok.SPECIALS[tok.EOS_ID],
        "pad_token": tok.SPECIALS[tok.PAD_ID],
        "unk_token": tok.SPECIALS[tok.PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": context_length,
        "added_tokens_decoder": specials,
        "chat_template": tok.CHAT_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    model_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.VOCAB_SIZE,
        "max_position_embeddings": context_length,
        "bos_token_id": tok.BOS_ID,
        "eos_token_id": tok.EOS_ID,
        "pad_token_id": tok.PAD_ID,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "torch_dtype": "float16",
    }
    if vision:
        model_config.update(
            architectures=["Qwen2VLForConditionalGeneration"],
            model_type="qwen2_vl",
            image_token_id=tok.IMAGE_ID,
            video_token_id=tok.VIDEO_ID,
        )
        (root / "preprocessor_config.json").write_text(
            json.dumps(VISION_PREPROCESSOR, indent=1), encoding="utf-8"
        )
    (root / "config.json").write_text(json.dumps(model_config, indent=1), encoding="utf-8")
    generation = {"bos_token_id": tok.BOS_ID, "eos_token_id": tok.EOS_ID, "pad_token_id": tok.PAD_ID}
    (root / "generation_config.json").write_text(json.dumps(generation, indent=1), encoding="utf-8")
    return root


if __name__ == "__main__":  # pragma: no cover
    args = sys.argv[1:]
    vision = "--vision" in args
    paths = [a for a in args if a != "--vision"]
    if len(paths) != 1 or paths[0].startswith("-"):
        sys.exit("usage: python -m sidecar.dynamo.tokenizer_dir [--vision] DIR")
    print(write_mock_tokenizer_dir(paths[0], vision=vision))
