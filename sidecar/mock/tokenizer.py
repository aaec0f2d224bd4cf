"""The simulated engines' tokenizer: deterministic, documented, lossless.

Vocabulary (``VOCAB_SIZE`` = 13 245 ids, the same for every flavour):

====================  ==========================================================
ids                   tokens
====================  ==========================================================
0, 1, 2               ``<pad>``, ``<s>`` (BOS), ``</s>`` (EOS)
3, 4, 5               media placeholders ``<image>``, ``<video>``, ``<audio>``
6 … 261               byte fallback ``<0x00>`` … ``<0xFF>`` (one UTF-8 byte each)
262 … 284             ``\\n``, space, ``. , ! ? : ; - ' " ( )`` and digits ``0``…``9``
285 …                 "words": one or two syllables consonant+vowel from
                      ``bcdfghjklmnprstv`` x ``aeiou`` (80 syllables, 6 480 words);
                      word ``w`` with a leading space is ``285 + 2w``, without
                      ``286 + 2w``. Syllable ``s = 5c + v``; a one-syllable word
                      has ``w = s``, a two-syllable word ``w = 80 + 80 s1 + s2``.
====================  ==========================================================

Encoding (``encode``): the placeholders ``<image>``/``<video>``/``<audio>`` become
their ids; every other run of ASCII letters (with at most one leading space) is split
greedily into known words (two syllables, then one, lowercase only), and anything
left over — capitals, other letters, unknown characters — falls back to its UTF-8
bytes; punctuation and digits use their own ids.
``decode(encode(s), skip_special=False) == s`` for every string. Text prompts get BOS
prepended by the engine, not by ``encode``.
"""

from __future__ import annotations

import re
from functools import cache

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IMAGE_ID = 3
VIDEO_ID = 4
AUDIO_ID = 5
BYTE_BASE = 6
PUNCT_BASE = BYTE_BASE + 256
PUNCT = ("\n", " ", ".", ",", "!", "?", ":", ";", "-", "'", '"', "(", ")", *"0123456789")
WORD_BASE = PUNCT_BASE + len(PUNCT)
CONSONANTS = "bcdfghjklmnprstv"
VOWELS = "aeiou"
N_SYLLABLES = len(CONSONANTS) * len(VOWELS)
N_WORDS = N_SYLLABLES + N_SYLLABLES * N_SYLLABLES
VOCAB_SIZE = WORD_BASE + 2 * N_WORDS

SPECIALS = ("<pad>", "<s>", "</s>", "<image>", "<video>", "<audio>")
PLACEHOLDERS = {"<image>": IMAGE_ID, "<video>": VIDEO_ID, "<audio>": AUDIO_ID}
_PUNCT_IDS = {p: PUNCT_BASE + i for i, p in enumerate(PUNCT)}
_SPLIT = re.compile(r"<image>|<video>|<audio>| ?[A-Za-z]+|.", re.DOTALL)


def _syllable(index: int) -> str:
    return CONSONANTS[index // len(VOWELS)] + VOWELS[index % len(VOWELS)]


def _syllable_index(text: str) -> int | None:
    c = CONSONANTS.find(text[0])
    v = VOWELS.find(text[1])
    if c < 0 or v < 0:
        return None
    return c * len(VOWELS) + v


def word_text(word: int) -> str:
    """The letters of word number ``word`` (0 ≤ word < N_WORDS)."""
    if word < N_SYLLABLES:
        return _syllable(word)
    s1, s2 = divmod(word - N_SYLLABLES, N_SYLLABLES)
    return _syllable(s1) + _syllable(s2)


def word_id(word: int, leading_space: bool = True) -> int:
    """Token id of word number ``word`` with or without its leading space."""
    return WORD_BASE + 2 * word + (0 if leading_space else 1)


@cache
def token_text(token_id: int) -> str:
    """The text of one token: what it contributes to decoded output.

    Byte tokens return ``<0xNN>`` (their text only exists once bytes are joined,
    see :func:`decode`). Raises ValueError outside the vocabulary.
    """
    if not 0 <= token_id < VOCAB_SIZE:
        raise ValueError(f"token id {token_id} outside the vocabulary (0..{VOCAB_SIZE - 1})")
    if token_id < BYTE_BASE:
        return SPECIALS[token_id]
    if token_id < PUNCT_BASE:
        return f"<0x{token_id - BYTE_BASE:02X}>"
    if token_id < WORD_BASE:
        return PUNCT[token_id - PUNCT_BASE]
    word, no_space = divmod(token_id - WORD_BASE, 2)
    return ("" if no_space else " ") + word_text(word)


def is_special(token_id: int) -> bool:
    return 0 <= token_id < BYTE_BASE


def _encode_letters(piece: str, out: list[int]) -> None:
    space = piece.startswith(" ")
    letters = piece[1:] if space else piece
    i = 0
    first = True
    while i < len(letters):
        word = None
        for size in (4, 2):
            chunk = letters[i : i + size]
            if len(chunk) != size:
                continue
            indices = [_syllable_index(chunk[j : j + 2]) for j in range(0, size, 2)]
            if any(x is None for x in indices):
                continue
            s = [x for x in indices if x is not None]
            word = s[0] if size == 2 else N_SYLLABLES + s[0] * N_SYLLABLES + s[1]
            break
        if word is None:
            if first and space:
                out.append(_PUNCT_IDS[" "])
            out.extend(BYTE_BASE + b for b in letters[i].encode())
            i += 1
        else:
            out.append(word_id(word, leading_space=first and space))
            i += 4 if word >= N_SYLLABLES else 2
        first = False


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (no BOS). Deterministic and lossless (see the module doc)."""
    out: list[int] = []
    for m in _SPLIT.finditer(text):
        piece = m.group()
        placeholder = PLACEHOLDERS.get(piece)
        if placeholder is not None:
            out.append(placeholder)
        elif piece in _PUNCT_IDS:
            out.append(_PUNCT_IDS[piece])
        elif piece.strip(" ").isascii() and piece.strip(" ").isalpha():
            _encode_letters(piece, out)
        else:
            out.extend(BYTE_BASE + b for b in piece.encode())
    return out


def decode(token_ids: list[int] | tuple[int, ...], *, skip_special: bool = True) -> str:
    """Text of ``token_ids``; consecutive byte tokens are joined and UTF-8 decoded.

    Special tokens (BOS, EOS, pad, placeholders) are dropped unless ``skip_special``
    is false. Raises ValueError for ids outside the vocabulary.
    """
    parts: list[str] = []
    pending = bytearray()
    for tid in token_ids:
        if BYTE_BASE <= tid < PUNCT_BASE:
            pending.append(tid - BYTE_BASE)
            continue
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
        if tid < BYTE_BASE and skip_special and tid >= 0:
            continue
        parts.append(token_text(tid))
    if pending:
        parts.append(pending.decode("utf-8", errors="replace"))
    return "".join(parts)


def output_text(token_id: int) -> str:
    """Text a generated token adds to the detokenized stream (specials add nothing)."""
    if token_id < BYTE_BASE:
        return ""
    return token_text(token_id)


#: The chat template of the project's test tokenizers (the mock's tokenizer directory for Dynamo and
#: the tiny vLLM model): ``role: content`` lines, one placeholder per media part in prompt order, then
#: ``assistant:`` when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}<image>"
    "{% elif part['type'] in ['video', 'video_url'] %}<video>"
    "{% elif part['type'] in ['audio', 'audio_url', 'input_audio'] %}<audio>"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
