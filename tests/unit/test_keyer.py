"""BlockKeyer: chained xxh3 keys over full blocks, root seeded by model, LoRA and salt."""

import struct
from array import array

import pytest
import xxhash

from kvindex.keyer import BlockKeyer, KeyerCaches, root_key


def reference_keys(model, block_size, tokens, lora=None, salt=None):
    """The documented definition, written out independently of the implementation."""

    def field(v):
        if v is None:
            return b"\x00"
        raw = v.encode()
        return b"\x01" + struct.pack("<I", len(raw)) + raw

    parent = xxhash.xxh3_64_intdigest(b"kvgate-v1" + field(model) + field(lora) + field(salt))
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *block)
        parent = xxhash.xxh3_64_intdigest(data)
        keys.append(parent)
    return keys


TOKENS = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16, 4 left over


def test_keys_follow_the_documented_definition():
    assert BlockKeyer("m", 16).keys(TOKENS) == reference_keys("m", 16, TOKENS)


def test_ids_given_as_a_uint32_array_get_the_same_keys():
    """Tokenization hands over ``array("I")`` ids; they are packed as they are."""
    assert BlockKeyer("m", 16).keys(array("I", TOKENS)) == reference_keys("m", 16, TOKENS)


def test_only_full_blocks_are_keyed():
    keyer = BlockKeyer("m", 16)
    assert len(keyer.keys(TOKENS)) == 6
    assert keyer.keys(TOKENS[:15]) == []
    assert keyer.keys([]) == []


def test_a_prefix_has_the_prefix_of_the_keys():
    keyer = BlockKeyer("m", 16)
    assert keyer.keys(TOKENS[:48]) == keyer.keys(TOKENS)[:3]


def test_one_changed_token_changes_its_block_and_every_later_key():
    keyer = BlockKeyer("m", 16)
    changed = TOKENS[:20] + [7] + TOKENS[21:]
    a, b = keyer.keys(TOKENS), keyer.keys(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_model_lora_and_salt_each_seed_a_different_root():
    roots = {
        root_key("m"),
        root_key("other"),
        root_key("m", lora_name="adapter"),
        root_key("m", cache_salt="s"),
        root_key("m", lora_name="adapter", cache_salt="s"),
        root_key("m", lora_name="", cache_salt=None),
        root_key("m", lora_name=None, cache_salt=""),
    }
    assert len(roots) == 7


def test_lora_and_salt_keys_match_the_reference():
    keyer = BlockKeyer("m", 16, lora_name="ad", cache_salt="salt")
    assert keyer.keys(TOKENS) == reference_keys("m", 16, TOKENS, lora="ad", salt="salt")


def test_keys_for_a_request_equal_a_keyer_built_with_that_lora_and_salt():
    plain = BlockKeyer("m", 16)
    assert plain.keys_for(TOKENS, "ad", "salt") == BlockKeyer("m", 16, "ad", "salt").keys(TOKENS)


def test_long_client_salts_keep_no_more_than_the_roots_bound_reports():
    """A request's ``cache_salt`` is the client's, of any length its body allows: a
    hostile client sending a thousand salts of megabytes must not leave them all in the
    root cache. The keys are still the definition's."""
    import gc
    import tracemalloc

    keyer = BlockKeyer("m", 16)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            salt = f"{i}:" + "s" * 100_000
            assert keyer.keys_for(TOKENS, None, salt) == reference_keys("m", 16, TOKENS,
                                                                      salt=salt)  # fmt: skip
        del salt  # the test's own reference to the last one
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    bound = keyer.caches.bounds()["keyer_roots"]
    assert retained <= bound.size * bound.bytes_each + 4096  # 2 MB of salts before the fix
    assert keyer.keys_for(TOKENS, "ad", "short") == reference_keys("m", 16, TOKENS, "ad", "short")
    assert (
        keyer.caches.bounds()["keyer_roots"].size == bound.size + 1
    )  # short ones are still remembered


def test_chain_continues_from_a_parent_key():
    keyer = BlockKeyer("m", 16)
    whole = keyer.keys(TOKENS)
    assert keyer.chain(whole[1], TOKENS[32:]) == whole[2:]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        BlockKeyer("m", 0)


def test_token_ids_outside_uint32_are_rejected():
    with pytest.raises(OverflowError):
        BlockKeyer("m", 2).keys([1, 2**32])


def test_a_32k_token_prompt_is_keyed_by_the_definition_to_its_last_block():
    """Speed is `kvgate bench index`'s and `kvgate bench tokenize`'s to report; here the
    long prompt's keys, an array's as a list's, are the definition's."""
    keyer = BlockKeyer("m", 16)
    tokens = [(i * 7919) % 150_000 for i in range(32_768)]
    keys = keyer.keys(array("I", tokens))
    assert len(keys) == 2048
    assert keys == keyer.keys(tokens) == reference_keys("m", 16, tokens)


# -- remembered heads ---------------------------------------------------------------------


def _prompts_sharing_prefixes(rng, n=60):
    """Prompts that extend, share a head with, or differ from earlier ones."""
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(0, 1200))]]
    for _ in range(n):
        base = rng.choice(prompts)
        cut = rng.randrange(len(base) + 1)
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(0, 700))]
        prompts.append(base[:cut] + tail)
    return prompts


@pytest.mark.parametrize("capacity", [1, 40, 1 << 16])
def test_keys_through_remembered_heads_are_the_keys(capacity):
    """Prompts sharing heads of every length (group ends, block ends, mid-block), under
    several roots, with room for no remembered head, for two groups, or plenty."""
    import random

    rng = random.Random(capacity)
    keyer = BlockKeyer("m", 16, head_keys=capacity)
    for tokens in _prompts_sharing_prefixes(rng):
        lora, salt = rng.choice([(None, None), ("ad", None), (None, "s")])
        got = keyer.keys_for(array("I", tokens), lora, salt)
        assert got == reference_keys("m", 16, tokens, lora, salt)
    assert keyer.caches.bounds()["keyer_heads"].size <= capacity


def test_a_repeated_head_is_not_keyed_again(monkeypatch):
    """The next turn of a conversation keys only the blocks after its last full group
    the keyer has seen; a new root (another salt) shares nothing."""
    import kvindex.keyer as keyer_module

    keyed: list[int] = []
    real = keyer_module.chain_packed

    def counting(parent, packed, block_size, n_blocks):
        keyed.append(n_blocks)
        return real(parent, packed, block_size, n_blocks)

    monkeypatch.setattr(keyer_module, "chain_packed", counting)
    keyer = BlockKeyer("m", 4)
    turn1 = list(range(4 * 40 + 3))  # 40 blocks: groups 0-1 (32 blocks) and 8 more
    turn2 = turn1 + list(range(900, 900 + 4 * 30))  # 70 blocks
    assert keyer.keys(turn1) == reference_keys("m", 4, turn1)
    assert keyed == [40]
    assert keyer.keys(turn2) == reference_keys("m", 4, turn2)
    assert keyed[1:] == [70 - 32]  # from the end of the groups turn 1 left
    assert keyer.keys_for(turn2, None, "other") == reference_keys("m", 4, turn2, salt="other")
    assert keyed[2:] == [70]


def test_keyers_sharing_caches_keep_their_models_and_block_sizes_apart():
    """One ``KeyerCaches`` serves every model's keyer in a gateway. The same tokens from
    another model, or in blocks of another size (512 tokens: 32 blocks of 16 or 16 of 32,
    one digest of the same root and tokens at a group's end), are other keys."""
    caches = KeyerCaches()
    tokens = array("I", range(512))
    keyers = [BlockKeyer("m", 16, caches=caches), BlockKeyer("m", 32, caches=caches),
              BlockKeyer("n", 16, caches=caches)]  # fmt: skip
    for _ in range(2):  # the second pass reads what the first remembered
        for keyer in keyers:
            assert keyer.keys(tokens) == reference_keys(keyer.model, keyer.block_size, tokens)
            assert keyer.keys_for(tokens, "ad", "s") == reference_keys(
                keyer.model, keyer.block_size, tokens, "ad", "s"
            )
    assert (
        keyers[0].caches.bounds()["keyer_heads"]
        == keyers[2].caches.bounds()["keyer_heads"]
        == caches.bounds()["keyer_heads"]
    )


def test_a_keyer_of_its_own_is_bounded_by_its_head_keys():
    keyer = BlockKeyer("m", 16, head_keys=40)
    assert keyer.caches.bounds()["keyer_heads"].capacity == 40
    assert (
        BlockKeyer("m", 16).caches.bounds()["keyer_heads"].size == 0
    )  # nothing shared between them
