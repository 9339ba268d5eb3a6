"""Chained block hashing: exact chain semantics, extra keys, incremental extension."""
import os
import subprocess
import sys

import pytest

from kvcache import NONE_HASH, SimpleRequest, append_block_hashes, hash_block_tokens, hash_request_tokens, sha256_hash


def test_chain_covers_parent_tokens_and_extra_keys():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.parent_hash_value == NONE_HASH and h0.token_ids == (1, 2, 3, 4) and h0.extra_keys is None
    assert h0.hash_value == sha256_hash((NONE_HASH, (1, 2, 3, 4), None))      # sha256 is the default
    # Same tokens, different parent -> a different HASH VALUE ([v1 prefix caching], "why chaining matters").
    # (Comparing whole BlockHash tuples would pass even for a hash that ignored the parent: the
    # tuples differ in their parent field anyway.)
    assert hash_block_tokens(h0.hash_value, [5, 6, 7, 8]).hash_value != hash_block_tokens(123, [5, 6, 7, 8]).hash_value
    assert hash_block_tokens(h0.hash_value, [5, 6, 7, 8]).hash_value == \
        hash_block_tokens(h0.hash_value, (5, 6, 7, 8)).hash_value
    assert hash_block_tokens(None, [1, 2, 3, 4], (("lora", 1),)).hash_value != h0.hash_value


def test_the_parent_check_catches_a_hash_that_ignores_the_parent():
    """The assertion above is falsifiable: a hash function that drops the parent fails it."""
    def ignores_parent(obj):
        return sha256_hash(obj[1:])
    a = hash_block_tokens(1, [5, 6, 7, 8], hash_fn=ignores_parent)
    b = hash_block_tokens(2, [5, 6, 7, 8], hash_fn=ignores_parent)
    assert a != b and a.hash_value == b.hash_value


def test_default_hash_is_sha256_everywhere():
    """vLLM's default since CVE-2025-25183: Python's hash of ints/tuples is predictable, so an
    attacker can construct prompts whose blocks collide with another tenant's."""
    from kvcache import KVCacheManager
    assert KVCacheManager(4, 4).hash_fn is sha256_hash
    r = SimpleRequest("r", list(range(8)))
    assert hash_request_tokens(4, r) == hash_request_tokens(4, r, sha256_hash)


def test_only_full_blocks_are_hashed():
    r = SimpleRequest("r", list(range(11)))
    hashes = hash_request_tokens(4, r)
    assert [h.token_ids for h in hashes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hashes[1].parent_hash_value == hashes[0].hash_value


def test_same_block_after_a_different_prefix_hashes_differently():
    a = SimpleRequest("a", [1] * 4 + [9] * 4)
    b = SimpleRequest("b", [2] * 4 + [9] * 4)
    ha, hb = hash_request_tokens(4, a), hash_request_tokens(4, b)
    assert ha[1].token_ids == hb[1].token_ids and ha[1].hash_value != hb[1].hash_value


def test_incremental_extension_equals_one_shot_and_hashes_each_block_once():
    calls = []

    def counting_hash(obj):
        calls.append(obj)
        return sha256_hash(obj)

    r = SimpleRequest("r", list(range(5)))
    hashes = []
    for t in range(5, 41):                    # decode one token at a time
        append_block_hashes(hashes, r, 4, counting_hash)
        r.append_output_token_ids(t)
    append_block_hashes(hashes, r, 4, counting_hash)
    assert hashes == hash_request_tokens(4, r)
    assert len(calls) == 41 // 4               # O(blocks) total, not O(steps x blocks)


def test_lora_keys_every_block_salt_only_the_first():
    r = SimpleRequest("r", list(range(8)), lora_int_id=3, cache_salt="tenant-a")
    h = hash_request_tokens(4, r)
    assert h[0].extra_keys == (("lora", 3), ("salt", "tenant-a"))
    assert h[1].extra_keys == (("lora", 3),)
    plain = hash_request_tokens(4, SimpleRequest("p", list(range(8))))
    other_salt = hash_request_tokens(4, SimpleRequest("s", list(range(8)), lora_int_id=3, cache_salt="tenant-b"))
    # The salt is keyed once, but the chain carries it: every block differs.
    assert all(x.hash_value != y.hash_value for x, y in zip(h, plain))
    assert all(x.hash_value != y.hash_value for x, y in zip(h, other_salt))
    # lora_int_id 0 means "no adapter", as in vLLM.
    assert hash_request_tokens(4, SimpleRequest("z", list(range(8)), lora_int_id=0)) == plain


def test_root_hash_seeds_the_whole_chain():
    """A cache shared by engines seeds the chain with the model's identity (chapter 06): the same
    tokens under two roots share no block hash, and root None is the one-engine chain."""
    r = SimpleRequest("r", list(range(12)))
    plain = hash_request_tokens(4, r)
    assert hash_request_tokens(4, r, root_hash=None) == plain
    assert plain[0].parent_hash_value == NONE_HASH
    seeded = hash_request_tokens(4, r, root_hash=1234)
    assert seeded[0].parent_hash_value == 1234
    assert not {h.hash_value for h in seeded} & {h.hash_value for h in plain}
    other = hash_request_tokens(4, r, root_hash=1235)
    assert not {h.hash_value for h in seeded} & {h.hash_value for h in other}
    incremental = append_block_hashes(hash_request_tokens(4, SimpleRequest("r", list(range(4))), root_hash=1234),
                                      r, 4, root_hash=1234)
    assert incremental == seeded


def test_sha256_is_stable_across_processes_builtin_str_hash_is_not():
    """The chain's hash (sha256, the default) is the same in every process; Python's builtin hash
    of the salt string is not. The subprocesses run THIS tree's hashing (tests/this_tree.py), the
    code this test process imported, not whatever `kvcache` the environment installs."""
    from this_tree import python_in_this_tree
    code = ("from kvcache import SimpleRequest, hash_request_tokens;"
            "r = SimpleRequest('r', list(range(8)), cache_salt='s');"
            "print(hash_request_tokens(4, r)[-1].hash_value, hash_request_tokens(4, r, hash)[-1].hash_value)")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(python_in_this_tree(code), env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"the subprocess failed: {proc.stderr.strip().splitlines()[-1:]}"
        outs.append(proc.stdout.split())
    here = hash_request_tokens(4, SimpleRequest("r", list(range(8)), cache_salt="s"))[-1].hash_value
    assert outs[0][0] == outs[1][0] == str(here)   # sha256 (the default): same in every process, this one too
    assert outs[0][1] != outs[1][1]                # builtin: the salt string is hashed differently per process


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens(0, SimpleRequest("r", [1]))
