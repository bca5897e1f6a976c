"""Chained chunk hashes of rendered prompts (the prefix-aware router's keys)."""

import xxhash

from routing.prefix_hash import chat_prefix_hashes, prefix_hashes, text_prefix_hashes


def test_hashes_chain_xxh3_over_fixed_chunks_including_the_tail():
    hashes = prefix_hashes("abcdefg", chunk_chars=3)
    h1 = xxhash.xxh3_64_intdigest(b"abc", 0)
    h2 = xxhash.xxh3_64_intdigest(b"def", h1)
    h3 = xxhash.xxh3_64_intdigest(b"g", h2)
    assert hashes == [h1, h2, h3]


def test_prompts_share_exactly_their_common_full_chunks():
    a = text_prefix_hashes("x" * 600, chunk_chars=256)
    b = text_prefix_hashes("x" * 512 + "y" * 88, chunk_chars=256)
    c = text_prefix_hashes("y" + "x" * 599, chunk_chars=256)
    assert len(a) == len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # chained: a different first chunk changes every hash


def test_seed_separates_hash_spaces():
    assert prefix_hashes("hello", seed=1) != prefix_hashes("hello", seed=2)


def test_max_chunks_caps_the_work_for_huge_prompts():
    assert len(prefix_hashes("z" * 10_000, chunk_chars=10, max_chunks=7)) == 7


def test_empty_text_has_no_hashes():
    assert prefix_hashes("") == []


def test_lone_surrogates_hash_instead_of_failing():
    assert len(prefix_hashes("a\ud800b", chunk_chars=2)) == 2


def test_completion_prompt_shapes():
    assert text_prefix_hashes("hi") == prefix_hashes("hi")
    assert text_prefix_hashes([1, 2, 3]) == prefix_hashes("1\x1d2\x1d3")
    assert text_prefix_hashes(["a", "b"]) == prefix_hashes("a\x1eb")
    for bad in (None, 5, {}, [], [1, "a"], [True, False], [[1, 2]]):
        assert text_prefix_hashes(bad) == []


def test_chat_hashes_cover_role_name_and_content():
    user = [{"role": "user", "content": "hello"}]
    assert chat_prefix_hashes(user) == prefix_hashes("user\x1f\x1fhello\x1e")
    assert chat_prefix_hashes(user) != chat_prefix_hashes([{"role": "tool", "content": "hello"}])
    named = [{"role": "user", "name": "bob", "content": "hello"}]
    assert chat_prefix_hashes(user) != chat_prefix_hashes(named)


def test_chat_message_boundaries_matter():
    one = [{"role": "user", "content": "ab"}]
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert chat_prefix_hashes(one) != chat_prefix_hashes(two)


def test_a_conversation_that_grows_keeps_its_leading_hashes():
    turn1 = [{"role": "system", "content": "s" * 700}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    h1, h2 = chat_prefix_hashes(turn1), chat_prefix_hashes(turn2)
    assert h2[: len(h1) - 1] == h1[:-1]  # every full chunk of turn 1


def test_text_parts_hash_like_plain_content_and_images_by_their_url():
    plain = [{"role": "user", "content": "hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert chat_prefix_hashes(plain) == chat_prefix_hashes(parts)

    def with_image(url):
        image = {"type": "image_url", "image_url": {"url": url}}
        return [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]

    assert chat_prefix_hashes(with_image("a.png")) != chat_prefix_hashes(with_image("b.png"))


def test_tool_calls_are_part_of_the_message():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    plain = [{"role": "assistant", "content": None}]
    calls = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert chat_prefix_hashes(plain) != chat_prefix_hashes(calls)


def test_bad_chat_input_is_skipped_not_fatal():
    assert chat_prefix_hashes("not a list") == []
    assert chat_prefix_hashes(None) == []
    ok = [{"role": "user", "content": "x"}]
    assert chat_prefix_hashes([42, *ok, "junk"]) == chat_prefix_hashes(ok)
    assert chat_prefix_hashes([{"role": 3, "content": 7}]) == prefix_hashes("\x1f\x1f7\x1e")
