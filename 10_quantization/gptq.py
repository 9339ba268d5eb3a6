"""GPTQ: choose the integers of a weight matrix so that the layer's OUTPUT changes least.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (ICLR 2023, arXiv:2210.17323); it builds on Optimal Brain Quantization
(OBQ) from Frantar & Alistarh, "Optimal Brain Compression: A Framework for Accurate Post-Training
Quantization and Pruning" (NeurIPS 2022, arXiv:2208.11580).

Round-to-nearest (reference.quantize_rtn) minimises each weight's own error |w - q|. What the
model feels is the error of the product: for a linear layer with inputs X [in, N] (N tokens),

    E(Q) = || W X - Q X ||^2 = sum over rows r of (w_r - q_r) H (w_r - q_r)^T / 2,   H = 2 X X^T

Every row is an independent problem with the same H [in, in]. GPTQ quantizes the columns one at
a time, left to right, and after rounding column j it moves the not-yet-quantized columns to
absorb the rounding error — the least-squares optimal correction given X (OBQ):

    err_j   = (w_j - quant(w_j)) / U[j, j]                          [out]
    w_{j+1:} -= err_j U[j, j+1:]                                     [out, in - j - 1]

where U is the upper Cholesky factor of H^-1 (H^-1 = U^T U). OBQ's update uses row j of the
inverse Hessian of the columns still free once 0..j-1 are fixed, F = {j, j+1, ...}; that row is
U[j, j] U[j, j:] (and its diagonal U[j, j]^2), so one Cholesky replaces OBQ's n shrinking
inversions. The rest is engineering, from the paper and its code (IST-DASLab/gptq: act-order):

    dampening       H + percdamp * mean(diag H) * I: X X^T is often near singular (0.01)
    dead columns    an input that is always 0 (diag H = 0): its weight cannot matter, set to 0
    lazy batches    the update of the columns right of a 128-column block is applied once per
                    block (one matmul), not once per column (bandwidth, not flops, bound)
    groups          with group_size g, a group's scale and zero point are computed (RTN's
                    compute_qparams) on the error-updated weights when its first column is
                    reached: later groups are on the grid of what they have become
    act-order       columns with large diag(H) (inputs with much energy) are quantized first,
                    while many columns are left to absorb their error. "Static" act-order (what
                    llmcompressor calls actorder="static"/"weight"): groups stay the ORIGINAL
                    column ranges, their scales computed up front from the original weights,
                    so a checkpoint needs no g_idx and the kernels are unchanged

This returns a reference.QuantizedWeight: the same integers, scales and zero points as RTN
stores, only better chosen. `gptq_quantize_model` runs a HF Llama layer by layer as the paper
(and llmcompressor's sequential pipeline) does: each decoder layer's Hessians come from the
inputs produced by the already-quantized layers before it, so later layers correct for the
error of earlier ones. (The paper's "true-sequential" also orders the linears inside a layer;
llmcompressor and this file quantize a layer's seven linears from one pass.)
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable

import torch
from torch import nn

from quantization.reference import QuantizedWeight, QuantScheme, compute_qparams

__all__ = ["Hessian", "capture_layer_inputs", "decoder_layers", "gptq_quantize", "gptq_quantize_model",
           "inverse_hessian_cholesky", "run_layer"]


class Hessian:
    """H = 2 X X^T / N over every token seen (X [in, N]): the running mean keeps its size
    independent of N, which changes nothing (dampening is relative) but the float range."""

    def __init__(self, in_features: int):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()          # [t, in]: tokens as rows
        t = x.shape[0]
        self.H *= self.tokens / (self.tokens + t)                 # the old mean, reweighted
        self.tokens += t
        x = math.sqrt(2.0 / self.tokens) * x
        self.H += x.t() @ x                                       # [in, in] = 2/N x^T x

    def hook(self, linear: nn.Module):
        """A forward hook on `linear` that adds its input; returns the handle (call .remove())."""
        return linear.register_forward_hook(lambda module, args, output: self.add(args[0]))


def inverse_hessian_cholesky(H: torch.Tensor, percdamp: float = 0.01) -> torch.Tensor:
    """U upper-triangular [in, in] with U^T U = (H + damp I)^-1, damp = percdamp * mean(diag H).
    Not positive definite even so: a warning and the identity (GPTQ degrades to RTN)."""
    H = H.clone()
    H.diagonal().add_(percdamp * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        warnings.warn("GPTQ: the dampened Hessian is not positive definite; this layer falls back to RTN")
        return torch.eye(H.shape[0], dtype=H.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, *,
                  block_size: int = 128, percdamp: float = 0.01, act_order: bool = False) -> QuantizedWeight:
    """GPTQ for one linear layer: weight [out, in], hessian [in, in] (Hessian.H) -> QuantizedWeight
    on `scheme`'s grid. act_order: static activation order (groups on the original columns)."""
    W = weight.detach().float().clone()                           # [out, in], the working copy
    H = hessian.detach().float().clone()                          # [in, in]
    out_features, in_features = W.shape
    group = in_features if scheme.group_size is None else scheme.group_size
    row_scheme = dataclasses.replace(scheme, group_size=None)     # one (scale, zero) per row
    # Per channel, or act-order: every (scale, zero) fixed up front from the original weights.
    static = act_order or scheme.group_size is None
    scale, zero = compute_qparams(W, scheme)                      # [out, groups] each
    scale = scale.to(weight.dtype).float()                        # rounded as it will be stored
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(in_features)
    W, H = W[:, perm], H[perm][:, perm]                           # processing order
    group_of = perm // group                                      # [in]: ORIGINAL group of each column
    U = inverse_hessian_cholesky(H, percdamp)                     # [in, in] upper
    if not static:
        block_size = max(block_size, group)                       # a group never straddles two blocks
    Q = torch.zeros(out_features, in_features, dtype=torch.int8)  # processing order
    ### BEGIN SOLUTION
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()                                  # [out, B]: this block, kept current
        U1 = U[i1:i2, i1:i2]                                      # [B, B]
        Err1 = torch.zeros_like(W1)                               # [out, B]: scaled errors
        for i in range(i2 - i1):
            j = i1 + i
            g = int(group_of[j])
            if not static and j % group == 0:                     # a group starts: its grid, now
                s, z = compute_qparams(W1[:, i:i + group], row_scheme)   # [out, 1] each
                scale[:, g:g + 1], zero[:, g:g + 1] = s.to(weight.dtype), z
            s, z = scale[:, g], zero[:, g].float()                # [out] each
            w = W1[:, i]                                          # [out]
            q = (torch.round(w / s) + z).clamp(scheme.qmin, scheme.qmax)
            Q[:, j] = q.to(torch.int8)
            err = (w - (q - z) * s) / U1[i, i]                    # [out]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]        # the block's columns absorb it now
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]                         # the rest, once per block (lazy)
    ### END SOLUTION
    q = Q[:, torch.argsort(perm)]                                 # back to the original column order
    return QuantizedWeight(q, scale.to(weight.dtype), zero, scheme)


# ----------------------------------------------------------------------------------- model level

def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM (LlamaForCausalLM: model.model.layers)."""
    return model.model.layers


class _Captured(Exception):
    """Raised by the hook on layer 0 once its inputs are recorded: nothing after it need run."""


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, samples: torch.Tensor, batch_size: int = 8) -> list[tuple]:
    """[(hidden_states [b, T, hidden], kwargs)] per batch of samples [n, T]: what decoder layer 0
    receives. kwargs (rotary cos/sin, attention mask, positions) are the same for every layer."""
    captured = []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden.detach(), kwargs))
        raise _Captured

    handle = decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in samples.split(batch_size):
            try:
                model(input_ids=batch, use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out               # older transformers: a tuple


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def gptq_quantize_model(model: nn.Module, samples: torch.Tensor, scheme: QuantScheme, *,
                        act_order: bool = False, block_size: int = 128, percdamp: float = 0.01,
                        batch_size: int = 8, progress: Callable[[int, int], None] | None = None,
                        lm_head_scheme: QuantScheme | None = None) -> dict[str, QuantizedWeight]:
    """Quantize every nn.Linear of every decoder layer, layer by layer. Returns QuantizedWeight
    per HF module name ("model.layers.0.self_attn.q_proj"). The model is changed IN PLACE: each
    linear's weight becomes its dequantized value (so the next layer calibrates on the quantized
    outputs); pass a copy to keep the original. progress(layers_done, layers_total).
    `lm_head_scheme`: the lm_head too ("lm_head"), on the final norm's outputs of the quantized
    layers; its float weight is left as it is (a tied model's is the embedding)."""
    names = {m: name for name, m in model.named_modules()}
    inputs = capture_layer_inputs(model, samples, batch_size)
    layers = decoder_layers(model)
    result = {}
    for index, layer in enumerate(layers):
        linears = _linears(layer)
        hessians = {name: Hessian(m.in_features) for name, m in linears.items()}
        handles = [hessians[name].hook(m) for name, m in linears.items()]
        for hidden, kwargs in inputs:                              # pass 1: the layer in fp, H only
            run_layer(layer, hidden, kwargs)
        for handle in handles:
            handle.remove()
        for name, m in linears.items():
            qw = gptq_quantize(m.weight, hessians.pop(name).H, scheme, block_size=block_size,
                               percdamp=percdamp, act_order=act_order)
            m.weight.copy_(qw.dequantize().to(m.weight.dtype))
            result[names[m]] = qw
        inputs = [(run_layer(layer, hidden, kwargs), kwargs) for hidden, kwargs in inputs]   # pass 2
        if progress is not None:
            progress(index + 1, len(layers))
    if lm_head_scheme is not None:
        head = model.get_output_embeddings()                       # [vocab, hidden]
        hessian = Hessian(head.weight.shape[1])
        for hidden, _ in inputs:
            hessian.add(model.model.norm(hidden))                  # what the lm_head reads
        result["lm_head"] = gptq_quantize(head.weight, hessian.H, lm_head_scheme, block_size=block_size,
                                          percdamp=percdamp, act_order=act_order)
    return result
