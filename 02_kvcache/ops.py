"""Backend dispatch for the block ops: `backend="torch" | "triton" | "cuda"`.

    copy_blocks(key_caches, value_caches, block_mapping, backend)   copy-on-write copies
    swap_blocks(src_caches, dst_caches, block_mapping, backend)     GPU <-> CPU swapping

block_mapping is an int tensor [num_pairs, 2] or the list of (src, dst) pairs the
KVCacheManager returns. The torch backend is the oracle and always works on CPU; triton
runs under the interpreter on CPU (TRITON_INTERPRET=1); cuda needs a GPU.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvcache import reference
from kvcache.reference import as_block_mapping

BACKENDS = ("torch", "triton", "cuda")


def _backend_module(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kvcache import triton_ops
        return triton_ops
    if backend == "cuda":
        from kvcache import cuda_ops
        return cuda_ops
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], block_mapping,
                backend: str = "torch", check_values: bool = True) -> None:
    """In place, for every layer: cache[dst] = cache[src] for each (src, dst) pair."""
    module = _backend_module(backend)
    module.copy_blocks(key_caches, value_caches, as_block_mapping(block_mapping), check_values=check_values)


def swap_blocks(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor], block_mapping,
                backend: str = "torch", check_values: bool = True) -> None:
    """In place: dst_caches[i][dst] = src_caches[i][src] for each (src, dst) pair."""
    module = _backend_module(backend)
    module.swap_blocks(src_caches, dst_caches, as_block_mapping(block_mapping), check_values=check_values)
