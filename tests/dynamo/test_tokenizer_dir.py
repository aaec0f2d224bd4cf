"""The mock vocabulary's Hugging Face tokenizer decodes every id exactly as the mock does."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sidecar.dynamo.tokenizer_dir import write_mock_tokenizer_dir
from sidecar.mock import generator as gen
from sidecar.mock import tokenizer as tok

pytestmark = pytest.mark.dynamo  # Hugging Face's tokenizers (writing the directory too) comes with it


def test_decoding_matches_the_mock(tmp_path: Path) -> None:
    import tokenizers

    root = write_mock_tokenizer_dir(tmp_path / "tok")
    t = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    assert t.get_vocab_size() == tok.VOCAB_SIZE
    rng = random.Random(7)
    pool = [*range(tok.BYTE_BASE), *range(tok.PUNCT_BASE, tok.VOCAB_SIZE)]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        ids += tok.encode(rng.choice(["é", "日本", "ü!", "€ x"]))  # byte fallback of valid UTF-8
        assert t.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    words = [gen.working_word(k) for k in range(gen.VOCAB_WORDS)]
    assert t.decode(words) == tok.decode(words)
    text = "Hello world, the bako tu rive. 123 <image> ünï\n"
    assert t.decode(t.encode(text).ids, skip_special_tokens=False) == text


def test_directory_files(tmp_path: Path) -> None:
    root = write_mock_tokenizer_dir(tmp_path, context_length=1024)
    config = json.loads((root / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "</s>" and "chat_template" in config
    assert json.loads((root / "config.json").read_text())["max_position_embeddings"] == 1024
    assert json.loads((root / "generation_config.json").read_text())["eos_token_id"] == tok.EOS_ID


def test_vision_directory_engages_dynamo_media_aware_routing(tmp_path: Path) -> None:
    """Dynamo resolves the placeholder it fills with pad values only for the vision variant."""
    from dynamo import _core as core

    plain = write_mock_tokenizer_dir(tmp_path / "plain")
    vision = write_mock_tokenizer_dir(tmp_path / "vision", vision=True)
    assert core.resolve_routing_image_token_id("mock", str(plain)) is None
    assert core.resolve_routing_image_token_id("mock", str(vision)) == tok.IMAGE_ID
