"""Multi-LoRA's two kernels in plain PyTorch, one token at a time — the oracle every backend of
`lora_shrink` / `lora_expand` is checked against (backend "reference").

A LoRA adapter adds a low-rank correction to a linear layer: y = x W^T + scale * (x A^T) B^T,
A [rank, in], B [out, rank], rank 8-64 where in and out are hundreds or thousands. Serving many
adapters of one base model in ONE batch (Punica, S-LoRA, vLLM's --enable-lora) means every
token may carry a different adapter, or none. The base product x W^T is shared and runs as
usual; the correction is two small batched products, split at the rank:

    shrink   buffer[s, t] = scale_i * x[t] @ A_i[s]^T      [T, in] -> [num_slices, T, rank]
    expand   y[t, slice s] += buffer[s, t] @ B_i[s]^T      [num_slices, T, rank] -> [T, out]

where i = token_lora[t] is the adapter SLOT of token t (-1: no adapter: its buffer rows are zero
and its output is untouched). Every adapter the engine has loaded sits in a slot of one stacked
tensor per layer, zero-padded to the largest rank, so a kernel reaches adapter i by an index:

    lora_a  [num_slots, num_slices, max_rank, in]          x's dtype
    lora_b  [num_slots, num_slices, max_out_slice, max_rank]   y's dtype
    out / buffer  [num_slices, T, max_rank] float32

A "slice" is one piece of a packed projection (q, k, v of a fused qkv; gate, up of gate_up; 1
for a plain linear): each has its own A and B, and its outputs land side by side in y at
`slice_offsets`, `slice_sizes` wide (GQA: q is wider than k and v). An adapter of rank r <
max_rank has zero rows r.. in A and zero columns r.. in B, which contribute exact zeros: the
result is the same as with its true rank. A slot whose A and B are all zero (a freed slot,
"rank 0") adds nothing.

`scale` is LoRA's alpha / r: one float for every slot, or a float per slot. (vLLM folds it
into B when it loads an adapter and passes 1.0; the op keeps it so a test can say alpha / r.)

vLLM: vllm/lora/ops/triton_ops/lora_shrink_op.py, lora_expand_op.py (the kernels),
vllm/lora/ops/torch_ops/lora_ops.py (bgmv/sgmv in torch, the CPU path), reached through
vllm/lora/punica_wrapper/punica_gpu.py / punica_cpu.py (add_shrink, add_expand, add_lora_linear).

Also here: `segments_from_token_lora`, the grouping every fast backend starts from (SGMV), the
argument checks every backend shares, and `lora_linear`, the whole layer written the obvious way
(y = x W^T + (x A_i^T) B_i^T * scale_i per token), which the tests compose the two ops against.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

TokenLoraLike = Sequence[int] | torch.Tensor
ScaleLike = float | Sequence[float] | torch.Tensor


class Segments(NamedTuple):
    """Runs of tokens that share one adapter slot: segment j is the tokens
    order[starts[j] : starts[j] + lengths[j]], all of slot slots[j] (-1: no adapter).
    int64 tensors on token_lora's device; the segments cover every token once."""
    order: torch.Tensor      # [T] token ids, segment after segment (arange(T) unless sorted)
    starts: torch.Tensor     # [num_segments] first position of each segment in `order`
    lengths: torch.Tensor    # [num_segments] tokens in each segment (>= 1)
    slots: torch.Tensor      # [num_segments] the adapter slot of each segment


def segments_from_token_lora(token_lora: torch.Tensor, sort: bool = False) -> Segments:
    """token_lora [T] -> Segments.

    sort=False: the maximal runs of CONSECUTIVE tokens with the same slot (Punica's SGMV, vLLM v0's
    compute_meta). A prefill of one request is one run however long it is; a decode batch of
    requests with different adapters is one run per token.
    sort=True: the tokens stably sorted by slot first, so each slot is exactly one segment
    whatever the interleaving (vLLM v1's LoRAKernelMeta: token_indices_sorted_by_lora_ids);
    segments come in slot order, -1 first. A batch already grouped keeps its order."""
    token_lora = token_lora.reshape(-1).to(torch.int64)
    T = token_lora.numel()
    device = token_lora.device
    if T == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Segments(empty, empty, empty, empty)
    ### BEGIN SOLUTION
    if sort:
        order = torch.sort(token_lora, stable=True).indices          # a slot's tokens keep their order
    else:
        order = torch.arange(T, device=device)
    slots_in_order = token_lora[order]
    # A segment starts at position 0 and wherever the slot differs from the one before.
    is_start = torch.ones(T, dtype=torch.bool, device=device)
    is_start[1:] = slots_in_order[1:] != slots_in_order[:-1]
    starts = is_start.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([T], device=device)])
    return Segments(order, starts, ends - starts, slots_in_order[starts])
    ### END SOLUTION


# ------------------------------------------------------------------------------- argument checks

def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_token_lora(token_lora: TokenLoraLike, num_tokens: int, num_slots: int, device: torch.device,
                     check_values: bool = True) -> torch.Tensor:
    """token_lora as int64 [T] on `device`; ValueError unless it is T integers in [-1, num_slots).
    check_values=False skips the range check of a device tensor (a host sync)."""
    if isinstance(token_lora, torch.Tensor):
        if token_lora.dim() != 1 or token_lora.dtype.is_floating_point or token_lora.dtype.is_complex \
                or token_lora.dtype == torch.bool:
            raise ValueError(f"token_lora must be a 1-D integer tensor (the adapter slot of each token), "
                             f"got {_describe(token_lora)}")
        slots = token_lora.to(device=device, dtype=torch.int64)
        known = token_lora.device.type == "cpu" or check_values
    else:
        values = list(token_lora)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise ValueError(f"token_lora must be integers, got {values[:8]}")
        slots = torch.tensor(values, dtype=torch.int64, device=device)
        known = True
    if slots.numel() != num_tokens:
        raise ValueError(f"token_lora has {slots.numel()} entries for {num_tokens} tokens: one slot per token")
    if known and slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(f"token_lora must lie in [-1, {num_slots}) (-1: no adapter; {num_slots} slots), got "
                         f"min {int(slots.min())}, max {int(slots.max())}")
    return slots


def check_scale(scale: ScaleLike, num_slots: int, device: torch.device) -> torch.Tensor:
    """scale (one float, or one per slot) as float32 [num_slots] on `device`."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return torch.full((num_slots,), float(scale), dtype=torch.float32, device=device)
    scales = torch.as_tensor(scale, dtype=torch.float32).to(device)
    if scales.dim() != 1 or scales.numel() != num_slots:
        raise ValueError(f"scale must be a float or {num_slots} floats (one per slot), got {_describe(scales)}")
    return scales


def check_shrink_args(x: torch.Tensor, lora_a: torch.Tensor, token_lora: TokenLoraLike, scale: ScaleLike,
                      out: torch.Tensor, check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """ValueError, naming the problem, for arguments no backend can run; else (token_lora as int64
    [T], scale as float32 [num_slots]) on x's device."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [num_tokens, in] tensor, got {_describe(x)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not isinstance(lora_a, torch.Tensor) or lora_a.dim() != 4:
        raise ValueError(f"lora_a must be a 4-D [num_slots, num_slices, max_rank, in] tensor, got {_describe(lora_a)}")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a is {lora_a.dtype} but x is {x.dtype}: the A matrices must have x's dtype")
    if lora_a.shape[3] != x.shape[1]:
        raise ValueError(f"lora_a's last dim is {lora_a.shape[3]} but x has {x.shape[1]} features (in)")
    num_slots, num_slices, max_rank, _ = lora_a.shape
    T = x.shape[0]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise ValueError(f"out must be a float32 [num_slices, num_tokens, max_rank] tensor, got {_describe(out)}")
    if tuple(out.shape) != (num_slices, T, max_rank):
        raise ValueError(f"out must have shape (num_slices, num_tokens, max_rank) = {(num_slices, T, max_rank)}, "
                         f"got {tuple(out.shape)}")
    for name, t in (("lora_a", lora_a), ("out", out)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    slots = check_token_lora(token_lora, T, num_slots, x.device, check_values)
    return slots, check_scale(scale, num_slots, x.device)


def check_expand_args(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: TokenLoraLike, y: torch.Tensor,
                      slice_offsets: Sequence[int], slice_sizes: Sequence[int] | None = None,
                      check_values: bool = True) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """ValueError, naming the problem, for arguments no backend can run; else (token_lora as int64
    [T] on y's device, slice_offsets, slice_sizes) with slice_sizes None -> max_out_slice each."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y must be a 2-D [num_tokens, total_out] tensor, got {_describe(y)}")
    if y.dtype not in DTYPES:
        raise ValueError(f"y must be float32, bfloat16 or float16, got {y.dtype}")
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != 4:
        raise ValueError(f"lora_b must be a 4-D [num_slots, num_slices, max_out_slice, max_rank] tensor, got "
                         f"{_describe(lora_b)}")
    if lora_b.dtype != y.dtype:
        raise ValueError(f"lora_b is {lora_b.dtype} but y is {y.dtype}: the B matrices must have y's dtype")
    num_slots, num_slices, max_out, max_rank = lora_b.shape
    T = y.shape[0]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32 or buffer.dim() != 3:
        raise ValueError(f"buffer must be a float32 [num_slices, num_tokens, max_rank] tensor (lora_shrink's out), "
                         f"got {_describe(buffer)}")
    if tuple(buffer.shape) != (num_slices, T, max_rank):
        raise ValueError(f"buffer must have shape (num_slices, num_tokens, max_rank) = {(num_slices, T, max_rank)} "
                         f"(lora_b's slices and rank, y's tokens), got {tuple(buffer.shape)}")
    for name, t in (("lora_b", lora_b), ("buffer", buffer)):
        if t.device != y.device:
            raise ValueError(f"{name} is on {t.device} but y is on {y.device}")
    offsets = tuple(slice_offsets)
    sizes = tuple(slice_sizes) if slice_sizes is not None else (max_out,) * num_slices
    for name, v in (("slice_offsets", offsets), ("slice_sizes", sizes)):
        if len(v) != num_slices or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ValueError(f"{name} must be {num_slices} integers (one per slice), got {v}")
    intervals = []
    for s, (off, size) in enumerate(zip(offsets, sizes)):
        if not 0 <= size <= max_out:
            raise ValueError(f"slice {s} is {size} wide but lora_b holds {max_out} output rows per slice")
        if off < 0 or off + size > y.shape[1]:
            raise ValueError(f"slice {s} covers columns [{off}, {off + size}) but y has {y.shape[1]} columns")
        intervals.append((off, off + size))
    intervals.sort()
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        if start < end:
            raise ValueError(f"slices overlap in y (columns {start}..{end}): each output column belongs to one slice")
    slots = check_token_lora(token_lora, T, num_slots, y.device, check_values)
    return slots, offsets, sizes


# ------------------------------------------------------------------------------- the ops

def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: TokenLoraLike, scale: ScaleLike,
                out: torch.Tensor, check_values: bool = True) -> None:
    """out[s, t] = scale_i * x[t] @ lora_a[i, s]^T, i = token_lora[t]; zero rows where i = -1. One
    token, one slice at a time; fp32 arithmetic whatever x's dtype."""
    slots, scales = check_shrink_args(x, lora_a, token_lora, scale, out, check_values)
    num_slices = lora_a.shape[1]
    ### BEGIN SOLUTION
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            out[:, t] = 0.0                       # no adapter: written, not skipped (expand skips them)
            continue
        x_t = x[t].float()                        # [in]
        for s in range(num_slices):
            # [max_rank, in] @ [in] -> [max_rank]; rows past the adapter's rank are zeros, so are theirs
            out[s, t] = scales[slot] * (lora_a[slot, s].float() @ x_t)
    ### END SOLUTION


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: TokenLoraLike, y: torch.Tensor,
                slice_offsets: Sequence[int], slice_sizes: Sequence[int] | None = None, add_inputs: bool = True,
                check_values: bool = True) -> None:
    """y[t, off_s : off_s + size_s] (+)= buffer[s, t] @ lora_b[i, s, :size_s]^T for every token with an
    adapter i = token_lora[t] (add_inputs=False: written instead of added); tokens with -1 are left
    untouched. fp32 arithmetic, one rounding to y's dtype per element."""
    slots, offsets, sizes = check_expand_args(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes, check_values)
    ### BEGIN SOLUTION
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue                              # no adapter: y keeps the base layer's output
        for s, (off, size) in enumerate(zip(offsets, sizes)):
            delta = lora_b[slot, s, :size].float() @ buffer[s, t]          # [size, max_rank] @ [max_rank]
            cols = y[t, off:off + size]
            cols.copy_((cols.float() + delta) if add_inputs else delta)  # rounds once, to y's dtype
    ### END SOLUTION


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_lora: TokenLoraLike, scale: ScaleLike, slice_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """A whole LoRA linear the obvious way, in fp32: for each token t with adapter i,
        y[t] = x[t] W^T + scale_i * (x[t] A_i^T) B_i^T        (slice by slice, side by side)
    and y[t] = x[t] W^T for i = -1. weight [total_out, in]; returns float32 [T, total_out]. The
    tests check shrink + expand against it, and it against the merged weight W + scale B A."""
    num_slots, num_slices, max_out, _ = lora_b.shape
    sizes = list(slice_sizes) if slice_sizes is not None else [max_out] * num_slices
    offsets = [sum(sizes[:s]) for s in range(num_slices)]
    slots = check_token_lora(token_lora, x.shape[0], num_slots, x.device)
    scales = check_scale(scale, num_slots, x.device)
    y = x.float() @ weight.float().T
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for s, (off, size) in enumerate(zip(offsets, sizes)):
            low_rank = x[t].float() @ lora_a[slot, s].float().T              # [max_rank]
            y[t, off:off + size] += scales[slot] * (low_rank @ lora_b[slot, s, :size].float().T)
    return y
