"""Chapter 02: the KV cache manager — block pool, prefix caching with chained hashes, LRU
eviction, copy-on-write sharing and a CPU swap tier (vLLM v0's BlockSpaceManager); plus the block copy/swap ops."""
from kvcache.block import FreeKVCacheBlockQueue, KVCacheBlock
from kvcache.block_pool import EVICTION_POLICIES, BlockPool
from kvcache.block_pool_v1 import BlockPoolV1
from kvcache.block_pool_v2 import BlockPoolV2
from kvcache.hashing import (NONE_HASH, BlockHash, append_block_hashes, generate_block_hash_extra_keys,
                             hash_block_tokens, hash_request_tokens, sha256_hash)
from kvcache.interfaces import KVCacheBlocks, KVCacheRequest, RequestTooLargeError, SimpleRequest
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.block_space_manager import BlockSpaceManager
from kvcache.stats import PrefixCacheStats

__all__ = [
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "BlockPoolV1", "BlockPoolV2", "EVICTION_POLICIES",
    "NONE_HASH", "BlockHash", "hash_block_tokens", "hash_request_tokens", "append_block_hashes",
    "generate_block_hash_extra_keys", "sha256_hash",
    "KVCacheBlocks", "KVCacheRequest", "PrefixCacheStats", "RequestTooLargeError", "SimpleRequest",
    "KVCacheManager", "BlockSpaceManager",
]
