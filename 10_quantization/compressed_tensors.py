"""compressed-tensors checkpoints in the engine: the config read, a linear method per scheme.

compressed-tensors is the format llmcompressor writes and vLLM reads (its config.json carries
`"quantization_config": {"quant_method": "compressed-tensors", ...}`). Two schemes here, the two
vLLM's CPU build runs:

    WNA16  weights int4 / int8, per group or per channel, symmetric or not; activations stay float
           format "pack-quantized": <layer>.weight_packed int32 [out, in*b/32], .weight_scale
           [out, groups], .weight_zero_point int32 [out*b/32, groups] (asymmetric), .weight_shape
    W8A8   weights int8 per channel (symmetric), activations int8 per token, dynamic (found at run
           time from each token's max): format "int-quantized": <layer>.weight int8 [out, in],
           .weight_scale [out, 1]

vLLM: vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py
(`CompressedTensorsConfig.from_config`, `_get_scheme_from_parts`, `get_scheme` matching a layer's
name against each group's `targets` and the `ignore` list, the fused-layer check that q/k/v share
one scheme) and schemes/compressed_tensors_wNa16.py, compressed_tensors_w8a8_int8.py
(`create_weights`, `process_weights_after_loading`, `apply_weights`).

Anything else (float8 / fp4 weights, static activation scales, activation order by group with a
g_idx, a quantized KV cache) is refused with a ValueError naming the field and its value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from model_executor.linear import LinearMethodBase
from model_executor.parallel_linear import ParallelLMHead, RowParallelLinear
from model_executor.quantization_config import QuantizationConfig

from quantization import ops
from quantization.packing import unpack_int32
from quantization.reference import QuantScheme

__all__ = ["CompressedTensorsConfig", "CompressedTensorsW8A8Int8", "CompressedTensorsWNA16", "GroupScheme"]

PACK_QUANTIZED, INT_QUANTIZED = "pack-quantized", "int-quantized"


@dataclass(frozen=True)
class GroupScheme:
    """One config group: which layers (targets), their weights' scheme, and whether activations are
    quantized (W8A8) or not (WNA16)."""
    targets: tuple[str, ...]
    weights: QuantScheme
    w8a8: bool
    format: str


def _fail(where: str, message: str) -> None:
    raise ValueError(f"compressed-tensors quantization_config{where}: {message}")


KV_SCALE_STRATEGIES = ("tensor", "attn_head")


def check_kv_cache_scheme(scheme: dict) -> None:
    """A checkpoint's KV-cache scales: fp8, symmetric, one scale per layer for K and one for V (the
    `self_attn.k_scale` / `v_scale` tensors; strategy "tensor") or one per KV head ("attn_head",
    stored [heads, 1, 1]), which an engine run with kv_cache_dtype="fp8" uses. vLLM's checks
    (CompressedTensorsConfig.validate_kv_cache_scheme), with its words."""
    where = ".kv_cache_scheme"
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        _fail(where, "Currently supported kv cache quantization is num_bits=8, type=float, however received "
                     f"num_bits={scheme.get('num_bits')}, type={scheme.get('type')}")
    if scheme.get("strategy") not in KV_SCALE_STRATEGIES:
        _fail(where, f"Invalid strategy for compressed-tensors KV cache. Expected strategies: {KV_SCALE_STRATEGIES}, "
                     f"found strategy: {scheme.get('strategy')!r}")
    if not scheme.get("symmetric"):
        _fail(where, "Only support symmetric scaling factor for compressed-tensors KV cache. However found "
                     f"symmetric: {scheme.get('symmetric')}")
    if scheme.get("dynamic"):
        _fail(where, "dynamic KV-cache scales are not stored in a checkpoint (kv_cache_dtype "
                     "'fp8_per_token_head' computes its own)")


def _parse_weights(args: dict, where: str) -> QuantScheme:
    if args.get("type", "int") != "int":
        _fail(where, f"weights of type {args.get('type')!r} (float8 / fp4) are not supported; int weights only")
    if args.get("dynamic", False):
        _fail(where, "dynamic weight scales are not supported")
    actorder = args.get("actorder")
    if actorder not in (None, "static", "weight"):
        _fail(where, f"actorder {actorder!r} needs a g_idx (columns regrouped); supported: static / none")
    strategy = args.get("strategy", "tensor")
    if strategy == "channel":
        group_size = None
    elif strategy == "group":
        group_size = args.get("group_size")
        if not isinstance(group_size, int):
            _fail(where, f"strategy 'group' needs an integer group_size, got {group_size!r}")
    else:
        _fail(where, f"weight strategy {strategy!r} is not supported; supported: 'channel', 'group'")
    try:
        return QuantScheme(num_bits=args.get("num_bits", 8), symmetric=bool(args.get("symmetric", True)),
                           group_size=group_size)
    except ValueError as e:
        _fail(where, str(e))


def _parse_activations(args: dict | None, where: str) -> bool:
    """True for W8A8's dynamic per-token int8 activations, False for none (WNA16)."""
    if args is None:
        return False
    wanted = dict(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    for key, value in wanted.items():
        if args.get(key, value if key != "dynamic" else False) != value:
            _fail(where, f"input_activations {key}={args.get(key)!r} is not supported; activations must be "
                         "int8, symmetric, dynamic, per token")
    return True


def _matches(name: str, patterns, layer: nn.Module) -> bool:
    """compressed-tensors' target rule: "re:<regex>" matched against the module name, "Linear" (a
    class name) any linear layer but the lm_head, otherwise the exact module name. vLLM's rule for
    the lm_head: a ParallelLMHead is no LinearBase, so only its name ("lm_head") or a regex targets it."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or (pattern == "Linear" and not isinstance(layer, ParallelLMHead)):
            return True
    return False


class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, groups: list[GroupScheme], ignore: list[str], kv_cache_scheme: dict | None = None):
        self.groups, self.ignore, self.kv_cache_scheme = groups, ignore, kv_cache_scheme

    def has_kv_cache_scales(self) -> bool:
        return bool(self.kv_cache_scheme)

    def kv_cache_scales_per_head(self) -> bool:
        return bool(self.kv_cache_scheme) and self.kv_cache_scheme.get("strategy") == "attn_head"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict) -> "CompressedTensorsConfig":
        kv_cache_scheme = config.get("kv_cache_scheme")
        if kv_cache_scheme:
            check_kv_cache_scheme(kv_cache_scheme)
        if config.get("sparsity_config"):
            _fail(".sparsity_config", "sparse checkpoints are not supported")
        groups = []
        for key, group in (config.get("config_groups") or {}).items():
            where = f".config_groups.{key}"
            if group.get("output_activations"):
                _fail(where, "output_activations are not supported")
            weights = _parse_weights(group.get("weights") or {}, where + ".weights")
            w8a8 = _parse_activations(group.get("input_activations"), where)
            fmt = group.get("format") or config.get("format")
            expected = INT_QUANTIZED if w8a8 else PACK_QUANTIZED
            if fmt != expected:
                _fail(where, f"format {fmt!r} for this scheme is not supported; expected {expected!r}")
            if w8a8 and (weights.num_bits != 8 or weights.group_size is not None or not weights.symmetric):
                _fail(where, "W8A8 needs int8 weights, per channel, symmetric")
            groups.append(GroupScheme(tuple(group.get("targets") or ()), weights, w8a8, fmt))
        if not groups:
            _fail(".config_groups", "no config group: nothing is quantized")
        return cls(groups, list(config.get("ignore") or []), kv_cache_scheme or None)

    def scheme_of(self, name: str, layer: nn.Module | None) -> GroupScheme | None:
        """The group that quantizes layer `name`: one naming it (exactly or by "re:") before one
        reaching it by class — vLLM's `find_matched_target` order, and compressed-tensors' (so a
        group targeting "lm_head" wins over a "Linear" one in every reader). `layer` None: a
        checkpoint's module, which "Linear" reaches whatever its name (HF's reading)."""
        if _matches(name, self.ignore, layer):
            return None
        by_name = (g for g in self.groups if _matches(name, [t for t in g.targets if t != "Linear"], layer))
        return next(by_name, None) or next((g for g in self.groups if _matches(name, g.targets, layer)), None)

    def get_quant_method(self, layer, prefix, checkpoint_names, backend="auto"):
        schemes = {name: self.scheme_of(name, layer) for name in checkpoint_names}
        if len(set(schemes.values())) > 1:                   # vLLM: every piece of a fused layer alike
            raise ValueError(f"compressed-tensors: the pieces of {prefix} ({', '.join(checkpoint_names)}) are "
                             f"quantized differently ({schemes}); a merged layer needs one scheme")
        scheme = next(iter(schemes.values()))
        if scheme is None:
            return None
        if scheme.w8a8:
            return CompressedTensorsW8A8Int8(backend)
        return CompressedTensorsWNA16(scheme.weights, backend)


def _resolve_backend(backend: str, device: torch.device) -> str:
    """"auto": the C++ kernel on a CPU where it builds, Triton on a GPU, else torch."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    from quantization import cpu_ops
    return "cpu" if cpu_ops.is_available() else "torch"


def _replace_weight(layer: nn.Module, params: dict[str, torch.Tensor], loaders: dict) -> None:
    """Swap the layer's float `weight` for the method's parameters, each loaded through the layer's
    own weight_loader (so merged q|k|v / gate|up pieces and tensor-parallel shards land as a float
    weight would) unless `loaders` gives one."""
    old = layer.weight
    base_loader = getattr(old, "weight_loader", None)
    shard_ids = getattr(old, "shard_ids", None)
    del layer.weight
    for name, tensor in params.items():
        param = nn.Parameter(tensor, requires_grad=False)
        loader = loaders.get(name, base_loader)
        if loader is not None:
            param.weight_loader = loader
        if shard_ids is not None:
            param.shard_ids = shard_ids
        layer.register_parameter(name, param)
    if "weight" not in params:
        layer.weight = None      # no float matrix any more: code that asks for one gets None


def per_channel_loader(layer: nn.Module, base):
    """The loader of a per-channel tensor [out, 1] (scales, zero points): one number per output
    row, none per input, so a row-parallel rank (which holds a slice of the INPUTS) loads it whole;
    other layers split its rows as they split the weight's (vLLM: ChannelQuantScaleParameter)."""
    if not isinstance(layer, RowParallelLinear):
        return base

    def load(param, loaded, *shard_id):
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"per-channel tensor: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)
    return load


def _full_input_size(layer: nn.Module) -> int:
    """Input features of the whole (unsplit) layer: a row-parallel layer holds 1 / tp of them."""
    return layer.input_size * layer.tp_size if isinstance(layer, RowParallelLinear) else layer.input_size


class CompressedTensorsWNA16(LinearMethodBase):
    """Weight-only int4 / int8: y = x @ dequantize(W)^T, the integers read by the kernel."""

    def __init__(self, scheme: QuantScheme, backend: str = "auto"):
        self.scheme, self.backend = scheme, backend

    def create_weights(self, layer):
        s, out_features, in_features = self.scheme, layer.output_size, layer.input_size
        per_word = 32 // s.num_bits
        if in_features % per_word:
            raise ValueError(f"input size per partition {in_features} is not a multiple of {per_word} "
                             f"(int{s.num_bits} values per int32 word)")
        if s.group_size is not None and in_features % s.group_size:
            raise ValueError(f"input size per partition {in_features} is not divisible by group_size {s.group_size} "
                             "(a tensor-parallel split must not cut a group)")
        groups = s.groups(in_features)
        dtype = layer.weight.dtype
        params = dict(weight_packed=torch.empty(out_features, in_features // per_word, dtype=torch.int32),
                      weight_scale=torch.empty(out_features, groups, dtype=dtype),
                      weight_shape=torch.empty(2, dtype=torch.int64))
        base = getattr(layer.weight, "weight_loader", None)
        if s.group_size is None:
            base = per_channel_loader(layer, base)
        loaders = dict(weight_shape=self._shape_loader(layer), weight_scale=base)
        if not s.symmetric:
            params["weight_zero_point"] = torch.empty(out_features, groups, dtype=torch.int8)
            loaders["weight_zero_point"] = self._zero_point_loader(base)
        _replace_weight(layer, params, loaders)

    def _zero_point_loader(self, base):
        """The checkpoint packs zero points along the OUTPUT dim; unpack them first, then load
        them like the scales (rows = outputs)."""
        bits = self.scheme.num_bits

        def load(param, loaded, *shard_id):
            unpacked = unpack_int32(loaded, bits, dim=0)
            if base is None:
                param.data.copy_(unpacked)
            else:
                base(param, unpacked, *shard_id)
        return load

    def _shape_loader(self, layer):
        """weight_shape [out, in] of each checkpoint piece: checked, not kept (the packed tensor's
        own shape check catches a wrong number of rows; this catches a wrong number of inputs)."""
        expected_in = _full_input_size(layer)

        def load(param, loaded, *shard_id):
            if loaded.numel() != 2 or int(loaded[1]) != expected_in:
                raise ValueError(f"weight_shape {loaded.tolist()} does not match this layer's {expected_in} inputs")
            param.data.copy_(loaded.to(param.dtype))
        return load

    def process_weights_after_loading(self, layer):
        self.backend = _resolve_backend(self.backend, layer.weight_packed.device)
        zero = getattr(layer, "weight_zero_point", None)
        if self.backend == "cpu":
            from quantization import cpu_ops
            layer.packed_weight = cpu_ops.prepare_wna16(layer.weight_packed.data, layer.weight_scale.data,
                                                        None if zero is None else zero.data, self.scheme)
        self._ops = ops.backend_module(self.backend, layer.weight_packed.device)

    def apply(self, layer, x):                              # [T, in] -> [T, out]
        if self.backend == "cpu":
            return self._ops.wna16_linear_prepared(x, layer.packed_weight, layer.bias)
        zero = getattr(layer, "weight_zero_point", None)
        return self._ops.wna16_linear(x, layer.weight_packed, layer.weight_scale, zero, self.scheme, layer.bias)


class CompressedTensorsW8A8Int8(LinearMethodBase):
    """int8 weights x int8 activations (quantized per token at run time), int32 sums."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend

    def create_weights(self, layer):
        dtype = layer.weight.dtype
        scale_loader = per_channel_loader(layer, getattr(layer.weight, "weight_loader", None))
        _replace_weight(layer, dict(weight=torch.empty(layer.output_size, layer.input_size, dtype=torch.int8),
                                    weight_scale=torch.empty(layer.output_size, 1, dtype=dtype)),
                        {"weight_scale": scale_loader})

    def process_weights_after_loading(self, layer):
        self.backend = _resolve_backend(self.backend, layer.weight.device)
        if self.backend == "cpu":
            from quantization import cpu_ops
            layer.packed_weight = cpu_ops.prepare_w8a8(layer.weight.data, layer.weight_scale.data)
        self._ops = ops.backend_module(self.backend, layer.weight.device)

    def apply(self, layer, x):                              # [T, in] -> [T, out]
        if self.backend == "cpu":
            return self._ops.w8a8_linear_prepared(x, layer.packed_weight, layer.bias)
        return self._ops.w8a8_linear(x, layer.weight, layer.weight_scale, layer.bias)
