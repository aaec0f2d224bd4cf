"""The mock tokenizer: lossless, deterministic, documented vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.mock import tokenizer as tok


@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special=False) == text


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("", []),
        (" ba", [tok.word_id(0)]),
        ("ba", [tok.word_id(0, leading_space=False)]),
        (" bako", [tok.word_id(tok.N_SYLLABLES + 0 * tok.N_SYLLABLES + 38)]),  # ba=0, ko=7*5+3
        ("<image>", [tok.IMAGE_ID]),
        ("\n", [tok.PUNCT_BASE]),
        ("é", [tok.BYTE_BASE + 0xC3, tok.BYTE_BASE + 0xA9]),
    ],
)
def test_documented_ids(text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids


def test_vocabulary_layout() -> None:
    assert tok.VOCAB_SIZE == 13245
    assert tok.token_text(tok.EOS_ID) == "</s>"
    assert tok.token_text(tok.BYTE_BASE + 0x41) == "<0x41>"
    assert tok.token_text(tok.WORD_BASE) == " ba"
    assert tok.token_text(tok.WORD_BASE + 1) == "ba"
    assert tok.token_text(tok.VOCAB_SIZE - 1) == "vuvu"
    with pytest.raises(ValueError):
        tok.token_text(tok.VOCAB_SIZE)


def test_specials_are_skipped_when_decoding() -> None:
    ids = [tok.BOS_ID, *tok.encode(" ba <image> be"), tok.EOS_ID]
    assert tok.decode(ids) == " ba  be"
    assert tok.decode(ids, skip_special=False) == "<s> ba <image> be</s>"
    assert tok.output_text(tok.EOS_ID) == ""


def test_unknown_words_fall_back_to_syllables_and_bytes() -> None:
    ids = tok.encode(" hello")
    assert tok.decode(ids) == " hello"
    assert [tok.token_text(i) for i in ids] == [" he", "<0x6C>", "lo"]
