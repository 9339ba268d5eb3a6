"""Multi-LoRA's shrink and expand in batched PyTorch (backend "torch"): no Python loop over tokens,
runs on any device. The two ways of batching different adapters are Punica's:

* BGMV (batched gather matrix-vector): every token GATHERS its own adapter's matrices —
  lora_a[token_lora] is [T, num_slices, max_rank, in] — and one batched matmul multiplies each
  token by its own copy. No host work, no sync, one op whatever the mix of adapters; but the
  gather copies an adapter per TOKEN, which for T tokens is T times the adapter. Right for
  the smallest decode steps: a token or two, each likely another request's adapter.
* SGMV (segmented gather matrix-vector): the tokens are grouped into SEGMENTS that share one
  adapter (`reference.segments_from_token_lora`, sorted: one segment per adapter in the batch),
  and each segment is one ordinary matmul against its adapter, read once. Right for prefill and
  big batches: 256 tokens of 8 adapters are 8 matmuls. Costs a host sync (the segment bounds
  drive the Python loop) and a few small ops to find the segments.

`use_bgmv` is the rule between them (`method=None`): BGMV up to BGMV_MAX_TOKENS tokens, SGMV
above. On a CPU the crossover is early (measured while writing this op, SmolLM2's qkv: at 1 token BGMV
was ahead, 215 vs 299 us; at 4 tokens SGMV was; at 16 BGMV took 2.7x as long and at 256 17x: the
gather copies one adapter per token). On a GPU
BGMV's other merit, no host sync, would move the crossover up (vLLM's punica_cpu uses bgmv for
every decode batch).

vLLM: vllm/lora/ops/torch_ops/lora_ops.py (bgmv_shrink / bgmv_expand gather per token;
sgmv_* expand the segments back to one index per token and call bgmv), used by
vllm/lora/punica_wrapper/punica_cpu.py, which picks sgmv for prefill and bgmv for decode.
Both methods compute in fp32 and round once, like the reference.
"""
from __future__ import annotations

from typing import Sequence

import torch

from lora.reference import (ScaleLike, TokenLoraLike, check_expand_args, check_shrink_args,
                            segments_from_token_lora)

__all__ = ["BGMV_MAX_TOKENS", "lora_expand", "lora_shrink", "use_bgmv"]

BGMV_MAX_TOKENS = 2         # BGMV for batches of at most this many tokens, SGMV above (measured on a CPU)
METHODS = ("bgmv", "sgmv")


def use_bgmv(num_tokens: int, method: str | None = None) -> bool:
    """The rule: BGMV (gather per token) for a decode-sized batch, SGMV (a matmul per adapter) above."""
    if method is None:
        return num_tokens <= BGMV_MAX_TOKENS
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None (the rule), got {method!r}")
    return method == "bgmv"


# ------------------------------------------------------------------------------- shrink

def shrink_bgmv(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                out: torch.Tensor) -> None:
    T, (num_slots, num_slices, max_rank, hidden) = x.shape[0], lora_a.shape
    safe = slots.clamp(min=0)                                             # -1 gathers slot 0, then is zeroed
    a = lora_a[safe].float().view(T, num_slices * max_rank, hidden)     # each token's own A: [T, S*R, in]
    res = torch.bmm(a, x.float()[:, :, None]).view(T, num_slices, max_rank)
    res = res * torch.where(slots >= 0, scales[safe], 0.0)[:, None, None]   # scale_i, or 0: no adapter
    out.copy_(res.permute(1, 0, 2))


def shrink_sgmv(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                out: torch.Tensor) -> None:
    num_slots, num_slices, max_rank, hidden = lora_a.shape
    seg = segments_from_token_lora(slots, sort=True)
    x_sorted = x[seg.order].float()                                      # the batch, adapter after adapter
    res = torch.zeros(x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
    for start, length, slot in zip(seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()):
        if slot < 0:
            continue                                                     # no adapter: its rows stay zero
        a = lora_a[slot].float().view(num_slices * max_rank, hidden)    # read once for the segment
        torch.matmul(x_sorted[start:start + length], a.T, out=res[start:start + length])   # one matmul
        res[start:start + length] *= scales[slot]
    out[:, seg.order] = res.view(-1, num_slices, max_rank).permute(1, 0, 2)   # back to batch order


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: TokenLoraLike, scale: ScaleLike,
                out: torch.Tensor, check_values: bool = True, *, method: str | None = None) -> None:
    slots, scales = check_shrink_args(x, lora_a, token_lora, scale, out, check_values)
    if x.shape[0] == 0:
        return
    (shrink_bgmv if use_bgmv(x.shape[0], method) else shrink_sgmv)(x, lora_a, slots, scales, out)


# ------------------------------------------------------------------------------- expand

def _write_slices(y: torch.Tensor, rows, delta: torch.Tensor, offsets, sizes, add_inputs: bool,
                  keep: torch.Tensor | None = None) -> None:
    """y[rows, slice s] (+)= delta[:, s, :size_s], rounded once to y's dtype; where `keep` is True
    ([len(rows), 1]) the old value stays instead."""
    for s, (off, size) in enumerate(zip(offsets, sizes)):
        old = y[rows, off:off + size]
        new = ((old.float() + delta[:, s, :size]) if add_inputs else delta[:, s, :size]).to(y.dtype)
        y[rows, off:off + size] = new if keep is None else torch.where(keep, old, new)


def expand_bgmv(buffer: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                offsets: Sequence[int], sizes: Sequence[int], add_inputs: bool) -> None:
    num_slots, num_slices, max_out, max_rank = lora_b.shape
    T = y.shape[0]
    safe = slots.clamp(min=0)
    b = lora_b[safe].float().view(T, num_slices * max_out, max_rank)   # each token's own B: [T, S*N, R]
    u = buffer.permute(1, 0, 2)                                         # [T, S, R]
    # Token t, slice s: B_s [N, R] @ u[t, s] -- a batch of T * S matrix-vector products.
    delta = torch.bmm(b.view(T * num_slices, max_out, max_rank), u.reshape(T * num_slices, max_rank, 1))
    _write_slices(y, slice(None), delta.view(T, num_slices, max_out), offsets, sizes, add_inputs,
                  keep=(slots < 0)[:, None])                            # no adapter: the old value, exactly


def expand_sgmv(buffer: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                offsets: Sequence[int], sizes: Sequence[int], add_inputs: bool) -> None:
    num_slots, num_slices, max_out, max_rank = lora_b.shape
    seg = segments_from_token_lora(slots, sort=True)
    first = int(seg.lengths[0]) if int(seg.slots[0]) < 0 else 0         # -1 sorts first: skip those tokens
    rows = seg.order[first:]
    u = buffer[:, rows]                                                 # [S, T_a, R], adapter after adapter
    delta = torch.empty(num_slices, len(rows), max_out, dtype=torch.float32, device=y.device)
    for start, length, slot in zip(seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()):
        if slot < 0:
            continue
        here = slice(start - first, start - first + length)
        # Every slice of the segment in one batched matmul: [S, len, R] @ [S, R, N]
        torch.bmm(u[:, here], lora_b[slot].float().transpose(1, 2), out=delta[:, here])
    _write_slices(y, rows, delta.permute(1, 0, 2), offsets, sizes, add_inputs)


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: TokenLoraLike, y: torch.Tensor,
                slice_offsets: Sequence[int], slice_sizes: Sequence[int] | None = None, add_inputs: bool = True,
                check_values: bool = True, *, method: str | None = None) -> None:
    slots, offsets, sizes = check_expand_args(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes, check_values)
    if y.shape[0] == 0:
        return
    (expand_bgmv if use_bgmv(y.shape[0], method) else expand_sgmv)(buffer, lora_b, slots, y, offsets, sizes,
                                                                      add_inputs)
