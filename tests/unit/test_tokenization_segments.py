"""Segmented encoding equals whole-text encoding, for every tokenizer shape it accepts.

Tokenizers shaped like the ones kvgate meets (byte-level BPE as GPT-2, Llama 3 and
Qwen 2/3.5 build them, SentencePiece-style BPE as Llama 2 in both its conversions,
WordPiece as BERT) are trained here on a small corpus, with their special tokens
and post-processors; the tiny model's own tokenizer is the real thing. Hypothesis
draws texts from fragments chosen to sit on every boundary the proof relies on
(added tokens, spaces between letters, runs of whitespace, contractions, digits,
combining marks, emoji, "▁") and from arbitrary unicode; the segmented ids must be
the tokenizer's own, with and without ``add_special_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    processors,
    trainers,
)
from tokenizers import pre_tokenizers as pre

from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import LocalTokenizer, TokenCache
from kvindex.tokenization.incremental import IncrementalEncoder
from kvindex.tokenization.segments import NotSegmentable, Segmenter

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? We'll see.",
    "A cache keeps what was computed so that it need not be computed again.\n\n",
    "Requests that share a prefix share work: 12345 tokens, 678 blocks.",
    "Ünïcödé façade naïve café — 字符 テスト 😀 e\u0301 \t tabs\tand  spaces   here",
    "def main():\n    return {'key': [1, 2, 3]}  # comment\r\n",
] * 20
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def _bpe(pre_tokenizer: pre.PreTokenizer, specials: list[str], **model: object) -> Tokenizer:
    tok = Tokenizer(models.BPE(**model))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def gpt2_chatml() -> Tokenizer:
    return _bpe(pre.ByteLevel(add_prefix_space=False), CHATML)


def gpt2_prefix_space() -> Tokenizer:
    tok = _bpe(pre.ByteLevel(add_prefix_space=True), ["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    return tok


def _split_bytelevel(pattern: str, specials: list[str]) -> Tokenizer:
    split = pre.Split(Regex(pattern), behavior="isolated", invert=False)
    return _bpe(
        pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)]), specials
    )


def llama3() -> Tokenizer:
    tok = _split_bytelevel(LLAMA3, LLAMA3_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return tok


def qwen2() -> Tokenizer:
    tok = _split_bytelevel(QWEN2, CHATML)
    tok.normalizer = normalizers.NFC()
    tok.add_tokens([AddedToken("<tool_call>", normalized=False, special=False)])
    return tok


def qwen35() -> Tokenizer:
    tok = _split_bytelevel(QWEN35, CHATML)
    tok.normalizer = normalizers.NFC()
    return tok


def llama2_metaspace() -> Tokenizer:
    metaspace = pre.Metaspace("▁", prepend_scheme="first", split=False)
    tok = _bpe(metaspace, ["<s>", "</s>"], byte_fallback=True)
    tok.decoder = decoders.Metaspace("▁", prepend_scheme="first", split=False)
    tok.add_tokens(
        [AddedToken("[INST]", normalized=False), AddedToken("[/INST]", normalized=False)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def llama2_legacy() -> Tokenizer:
    tok = _bpe(pre.Metaspace("▁", prepend_scheme="always", split=False), ["<s>", "</s>"])
    tok.pre_tokenizer = None  # type: ignore[assignment]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def bert() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    return tok


def normalized_added_token() -> Tokenizer:
    tok = gpt2_chatml()
    tok.add_tokens([AddedToken("cache keeps", normalized=True)])
    return tok


def nested_added_tokens() -> Tokenizer:
    """Added tokens inside others: what follows a text's ``<|im_end|>`` can make it
    part of a longer added token."""
    tok = gpt2_chatml()
    tok.add_tokens(
        [
            AddedToken("<|im_end|>\n", normalized=False),
            AddedToken("x<|im_start|>y", normalized=False),
        ]
    )
    return tok


def tiny_model() -> Tokenizer:
    return LocalTokenizer(ensure_tokenizer()).backend


SHAPES: dict[str, Callable[[], Tokenizer]] = {
    "tiny-model": tiny_model,
    "gpt2-chatml": gpt2_chatml,
    "gpt2-prefix-space": gpt2_prefix_space,
    "llama3": llama3,
    "qwen2": qwen2,
    "qwen3.5": qwen35,
    "llama2-metaspace-first": llama2_metaspace,
    "llama2-legacy": llama2_legacy,
    "bert": bert,
    "normalized-added-token": normalized_added_token,
    "nested-added-tokens": nested_added_tokens,
}
SEAMED = {
    "tiny-model",
    "gpt2-chatml",
    "nested-added-tokens",
    "gpt2-prefix-space",
    "llama3",
    "qwen2",
    "qwen3.5",
}
_BUILT: dict[str, Tokenizer] = {}

FRAGMENTS = [
    "the", "cache", " ", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "Hello",
    " world", "Question:", " q", "A", "z", ".", ",", "!", "'s", "'re", " don't", "'",
    "1", "23", "4567", "é", "e\u0301", "\u0301", "ü", "字符", "😀", "▁", "<", "|", "<|",
    "|>", "[", "INST", "/", "tool", "_call", ">", "keeps", "ǅ", "\u00a0",
]  # fmt: skip


def _shape(name: str) -> Tokenizer:
    if name not in _BUILT:
        _BUILT[name] = SHAPES[name]()
    return _BUILT[name]


def _texts(tok: Tokenizer) -> st.SearchStrategy[str]:
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    pieces = st.sampled_from(FRAGMENTS + added) | st.text(max_size=6)
    return st.lists(pieces, max_size=60).map("".join)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_segmented_ids_equal_the_whole_texts_ids(shape: str, data: st.DataObject) -> None:
    tok = _shape(shape)
    seg = Segmenter.for_tokenizer(tok, chunk_chars=3)  # cut at every seam it can
    text = data.draw(_texts(tok))

    assert seg.encode_whole(text, False) == tok.encode(text, add_special_tokens=False).ids
    assert seg.encode_whole(text, True) == tok.encode(text, add_special_tokens=True).ids


@pytest.mark.parametrize("shape", sorted(SHAPES))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_texts_that_extend_earlier_texts_prefixes_get_their_whole_ids(
    shape: str, data: st.DataObject
) -> None:
    """Through the cache of known prefixes: each text keeps some of the one before
    (often all of it, as a conversation's next turn does) and adds more."""
    tok = _shape(shape)
    seg = Segmenter.for_tokenizer(tok, chunk_chars=3)
    encoder = IncrementalEncoder(seg, TokenCache())
    text = ""
    for _ in range(4):
        # all of it, up to the end of one of its added tokens, or anywhere
        ends = st.sampled_from(seg.added_ends(text) or [0])
        keep = data.draw(st.just(len(text)) | ends | st.integers(0, len(text)))
        text = text[:keep] + data.draw(_texts(tok))
        for special in (False, True):
            plan = encoder.plan(text, special)

            ids = list(encoder.finish(plan, encoder.encode(plan)))

            assert ids == tok.encode(text, add_special_tokens=special).ids


def test_a_known_prefix_whose_last_added_token_grows_into_a_longer_one_is_not_used() -> None:
    tok = nested_added_tokens()
    encoder = IncrementalEncoder(Segmenter.for_tokenizer(tok), TokenCache())
    for text in ("hi<|im_end|>there", "hi<|im_end|>\nthere"):  # then "<|im_end|>\n"
        plan = encoder.plan(text, False)
        ids = list(encoder.finish(plan, encoder.encode(plan)))

        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert plan.prefix_tokens == 0


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_seams_are_used_only_for_the_pre_tokenizers_proven_safe(shape: str) -> None:
    assert Segmenter.for_tokenizer(_shape(shape)).seams == (shape in SEAMED)


def test_long_pieces_are_cut_at_spaces_between_letters_after_chunk_chars() -> None:
    seg = Segmenter.for_tokenizer(_shape("gpt2-chatml"), chunk_chars=10)
    text = "<|im_start|>user\nalpha beta gamma, delta epsilon zeta<|im_end|>"

    pieces = [s.text if s.text is not None else s.token for s in seg.segments(text)]

    assert pieces == [1, "user\nalpha", " beta gamma, delta", " epsilon zeta", 2]


def test_the_first_piece_of_a_metaspace_first_tokenizer_is_encoded_as_the_head() -> None:
    seg = Segmenter.for_tokenizer(_shape("llama2-metaspace-first"))
    heads = [(s.text, s.head) for s in seg.segments("Hi [INST] there")]
    assert heads == [("Hi ", True), (None, False), (" there", False)]
    assert seg.segments("[INST]x")[1].head is False


def test_added_tokens_that_look_at_their_neighbours_are_not_segmented() -> None:
    tok = gpt2_chatml()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    with pytest.raises(NotSegmentable, match="neighbours"):
        Segmenter.for_tokenizer(tok)


def test_bpe_dropout_and_unknown_pre_tokenizers_are_not_segmented() -> None:
    dropout = _bpe(pre.ByteLevel(), [], dropout=0.1)
    with pytest.raises(NotSegmentable, match="dropout"):
        Segmenter.for_tokenizer(dropout)
    fixed = gpt2_chatml()
    fixed.pre_tokenizer = pre.FixedLength(4)
    with pytest.raises(NotSegmentable, match="FixedLength"):
        Segmenter.for_tokenizer(fixed)


def test_special_tokens_encoded_as_text_are_not_segmented() -> None:
    tok = gpt2_chatml()
    tok.encode_special_tokens = True
    with pytest.raises(NotSegmentable, match="as text"):
        Segmenter.for_tokenizer(tok)


def test_a_reference_encoder_that_adds_ids_of_its_own_is_caught_at_load() -> None:
    tok = gpt2_chatml()

    def transformers_like(text: str, special: bool) -> list[int]:
        return [0, *tok.encode(text, add_special_tokens=special).ids]  # a BOS added in Python

    with pytest.raises(NotSegmentable, match="differ"):
        Segmenter.for_tokenizer(tok, reference=transformers_like)
