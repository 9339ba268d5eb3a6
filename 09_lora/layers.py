"""The reference LoRA linear: every token adds the low-rank update of ITS request's adapter.

Mirrors vLLM's `vllm/lora/layers/base_linear.py: BaseLinearLayerWithLoRA` and
`column_parallel_linear.py: MergedColumnParallelLinearWithLoRA / QKVParallelLinearWithLoRA`
(`row_parallel_linear.py` for o_proj / down_proj), with the per-step token -> slot table of
`vllm/lora/punica_wrapper/punica_base.py: PunicaWrapperBase.update_metadata`.

For a token t of a request using the adapter in slot s, slice i of a merged layer (q | k | v) gets

    y[t, slice i] = x[t] W_i^T + (x[t] A[s, i]^T) B[s, i]^T       A [r, in], B [out_i, r], scaling in B

and a token mapped to NO_LORA (-1) gets the base x W^T alone. Two thin matmuls through rank r: for
r = 8 on SmolLM2's qkv (576 -> 960, three slices) the update is ~4% of the base GEMM's multiply-adds,
which is why one base model can serve many adapters at once instead of one merged copy per adapter.

Why a linear method and not a new layer class: the layers already route their matmul through
`layer.linear_method.apply(layer, x)` (model_executor/linear.py). LoRALinearMethod wraps whatever
method the layer had — chapter 07's packed CPU GEMM included — adds the delta, and the model code
does not change. vLLM replaces the modules instead (`from_layer`); the effect is the same.

`lora_delta` is the readable reference: a loop over the slots present in the batch. It is one
function with one signature so that a batched kernel (vLLM's punica `lora_shrink` / `lora_expand`,
one launch for every adapter) can replace it: `apply_lora(model, manager, delta_fn=...)`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from model_executor.linear import LinearMethodBase

from lora.adapter_manager import NO_LORA, LoRAAdapterManager, SlotWeights

DeltaFn = Callable[[torch.Tensor, SlotWeights, torch.Tensor], torch.Tensor]


class LoRAMapping:
    """Which slot each token of this step uses; the runner updates it before every forward and
    every wrapped layer reads the same object (vLLM: `PunicaWrapper`, whose `update_metadata` sets
    the token -> adapter index once per step and whose `add_lora_linear` each layer calls).

    backend=None: the layers add `delta_fn`'s result (the readable loop, `lora_delta`). A backend of
    ops.py ("torch", "triton", "cpu"): `add_lora_linear` adds every adapter's part IN PLACE with the
    batched shrink and expand. The token -> slot map is checked once per step (`set_token_lora`,
    against `num_slots`), not once per layer: a step of SmolLM2 calls the ops 240 times, and the
    checks of ops.py cost more than a decode-sized kernel. With "cpu" the C++ kernels are called
    directly (their contract holds: contiguous int64 slots in range, float32 scales)."""

    def __init__(self, backend: str | None = None, num_slots: int | None = None):
        self.backend, self.num_slots = backend, num_slots
        self.token_lora: torch.Tensor | None = None    # [T] int64, NO_LORA = base model
        self.any_lora = False                           # computed once per step, not once per layer
        self._scales: torch.Tensor | None = None        # [num_slots] ones: the slots hold scaling * B
        self._slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(SlotWeights) -> offsets, sizes

    def set_token_lora(self, token_lora: torch.Tensor | None) -> None:
        if token_lora is not None and self.num_slots is not None:
            from lora.reference import check_token_lora
            token_lora = check_token_lora(token_lora, token_lora.numel(), self.num_slots, token_lora.device)
        self.token_lora = token_lora if token_lora is None else token_lora.contiguous()
        self.any_lora = token_lora is not None and bool((token_lora != NO_LORA).any())

    def set_requests(self, slots: Sequence[int], num_tokens: Sequence[int],
                     device: str | torch.device = "cpu") -> torch.Tensor:
        """Request r's `num_tokens[r]` tokens, laid end to end, all use `slots[r]`; returns token_lora [T]."""
        token_lora = torch.repeat_interleave(torch.tensor(list(slots), dtype=torch.int64),
                                             torch.tensor(list(num_tokens), dtype=torch.int64)).to(device)
        self.set_token_lora(token_lora)
        return self.token_lora

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, slot_weights: SlotWeights) -> None:
        """y [T, out] += each token's (x A^T) B^T, every slice, one shrink and one expand (ops.py)."""
        from lora import ops

        num_slots, num_slices, max_rank = slot_weights.lora_a.shape[:3]
        if self._scales is None or self._scales.numel() != num_slots or self._scales.device != x.device:
            self._scales = torch.ones(num_slots, dtype=torch.float32, device=x.device)
        buffer = torch.empty(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)  # [S, T, R]
        if self.backend == "cpu" and y.is_contiguous():
            from kernels_cpu import lora_ops as kernels
            offsets, sizes = self._slice_tensors(slot_weights)
            kernels.lora_shrink(x.contiguous(), slot_weights.lora_a, self.token_lora, self._scales, buffer)
            kernels.lora_expand(buffer, slot_weights.lora_b, self.token_lora, y, offsets, sizes, True)
            return
        ops.lora_shrink(x, slot_weights.lora_a, self.token_lora, self._scales, buffer, self.backend,
                        check_values=False)
        ops.lora_expand(buffer, slot_weights.lora_b, self.token_lora, y, slot_weights.offsets,
                        slot_weights.output_sizes, True, self.backend, check_values=False)

    def _slice_tensors(self, slot_weights: SlotWeights) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(slot_weights)
        if key not in self._slices:
            self._slices[key] = (torch.tensor(slot_weights.offsets, dtype=torch.int64),
                                 torch.tensor(slot_weights.output_sizes, dtype=torch.int64))
        return self._slices[key]


def lora_delta(x: torch.Tensor, slot_weights: SlotWeights, token_lora: torch.Tensor) -> torch.Tensor:
    """[T, in] -> [T, sum(output_sizes)]: row t is (x[t] A^T) B^T of slot token_lora[t], slice by
    slice into its columns of the merged output; zero where token_lora[t] is NO_LORA."""
    out = x.new_zeros(x.shape[0], sum(slot_weights.output_sizes))                    # [T, out]
    ### BEGIN SOLUTION
    for slot in token_lora.unique().tolist():
        if slot == NO_LORA:
            continue
        rows = (token_lora == slot).nonzero().squeeze(1)                               # [n] tokens of this adapter
        xs = x[rows]                                                                   # [n, in]
        for i, (offset, size) in enumerate(zip(slot_weights.offsets, slot_weights.output_sizes)):
            shrink = xs @ slot_weights.lora_a[slot, i].T                               # [n, max_rank]
            expand = shrink @ slot_weights.lora_b[slot, i, :size].T                   # [n, size]
            out[rows, offset:offset + size] = expand
    ### END SOLUTION
    return out


class LoRALinearMethod(LinearMethodBase):
    """`base_method`'s x W^T (+ b), plus each token's adapter update from `slot_weights`: `delta_fn`'s,
    or with delta_fn=None the mapping's batched ops, in place."""

    def __init__(self, base_method: LinearMethodBase, slot_weights: SlotWeights, mapping: LoRAMapping,
                 delta_fn: DeltaFn | None = lora_delta):
        self.base_method, self.slot_weights, self.mapping, self.delta_fn = base_method, slot_weights, mapping, delta_fn

    def pack(self, weight):
        return self.base_method.pack(weight)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        y = self.base_method.apply(layer, x)
        if not self.mapping.any_lora:
            return y
        token_lora = self.mapping.token_lora
        if token_lora.shape[0] != x.shape[0]:
            raise ValueError(f"LoRA mapping has {token_lora.shape[0]} tokens but the layer got {x.shape[0]}: "
                             "update the mapping every step")
        if self.delta_fn is None:
            self.mapping.add_lora_linear(y, x, self.slot_weights)
            return y
        return y + self.delta_fn(x, self.slot_weights, token_lora).to(y.dtype)


def apply_lora(model: nn.Module, manager: LoRAAdapterManager, delta_fn: DeltaFn = lora_delta,
               backend: str | None = None) -> LoRAMapping:
    """Wrap the linear method of every layer the manager holds slots for; returns the mapping the
    runner updates each step (no tokens mapped: the base model). backend: the batched ops of ops.py
    ("torch", "triton", "cpu") in place of delta_fn. Call after loading (chapter 07's loader sets the
    CPU GEMM method); applying again rebinds the layers to the new manager."""
    mapping = LoRAMapping(backend, manager.max_loras)
    modules = dict(model.named_modules())
    for name, slot_weights in manager.slot_weights.items():
        layer = modules[name]
        base = layer.linear_method
        if isinstance(base, LoRALinearMethod):
            base = base.base_method
        layer.linear_method = LoRALinearMethod(base, slot_weights, mapping, None if backend else delta_fn)
    return mapping


def remove_lora(model: nn.Module) -> int:
    """Give every wrapped layer its base method back; returns how many were unwrapped."""
    count = 0
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, LoRALinearMethod):
            module.linear_method = method.base_method
            count += 1
    return count
