"""Stand-ins for chapter 02's free queue and hashing, used by the grader (course/tasks.toml
`standins`) while it grades the block manager task, so that task's grade does not depend on
the free-queue and hashing tasks. Deliberately different from the chapter's code: the queue
is a plain list (O(n) remove — correct, not fast), the hash is the same chain rule written
out directly. Each module defines apply(monkeypatch)."""
import kvcache
from kvcache import block_pool, hashing, kv_cache_manager
from kvcache.block import KVCacheBlock


class _Head:
    """What BlockPool reads as `queue.fake_free_list_head.next_free_block`: the first free block."""

    def __init__(self, queue):
        self.queue = queue

    @property
    def next_free_block(self):
        return self.queue.blocks[0] if self.queue.blocks else self.queue.fake_free_list_tail


class ListFreeQueue:
    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head = _Head(self)

    @property
    def num_free_blocks(self):
        return len(self.blocks)

    def _index(self, block):
        for i, b in enumerate(self.blocks):
            if b is block:
                return i
        raise ValueError(f"block {block.block_id} is not in the free queue")

    def popleft(self):
        if not self.blocks:
            raise ValueError("no free blocks: the free queue is empty")
        return self.blocks.pop(0)

    def remove(self, block):
        del self.blocks[self._index(block)]

    def append(self, block):
        self.blocks.append(block)

    def appendleft(self, block):
        self.blocks.insert(0, block)

    def get_all_free_blocks(self):
        return list(self.blocks)


def hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys=None, hash_fn=hashing.sha256_hash):
    parent = hashing.NONE_HASH if parent_block_hash is None else parent_block_hash
    tokens = tuple(curr_block_token_ids)
    return hashing.BlockHash(hash_fn((parent, tokens, extra_keys)), parent, tokens, extra_keys)


def append_block_hashes(block_hashes, request, block_size, hash_fn=hashing.sha256_hash, *, root_hash=None):
    tokens = request.all_token_ids
    while len(block_hashes) < len(tokens) // block_size:
        i = len(block_hashes)
        parent = block_hashes[-1].hash_value if block_hashes else root_hash
        block_hashes.append(hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size],
                                              hashing.generate_block_hash_extra_keys(request, i), hash_fn))
    return block_hashes




class SetCpuPool:
    """Stand-in for the rung-1 pool (BlockPoolV1) used as the CPU tier: a set of free ids."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free_ids = set(range(num_blocks))

    def get_num_free_blocks(self):
        return len(self.free_ids)

    @property
    def free_block_ids(self):
        return sorted(self.free_ids)

    def allocate(self, num_blocks):
        if num_blocks > len(self.free_ids):
            raise ValueError(f"out of blocks: asked for {num_blocks}, {len(self.free_ids)} free")
        ids = sorted(self.free_ids)[:num_blocks]
        self.free_ids -= set(ids)
        return ids

    def free(self, block_ids):
        if any(i in self.free_ids or not 0 <= i < self.num_blocks for i in block_ids) or len(set(block_ids)) < len(block_ids):
            raise ValueError(f"bad free of {block_ids}")
        self.free_ids |= set(block_ids)


def apply(monkeypatch):
    from kvcache import block_space_manager
    monkeypatch.setattr(block_pool, "FreeKVCacheBlockQueue", ListFreeQueue)
    for module in (hashing, kvcache, kv_cache_manager):
        monkeypatch.setattr(module, "hash_block_tokens", hash_block_tokens, raising=False)
        monkeypatch.setattr(module, "append_block_hashes", append_block_hashes, raising=False)
    monkeypatch.setattr(block_space_manager, "BlockPoolV1", SetCpuPool)
