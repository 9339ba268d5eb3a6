"""Chained block hashes: the identity of a full KV block is its whole prefix, not its 16 tokens.

Mirrors `hash_block_tokens`, `hash_request_tokens`, `generate_block_hash_extra_keys` and
`BlockHash` in vLLM's `vllm/v1/core/kv_cache_utils.py`.

Why chained: a block's K/V depend on every token before it (attention mixes the whole
prefix into each position), so the same 16 tokens after a different prefix are a
different block. Hashing (parent hash, this block's tokens, extra keys) makes equal
hashes mean equal prefixes, and a lookup is one dict probe per block.

Why only full blocks: a partial block is still being written; its hash would change with
every new token, and another request must never reuse a half-filled block.

Extra keys separate blocks whose tokens agree but whose K/V do not: a LoRA adapter
changes the K/V projections (key on every block), and a cache salt isolates tenants
(keyed on the first block only — the chain carries it to every later block).
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, NamedTuple, Sequence

# The "parent hash" of a request's first block. A fixed value keeps runs reproducible;
# vLLM draws it at random per process (unless PYTHONHASHSEED is set) so that hash values
# cannot be predicted by someone probing a shared cache — use `cache_salt` for isolation.
NONE_HASH = 0x5EED_CAFE_F00D_BEEF

HashFn = Callable[[Any], int]


def sha256_hash(obj: Any) -> int:
    """Collision-resistant, identical in every process (unlike `hash` of a str under
    PYTHONHASHSEED randomisation) — what a cache shared between processes needs (chapter 06)."""
    return int.from_bytes(hashlib.sha256(pickle.dumps(obj, protocol=5)).digest(), "big")


# sha256 is the default (vLLM's since CVE-2025-25183): Python's `hash` of a tuple of ints is
# deterministic and cheap to invert, so a client can craft a prompt whose block hashes collide
# with another tenant's cached blocks and be served their K/V. "builtin" stays as a measured
# option (benchmarks/bench_kvcache.py: the cost of sha256 per lookup).
HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": hash, "sha256": sha256_hash}


def get_hash_fn(name_or_fn: str | HashFn) -> HashFn:
    if callable(name_or_fn):
        return name_or_fn
    try:
        return HASH_FUNCTIONS[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown hash function {name_or_fn!r}; choose one of {sorted(HASH_FUNCTIONS)} or pass a callable") from None


class BlockHash(NamedTuple):
    """What a cached block is keyed by, plus what the collision check compares.

    `hash_value` alone indexes the cache. `parent_hash_value`, `token_ids` and `extra_keys`
    are the hashed content itself, kept so that a lookup can verify a hit (the
    collision defence of [v1 prefix caching]) and so that chain-aware eviction can find a block's parent.
    """
    hash_value: int
    parent_hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None


def hash_block_tokens(
    parent_block_hash: int | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    hash_fn: HashFn = sha256_hash,
) -> BlockHash:
    """hash_i = H(hash_{i-1}, tokens_i, extra_keys_i); the first block's parent is NONE_HASH."""
    ### BEGIN SOLUTION
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    token_ids = tuple(curr_block_token_ids)
    return BlockHash(hash_fn((parent, token_ids, extra_keys)), parent, token_ids, extra_keys)
    ### END SOLUTION


def generate_block_hash_extra_keys(request: Any, block_index: int) -> tuple | None:
    """Extra keys of one block, read from optional request attributes (absent = None)."""
    keys: list = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        # vLLM 0.32: the adapter's name and path, not just its id, so that an id (or a name) pointed at
        # another adapter later never reuses K/V the first one computed -- nor does another engine's.
        keys.append(("lora", lora.lora_name, lora.lora_path))
    elif getattr(request, "lora_int_id", None):     # a bare id; 0 / None = no adapter, as in vLLM
        keys.append(("lora", request.lora_int_id))
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt is not None and block_index == 0:
        keys.append(("salt", cache_salt))
    return tuple(keys) if keys else None


def append_block_hashes(block_hashes: list[BlockHash], request: Any, block_size: int,
                        hash_fn: HashFn = sha256_hash, *, root_hash: int | None = None) -> list[BlockHash]:
    """Extend `block_hashes` (in place) to cover every FULL block of `request.all_token_ids`.

    Incremental on purpose: a decoding request gains one token per step, and rehashing its
    whole prompt each step would make the scheduler O(prompt length) per token.

    `root_hash` is the first block's parent (None: NONE_HASH). One engine needs no other; a
    cache shared by engines (chapter 06) seeds the chain with the model's identity, so the
    chains of two models never meet — the role of vLLM's per-deployment hash seed.
    """
    ### BEGIN SOLUTION
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1].hash_value if block_hashes else root_hash
    for i in range(len(block_hashes), num_full_blocks):
        block_tokens = token_ids[i * block_size:(i + 1) * block_size]
        h = hash_block_tokens(parent, block_tokens, generate_block_hash_extra_keys(request, i), hash_fn)
        block_hashes.append(h)
        parent = h.hash_value
    return block_hashes
    ### END SOLUTION


def hash_request_tokens(block_size: int, request: Any, hash_fn: HashFn = sha256_hash, *,
                        root_hash: int | None = None) -> list[BlockHash]:
    """The hash chain of every full block of a request (one-shot form of `append_block_hashes`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return append_block_hashes([], request, block_size, hash_fn, root_hash=root_hash)
