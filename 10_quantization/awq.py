"""AWQ: scale the input channels that matter up before rounding, and the activations down.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration" (MLSys 2024, arXiv:2306.00978).

A few input channels of a layer carry much larger activations than the rest; the weights that
multiply them matter more, and RTN rounds them as coarsely as any other. For any s > 0 per input
channel,  y = W x = (W diag(s)) (diag(s)^-1 x):  quantizing W diag(s) instead of W shrinks the
RELATIVE rounding error of the columns with s > 1 (they take more of the group's range), and the
division by s can be folded into whatever produced x (an RMSNorm's weight, or the rows of the
previous linear), so the model does no extra work at run time. AWQ searches one exponent:

    s(alpha) = mean|x|^alpha                      (normalised: s / sqrt(max(s) min(s)))
    alpha*   = argmin || parent(x; Q(W s) / s) - parent(x; W) ||^2   over a grid of alpha

where `parent` is the smallest module whose output contains every layer that shares x (for
q/k/v: the whole attention block), run on the calibration inputs; Q is RTN (reference.py).
alpha = 0 is s = 1, plain RTN: the search can only improve on RTN on the calibration data.

Mappings for Llama (what llmcompressor's default mappings resolve to, `modifiers/transform/awq/
mappings.py`; the paper's code, llm-awq, scales the same four):
    input_layernorm            -> q_proj, k_proj, v_proj     parent: self_attn
    v_proj                     -> o_proj                      parent: o_proj (only when v_proj's
                                                              outputs ARE o_proj's inputs: not with
                                                              grouped-query attention, SmolLM2's case)
    post_attention_layernorm   -> gate_proj, up_proj          parent: mlp
    up_proj                    -> down_proj                   parent: down_proj

duo_scaling (AutoAWQ's, llmcompressor's default): s = mean|x|^a / mean|w_hat|^(1-a), where
w_hat is |W| divided by its group's max, averaged over the rows of every balance layer; the grid
is then (a = 0 without the weight term, i.e. s = 1) plus a = 0, 1/18, ..., 1. duo_scaling=False is
the paper's s = mean|x|^a, a in {0, 1/20, ..., 19/20}. (The paper also searches a weight
clipping range; llmcompressor does not, nor does this file.)

Layers run one at a time on the outputs of the layers before them, as in the paper and in
llmcompressor; the smoothing leaves the fp32 function unchanged, so those inputs are fp32's.
At the end every linear (smoothed or not) is quantized with RTN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from quantization.gptq import capture_layer_inputs, decoder_layers, run_layer
from quantization.reference import QuantizedWeight, QuantScheme, quantize_rtn

__all__ = ["AWQMapping", "AWQResult", "LLAMA_MAPPINGS", "apply_scale", "awq_quantize_model", "grid",
           "search_scale", "weight_mean"]


@dataclass(frozen=True)
class AWQMapping:
    """Names relative to a decoder layer."""
    smooth: str                    # produces x: an RMSNorm or a linear
    balance: tuple[str, ...]       # the linears that read x
    parent: str                    # the module whose output the loss compares


LLAMA_MAPPINGS = (
    AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    AWQMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


@dataclass
class AWQResult:
    quantized: dict[str, QuantizedWeight]                 # every linear, by HF module name
    scales: dict[str, torch.Tensor] = field(default_factory=dict)     # s per smooth module name
    smoothed: dict[str, torch.Tensor] = field(default_factory=dict)   # changed fp32 params, by name
    losses: dict[str, tuple[float, float]] = field(default_factory=dict)  # (s = 1, best) per smooth


def grid(n_grid: int, duo_scaling: bool) -> list[tuple[float, bool]]:
    """(alpha, use the weight term) pairs, in search order."""
    if duo_scaling:
        return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    return [(i / n_grid, False) for i in range(n_grid)]


def weight_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Mean over every row of every weight of |w| / max|w| of its group: [in]."""
    rows = []
    for w in weights:                                              # [out, in]
        g = w.abs().reshape(w.shape[0], scheme.groups(w.shape[1]), -1)   # [out, groups, size]
        rows.append((g / (g.amax(dim=-1, keepdim=True) + 1e-6)).reshape(w.shape))
    return torch.cat(rows).mean(dim=0)


def _scale(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    if w_mean is None:
        s = x_mean.pow(alpha).clamp(min=1e-4)
    else:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()                             # centred on 1 (geometric mean of ends)
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


@torch.no_grad()
def search_scale(parent: Callable[[], list[torch.Tensor]], balance: list[nn.Linear], x_mean: torch.Tensor,
                 scheme: QuantScheme, n_grid: int = 20, duo_scaling: bool = True) -> tuple[torch.Tensor, float, float]:
    """The grid search for one mapping. parent() runs the parent module on every cached calibration
    input and returns its outputs; balance: the linears reading x; x_mean [in] = mean |x| per
    channel. Returns (best s [in], loss at s = 1, best loss); the balance weights are restored."""
    originals = [b.weight.detach().clone() for b in balance]       # [out_i, in] each
    reference = parent()                                           # fp32 outputs
    w_mean = weight_mean(originals, scheme) if duo_scaling else None
    best_s, best_loss, identity_loss = None, float("inf"), None
    ### BEGIN SOLUTION
    for alpha, use_w in grid(n_grid, duo_scaling):
        s = _scale(x_mean, w_mean if use_w else None, alpha)      # [in]
        for b, w in zip(balance, originals):                       # Q(W s) / s: what x meets
            b.weight.copy_(quantize_rtn(w * s, scheme).dequantize() / s)
        outputs = parent()
        loss = sum(((o - r) ** 2).sum().item() for o, r in zip(outputs, reference))
        loss /= sum(r.numel() for r in reference)                  # mean squared error
        if identity_loss is None:
            identity_loss = loss                                   # the grid starts at s = 1
        if loss < best_loss:
            best_s, best_loss = s, loss
    ### END SOLUTION
    for b, w in zip(balance, originals):
        b.weight.copy_(w)
    return best_s, identity_loss, best_loss


@torch.no_grad()
def apply_scale(smooth: nn.Module, balance: list[nn.Linear], s: torch.Tensor) -> None:
    """W_b <- W_b diag(s) for every balance linear, and x <- x / s folded into `smooth`: an
    RMSNorm's weight (its output is weight * normalised x), or the output rows of a linear."""
    ### BEGIN SOLUTION
    for b in balance:
        b.weight.mul_(s.view(1, -1))                               # [out, in] * [1, in]
    if isinstance(smooth, nn.Linear):
        smooth.weight[-s.numel():].div_(s.view(-1, 1))             # [in_b, in] rows / [in_b, 1]
        if smooth.bias is not None:
            smooth.bias[-s.numel():].div_(s)
    else:
        smooth.weight.div_(s)                                      # RMSNorm weight [hidden]
    ### END SOLUTION


def _applicable(layer: nn.Module, mapping: AWQMapping) -> bool:
    """A linear smooth layer must produce exactly the balance layers' inputs (GQA's v_proj does not)."""
    smooth = layer.get_submodule(mapping.smooth)
    in_features = {layer.get_submodule(b).in_features for b in mapping.balance}
    return len(in_features) == 1 and (not isinstance(smooth, nn.Linear) or smooth.out_features in in_features)


def _capture(layer: nn.Module, inputs: list[tuple], mappings: list[AWQMapping]):
    """Run the layer once: each mapping's parent calls (args, kwargs) and sum / count of |x|."""
    calls = {m.parent: [] for m in mappings}
    abs_sum = {m.smooth: [0.0, 0] for m in mappings}
    handles = []
    for m in mappings:
        handles.append(layer.get_submodule(m.parent).register_forward_pre_hook(
            lambda mod, args, kwargs, key=m.parent: calls[key].append((args, dict(kwargs))), with_kwargs=True))

        def stats(mod, args, key=m.smooth):
            x = args[0].detach().reshape(-1, args[0].shape[-1])    # [tokens, in]
            abs_sum[key][0] = abs_sum[key][0] + x.abs().sum(dim=0)
            abs_sum[key][1] += x.shape[0]
        handles.append(layer.get_submodule(m.balance[0]).register_forward_pre_hook(stats))
    for hidden, kwargs in inputs:
        run_layer(layer, hidden, kwargs)
    for h in handles:
        h.remove()
    return calls, {k: total / count for k, (total, count) in abs_sum.items()}


def _replay(module: nn.Module, calls: list[tuple]) -> list[torch.Tensor]:
    """module's outputs on its recorded calls (attention returns (output, weights): the output)."""
    outputs = [module(*args, **kwargs) for args, kwargs in calls]
    return [o[0] if isinstance(o, tuple) else o for o in outputs]


@torch.no_grad()
def awq_quantize_model(model: nn.Module, samples: torch.Tensor, scheme: QuantScheme, *,
                       mappings=LLAMA_MAPPINGS, n_grid: int = 20, duo_scaling: bool = True,
                       batch_size: int = 8, progress: Callable[[int, int], None] | None = None) -> AWQResult:
    """AWQ on every decoder layer, then RTN on every linear. The model is smoothed IN PLACE (its
    fp32 function unchanged); result.smoothed holds every parameter that changed."""
    names = {m: name for name, m in model.named_modules()}
    inputs = capture_layer_inputs(model, samples, batch_size)
    layers = decoder_layers(model)
    result = AWQResult(quantized={})
    for index, layer in enumerate(layers):
        active = [m for m in mappings if _applicable(layer, m)]
        calls, x_mean = _capture(layer, inputs, active)
        for m in active:
            parent, parent_calls = layer.get_submodule(m.parent), calls[m.parent]
            balance = [layer.get_submodule(b) for b in m.balance]
            s, loss_1, loss_best = search_scale(lambda: _replay(parent, parent_calls), balance,
                                                x_mean[m.smooth], scheme, n_grid, duo_scaling)
            smooth = layer.get_submodule(m.smooth)
            apply_scale(smooth, balance, s)
            key = names[smooth]
            result.scales[key], result.losses[key] = s, (loss_1, loss_best)
            for module in (smooth, *balance):
                for pname, p in module.named_parameters():
                    result.smoothed[f"{names[module]}.{pname}"] = p.detach().clone()
        inputs = [(run_layer(layer, hidden, kwargs), kwargs) for hidden, kwargs in inputs]
        if progress is not None:
            progress(index + 1, len(layers))
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                result.quantized[names[m]] = quantize_rtn(m.weight.detach(), scheme)
    return result
