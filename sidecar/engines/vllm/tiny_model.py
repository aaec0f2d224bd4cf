"""A tiny random-weight Llama with a locally trained tokenizer, for running vLLM on a laptop CPU.

Nothing is downloaded: the byte-level BPE tokenizer is trained with ``tokenizers`` on a fixed
text made here, the weights are drawn from a seeded generator, and ``save_pretrained`` writes a
directory vLLM (and Dynamo's frontend) loads offline. The same spec gives the same files, so the
directory is built once per path: :func:`build_tiny_model` reuses a complete one (its stamp names
the spec) and builds into a temporary sibling that is renamed into place.

Shape: 2 layers, hidden 64, 2 heads of ``head_dim`` 32 (vLLM's CPU attention needs head sizes
32-512), float32, context 8192, a vocabulary of 2048 (so the token ids 1000-1999 that clients such
as the conformance suite draw are real tokens). About 1.5 MB; builds in seconds.

``python -m sidecar.engines.vllm.tiny_model DIR`` builds one (needs the ``vllm`` extra:
torch, transformers, tokenizers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from sidecar.mock.tokenizer import CHAT_TEMPLATE

__all__ = ["TinyModelSpec", "build_tiny_model"]

STAMP = ".openengine-tiny-model.json"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@dataclass(frozen=True)
class TinyModelSpec:
    """What the directory holds; its hash is the stamp a reused directory must match."""

    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    context_length: int = 8192  # room for the conformance suite's 4,096-token "long" request
    version: int = 1  # bump when the builder's output changes

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _corpus(seed: int) -> list[str]:
    """A fixed, deterministic training text: sentences of two- and three-syllable words."""
    syllables = [c + v for c in "bcdfghjklmnprstvw" for v in "aeiou"]
    n = len(syllables)
    lines = []
    for i in range(1500):
        words = []
        for k in range(12):
            word = syllables[(seed + i * 7 + k * 13) % n] + syllables[(i * 3 + k * 5) % n]
            if (i + k) % 3 == 0:
                word += syllables[(i * 11 + k * 17) % n]
            words.append(word)
        lines.append(" ".join(words).capitalize() + ", and the " + words[0] + " is " + words[-1] + ".")
    return lines


def _tokenizer(spec: TinyModelSpec):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, not {spec.vocab_size}")
    return tokenizer


def _write(root: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer(spec)
    tokenizer.save(str(root / "tokenizer.json"))
    bos, eos, pad = (tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": spec.context_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1) + "\n")
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(root), safe_serialization=True)


def build_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """The tiny model directory at ``path``, built unless a complete one for ``spec`` is there.

    Raises ``FileExistsError`` when ``path`` exists, is not empty and is not such a directory
    (it is never overwritten), ``ImportError`` without the ``vllm`` extra.
    """
    spec = spec or TinyModelSpec()
    root = Path(path)
    stamp = {"builder": "openengine-sidecar tiny-model", "spec": asdict(spec), "digest": spec.digest()}
    try:
        if json.loads((root / STAMP).read_text()).get("digest") == spec.digest():
            return root
    except (OSError, ValueError):
        pass
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists and is not a tiny model directory of this spec")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        _write(tmp, spec)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        if root.exists():
            root.rmdir()
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sidecar.engines.vllm.tiny_model DIR")
    print(build_tiny_model(sys.argv[1]))
