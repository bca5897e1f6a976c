"""Plain ASCII pieces assembled from a cache of their words give the tokenizer's own
ids, for every byte-level BPE shape kvgate knows, cold and warm; other shapes and
other text are encoded whole; the cache stays within its bounds and turns itself off
when the words it cuts do not match the tokenizer's tokens."""

from __future__ import annotations

import json
import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.tokenization import words as words_module
from kvindex.tokenization.segments import Segmenter
from kvindex.tokenization.words import WordIds, ascii_pattern
from tests.unit.test_tokenization_segments import SHAPES, _shape

WORD_CACHED = {"tiny-model", "gpt2-chatml", "nested-added-tokens", "llama3", "qwen2", "qwen3.5"}

ASCII_FRAGMENTS = [
    "the", "cache", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "\r", "Hello",
    " world", "Question:", " q", "A", "z", ".", ",", "!", "'s", "'S", "'re", " don't", "'",
    "1", "23", "4567", "12345678", "<", "|", ">", "[", "/", "_call", " keeps", "~", "--",
    "$", "{}", "()", ";", "  x", "\t\t", "e.g.", "'ll", "I'M",
]  # fmt: skip
ASCII_TEXT = st.lists(
    st.sampled_from(ASCII_FRAGMENTS) | st.text(string.printable, max_size=6), max_size=60
).map("".join)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_only_known_byte_level_shapes_get_a_word_cache(shape: str) -> None:
    assert (Segmenter.for_tokenizer(_shape(shape)).words is not None) == (shape in WORD_CACHED)


@pytest.mark.parametrize("shape", sorted(WORD_CACHED))
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(ASCII_TEXT, min_size=1, max_size=6))
def test_ascii_pieces_from_words_equal_the_tokenizers_ids_cold_and_warm(
    shape: str, texts: list[str]
) -> None:
    tok = _shape(shape)
    seg = Segmenter.for_tokenizer(tok, chunk_chars=7)
    assert seg.words is not None
    for _ in range(2):  # learnt from whole pieces, then assembled from the words
        for text in texts:
            assert seg.encode_whole(text, False) == tok.encode(text, add_special_tokens=False).ids
    assert seg.words.enabled and seg.words.misaligned == 0


def test_a_warm_cache_assembles_pieces_and_encodes_only_new_words() -> None:
    tok = _shape("llama3")
    words = WordIds(tok, ascii_pattern(json.loads(tok.to_str())))
    calls: list[list[str]] = []

    def whole(pieces):
        calls.append(list(pieces))
        return [e.ids for e in tok.encode_batch(pieces, add_special_tokens=False)]

    first = "The quick brown fox jumps over the lazy dog."
    assert words.encode([first], whole) == whole([first])
    calls.clear()
    second = "The lazy dog jumps over the quick brown fox again."  # " again" is new

    assert words.encode([second], whole) == [tok.encode(second, add_special_tokens=False).ids]
    assert calls == []  # from the words, the new one encoded alone
    assert words.from_words == 1


def test_non_ascii_and_control_characters_go_whole() -> None:
    tok = _shape("qwen2")
    words = WordIds(tok, ascii_pattern(json.loads(tok.to_str())))
    pieces = ["café au lait", "bell\x07 ring", "form\x0cfeed", "plain text"]
    encoded = words.encode(pieces, lambda ps: [tok.encode(p).ids for p in ps])
    assert encoded == [tok.encode(p, add_special_tokens=False).ids for p in pieces]
    assert set(words._ids) == set(words._words.findall("plain text"))  # learnt only there


def test_words_cut_unlike_the_tokenizer_turn_the_cache_off() -> None:
    tok = _shape("gpt2-chatml")
    every_char = WordIds(tok, r".")  # a token of two characters lands inside a "word"
    text = "the cache keeps what was computed"

    ids = every_char.encode([text], lambda ps: [tok.encode(p).ids for p in ps])

    assert ids == [tok.encode(text).ids]  # the whole piece's ids, still right
    assert not every_char.enabled and every_char.misaligned == 1 and len(every_char) == 0
    assert WordIds.for_tokenizer(tok, {"pre_tokenizer": {"type": "Whitespace"}}) is None


def test_the_cache_is_bounded_and_mostly_new_text_is_encoded_whole(monkeypatch) -> None:
    monkeypatch.setattr(words_module, "WARM_WORDS", 200)
    tok = _shape("tiny-model")
    words = WordIds(tok, ascii_pattern(json.loads(tok.to_str())), capacity=1_000)
    rng = random.Random(0)

    def fresh_words(n: int) -> str:
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(n))

    pieces = [fresh_words(40) for _ in range(300)]
    for piece in pieces:
        assert words.encode([piece], lambda ps: [tok.encode(p).ids for p in ps]) == [
            tok.encode(piece, add_special_tokens=False).ids
        ]
        assert len(words) <= 1_000

    # after ~200 words known, new text is looked up one piece in EXPLORE_EVERY
    assert words.whole >= 300 - 200 // 40 - 300 // words_module.EXPLORE_EVERY - 2


def test_long_words_a_client_sends_are_encoded_but_not_kept() -> None:
    """A "word" is a run of letters (or digits, punctuation, spaces) as long as the
    client makes it: 50,000 cached words of a megabyte each would stay in memory.
    What the cache holds stays within what its bound reports a word costs."""
    import gc
    import tracemalloc

    tok = _shape("llama3")
    words = WordIds(tok, ascii_pattern(json.loads(tok.to_str())))
    rng = random.Random(0)

    def whole(pieces):
        return [e.ids for e in tok.encode_batch(pieces, add_special_tokens=False)]

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10):
            long_word = "".join(rng.choices(string.ascii_letters, k=20_000))
            for piece in (long_word, f"the cat sat on {long_word} mat {i}"):
                for _ in range(2):  # cold, then from the words it keeps
                    assert words.encode([piece], whole) == whole([piece])
        del long_word, piece  # the test's own references to the last ones
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained <= words.bound().size * words.bound().bytes_each + 4096  # 4 MB before
    assert 0 < len(words) < 40  # the short words, learnt
