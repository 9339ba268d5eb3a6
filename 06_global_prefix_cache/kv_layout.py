"""Where a node's K/V bytes live: the registered tensors, as address ranges of blocks.

vLLM's worker-side connectors get `kv_caches: dict[layer_name, Tensor]` in
`register_kv_caches` and from then on think in addresses: the base address of each tensor
and `block_len = tensor.nbytes // num_blocks` ([vLLM 2.0 part 2, §7.3.3]: block b of a layer starts at
base + b * block_len). Chapter 02's `CacheEngine` keeps one K and one V tensor per layer,
each [num_blocks, block_size, num_kv_heads, head_dim]: 2 * num_layers regions.

A `BlockSegment` is the same layout in ordinary CPU memory with its own slot count: the
node's share of the global pool (Mooncake: `global_segment_size`) and its send buffer.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from global_prefix_cache.grouping import Region
from kvcache.cache_engine import CacheEngine, KVCacheSpec
from kvcache.hashing import sha256_hash
from kvcache.reference import swap_blocks


@dataclass(frozen=True)
class NodeSpec:
    """What two nodes must agree on before K/V bytes can move between them: the whole engine's
    K/V (every layer, every KV head) and how its ranks split it. Rank r of one engine moves
    bytes only to rank r of another, so both must cut the heads (tp_size) and the layers
    (pp_size) the same way."""
    model: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_kv_spec(cls, model: str, spec: KVCacheSpec, tp_size: int = 1, pp_size: int = 1) -> "NodeSpec":
        return cls(model, spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                   str(spec.dtype).removeprefix("torch."), tp_size, pp_size)

    @property
    def world_size(self) -> int:
        """Ranks per engine: each saves and loads its own share of every block."""
        return self.tp_size * self.pp_size

    @classmethod
    def from_dict(cls, fields: Any, what: str = "spec") -> "NodeSpec":
        """A spec that arrived from another process: every field present, of its type, in range.
        ValueError otherwise (never a TypeError from deep inside a later comparison)."""
        if not isinstance(fields, dict):
            raise ValueError(f"{what} must be a dict of {list(_SPEC_TYPES)}, got {type(fields).__name__}")
        if set(fields) != set(_SPEC_TYPES):
            raise ValueError(f"{what} must have exactly the keys {sorted(_SPEC_TYPES)}, got {sorted(fields)}")
        for key, kind in _SPEC_TYPES.items():
            value = fields[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{what}[{key!r}] must be a {kind.__name__}, got {value!r}")
            if kind is int and value <= 0:
                raise ValueError(f"{what}[{key!r}] must be positive, got {value}")
        return cls(**fields)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def root_hash(self) -> int:
        """The parent of the first block's hash in every chain this node shares (chapter 02's
        `root_hash`): K/V is a function of the model as much as of the tokens, so the same
        tokens under two specs hash to different blocks and can never be mistaken for each other."""
        return sha256_hash(("NodeSpec", tuple(sorted(self.as_dict().items()))))

    def check_compatible(self, other: "NodeSpec", what: str = "the remote node") -> None:
        """ValueError naming every field that differs: such nodes cannot share K/V blocks."""
        diffs = [f"{k}: here {v!r}, {what} {getattr(other, k)!r}" for k, v in self.__dict__.items()
                 if getattr(other, k) != v]
        if diffs:
            raise ValueError(f"K/V of {what} is not interchangeable with this node's ("
                             + "; ".join(diffs) + "): prefill and decode nodes must run the same model "
                             "with the same block size, KV dtype and tensor / pipeline parallel sizes")


_SPEC_TYPES = {"model": str, "block_size": int, "num_layers": int, "num_kv_heads": int, "head_dim": int,
               "dtype": str, "tp_size": int, "pp_size": int}


def kv_caches_from_cache_engine(cache_engine: CacheEngine) -> dict[str, torch.Tensor]:
    """Chapter 02's K/V lists as vLLM's {layer_name: tensor} (K and V as separate entries)."""
    caches = {}
    for i, (k, v) in enumerate(zip(cache_engine.key_caches, cache_engine.value_caches)):
        caches[f"layers.{i}.k_cache"] = k
        caches[f"layers.{i}.v_cache"] = v
    return caches


class KVLayout:
    """A list of same-block-count tensors, each seen as num_blocks slots of block_len bytes."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("register_kv_caches: no K/V tensors given")
        self.names = list(kv_caches)
        self.tensors = list(kv_caches.values())
        num_blocks = {t.shape[0] for t in self.tensors}
        if len(num_blocks) != 1:
            raise ValueError(f"every K/V tensor must have the same number of blocks (dim 0), got {sorted(num_blocks)}")
        for name, t in kv_caches.items():
            if not t.is_contiguous():
                raise ValueError(f"K/V tensor {name!r} is not contiguous: block b must be one byte range")
            if t.device.type != "cpu":
                raise ValueError(f"K/V tensor {name!r} is on {t.device}: this chapter moves host memory "
                                 "(GPU memory needs GPUDirect RDMA or a staging copy)")
        self.num_blocks = num_blocks.pop()
        # Each tensor as [num_blocks, block_len] bytes: the only view the transfer code needs.
        self.byte_views = [t.view(torch.uint8).reshape(self.num_blocks, -1) for t in self.tensors]
        self.regions = [Region(t.data_ptr(), v.shape[1], self.num_blocks) for t, v in zip(self.tensors, self.byte_views)]

    @property
    def bytes_per_block(self) -> int:
        return sum(r.block_len for r in self.regions)

    def check_block_ids(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} out of range 0..{self.num_blocks - 1}")
        return ids

    def block_checksums(self, block_ids: Sequence[int]) -> list[int]:
        """crc32 of each block's bytes, region by region: the block's end-to-end checksum,
        identical whether it sits in a KV cache, a pool slot or a send buffer."""
        out = []
        for b in self.check_block_ids(block_ids):
            crc = 0
            for v in self.byte_views:
                crc = zlib.crc32(v[b].numpy(), crc)
            out.append(crc)
        return out

    def pack(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[len(block_ids), bytes_per_block] uint8: each block's regions concatenated."""
        ids = torch.tensor(self.check_block_ids(block_ids), dtype=torch.long)
        return torch.cat([v.index_select(0, ids) for v in self.byte_views], dim=1)

    def unpack(self, packed: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Inverse of pack: write [n, bytes_per_block] rows into blocks `block_ids`."""
        ids = self.check_block_ids(block_ids)
        if packed.shape != (len(ids), self.bytes_per_block):
            raise ValueError(f"packed blocks {tuple(packed.shape)} != ({len(ids)}, {self.bytes_per_block})")
        index = torch.tensor(ids, dtype=torch.long)
        col = 0
        for v in self.byte_views:
            v.index_copy_(0, index, packed[:, col:col + v.shape[1]])
            col += v.shape[1]

    def copy_blocks_to(self, other: "KVLayout", src_ids: Sequence[int], dst_ids: Sequence[int],
                       regions: Iterable[int] | None = None) -> None:
        """Local copy between two layouts of the same block shape (KV cache <-> segment),
        of every K/V tensor or only those in `regions` (one layer at a time, as it is computed):
        chapter 02's swap_blocks, each tensor seen as [num_blocks, 1, 1, block_len] bytes."""
        pairs = list(zip(self.check_block_ids(src_ids), other.check_block_ids(dst_ids), strict=True))
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.long)                     # [n, 2]: (ours, other's)
        for r in (range(len(self.byte_views)) if regions is None else regions):
            ours, theirs = self.byte_views[r], other.byte_views[r]
            swap_blocks([ours.view(ours.shape[0], 1, 1, -1)], [theirs.view(theirs.shape[0], 1, 1, -1)], mapping)

    def region_indices(self, layer_name: str) -> list[int]:
        """The K/V tensors named `layer_name`, or under it ("layers.3" -> its K and its V)."""
        found = [i for i, n in enumerate(self.names) if n == layer_name or n.startswith(layer_name + ".")]
        if not found:
            raise ValueError(f"no registered K/V tensor is named {layer_name!r} or under it; names: {self.names[:4]}...")
        return found

    def same_shape_layout(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Fresh zeroed tensors shaped like ours with `num_blocks` blocks (a segment)."""
        return {n: torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype) for n, t in zip(self.names, self.tensors)}


class BlockSegment(KVLayout):
    """`capacity` block slots in CPU memory with the KV cache's layout, plus a free list.

    Used as a node's pool segment (slots handed out by the metadata server) and as its
    send buffer (slots handed out locally). Same layout on both sides means a run of
    consecutive slots is one contiguous range per K/V tensor, so grouping works here too.
    """

    def __init__(self, like: KVLayout, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"segment capacity must be > 0 blocks, got {capacity}")
        super().__init__(like.same_shape_layout(capacity))
        self.capacity = capacity
        self._free = list(range(capacity))
        self._lock = threading.Lock()      # the side-channel thread frees what the step allocated

    def allocate(self, n: int) -> list[int] | None:
        """n slots, lowest ids first (runs stay contiguous), or None if fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            self._free.sort()
            slots, self._free = self._free[:n], self._free[n:]
            return slots

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        with self._lock:
            if set(slots) & set(self._free) or any(not 0 <= s < self.capacity for s in slots):
                raise ValueError(f"freeing slots {slots}: some are already free or out of range")
            self._free.extend(slots)

    @property
    def num_free(self) -> int:
        return len(self._free)
