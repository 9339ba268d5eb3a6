"""GPTQ and AWQ checkpoints (quant_method "gptq" / "awq"): their own int4 layouts, loaded into the
same integers and kernels as compressed-tensors'.

vLLM reads these formats with `layers/quantization/gptq.py` (GPTQConfig, GPTQLinearMethod: qweight,
qzeros, scales, g_idx) and `awq.py` (AWQConfig, AWQLinearMethod), and on a GPU upgrades both to
Marlin kernels. Here each tensor is turned into compressed-tensors' layout AS IT LOADS (packing.py
holds all three layouts, each giving back the same q int8 [out, in]), through the layer's own
weight_loader, so merged q|k|v and gate|up pieces and tensor-parallel shards land exactly as a
compressed-tensors checkpoint's do; after loading, the layer is a `CompressedTensorsWNA16` layer.

    GPTQ  qweight [in / 8, out] (packed along the input), scales [groups, out], qzeros [groups, out / 8]
          (packed along the output; format "gptq" stores zero - 1, "gptq_v2" the zero), g_idx [in]
    AWQ   qweight [in, out / 8] (packed along the output, nibble order 0 2 4 6 1 3 5 7), scales
          [groups, out], qzeros [groups, out / 8] (the same order), always asymmetric

`"lm_head": true` (vLLM's `lm_head_quantized`) quantizes the lm_head with the same scheme.
What is refused, naming the field: other bit widths than 4 / 8 (AWQ: 4), desc_act with a g_idx that
regroups the inputs (our kernels read groups in order), AWQ versions other than "gemm".
"""
from __future__ import annotations

import torch
from torch import nn

from model_executor.linear import Linear
from model_executor.quantization_config import QuantizationConfig
from quantization.compressed_tensors import CompressedTensorsWNA16, per_channel_loader
from quantization.packing import pack_int32, unpack_awq, unpack_gptq, unpack_int32
from quantization.reference import QuantScheme

__all__ = ["AWQConfig", "GPTQConfig"]


def _fail(method: str, where: str, message: str) -> None:
    raise ValueError(f"{method} quantization_config{where}: {message}")


def _group_size(method: str, value) -> int | None:
    if value in (-1, None):
        return None                                     # one group per output channel
    if not isinstance(value, int) or value <= 0:
        _fail(method, ".group_size", f"{value!r} is not a positive int or -1")
    return value


def _lm_head_flag(method: str, config: dict) -> bool:
    """`"lm_head": true`: the lm_head is quantized too (vLLM: `lm_head_quantized`, ParallelLMHead then
    runs the layers' linear method; a tied model's checkpoint is untied for it)."""
    value = config.get("lm_head", False)
    if not isinstance(value, bool):
        _fail(method, ".lm_head", f"{value!r} is not true or false")
    return value


class _PackedFormatConfig(QuantizationConfig):
    """What GPTQ and AWQ configs share: one scheme for every decoder linear, some modules left out."""
    method: str

    def __init__(self, scheme: QuantScheme, skip: list[str], lm_head: bool = False):
        self.scheme, self.skip, self.lm_head = scheme, skip, lm_head

    def get_quant_method(self, layer, prefix, checkpoint_names, backend="auto"):
        if not isinstance(layer, Linear) or (prefix.startswith("lm_head") and not self.lm_head):
            return None
        if any(s in name for s in self.skip for name in checkpoint_names):
            return None
        return self.linear_method(backend)


class GPTQConfig(_PackedFormatConfig):
    method = "gptq"

    def __init__(self, scheme: QuantScheme, skip: list[str], v2: bool, lm_head: bool = False):
        super().__init__(scheme, skip, lm_head)
        self.v2 = v2

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict) -> "GPTQConfig":
        bits = config.get("bits")
        if bits not in (4, 8):
            _fail("gptq", ".bits", f"{bits!r}: 4 and 8 bits are supported")
        if config.get("dynamic"):
            _fail("gptq", ".dynamic", "per-module overrides are not supported")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            _fail("gptq", ".checkpoint_format", f"{fmt!r}: supported are 'gptq' and 'gptq_v2'")
        scheme = QuantScheme(bits, bool(config.get("sym", True)), _group_size("gptq", config.get("group_size")))
        return cls(scheme, list(config.get("modules_to_not_convert") or []), v2=fmt == "gptq_v2",
                   lm_head=_lm_head_flag("gptq", config))

    def linear_method(self, backend):
        return GPTQLinearMethod(self.scheme, backend, v2=self.v2)


class AWQConfig(_PackedFormatConfig):
    method = "awq"

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict) -> "AWQConfig":
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            _fail("awq", ".bits", f"{bits!r}: AWQ checkpoints are 4-bit")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            _fail("awq", ".version", f"{version!r}: the 'gemm' layout is supported")
        if not config.get("zero_point", True):
            _fail("awq", ".zero_point", "False: AWQ's layout stores zero points")
        group_size = _group_size("awq", config.get("group_size", config.get("q_group_size")))
        return cls(QuantScheme(4, False, group_size), list(config.get("modules_to_not_convert") or []),
                   _lm_head_flag("awq", config))

    def linear_method(self, backend):
        return AWQLinearMethod(self.scheme, backend)


class _PackedFormatLinearMethod(CompressedTensorsWNA16):
    """compressed-tensors' WNA16 layer, its parameters registered under the checkpoint's names with
    loaders that convert each piece to compressed-tensors' layout first."""
    names = {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros"}

    def create_weights(self, layer):
        base = getattr(layer.weight, "weight_loader", None)
        super().create_weights(layer)
        del layer._parameters["weight_shape"]                 # these formats store none
        shard_ids = getattr(layer._parameters["weight_packed"], "shard_ids", None)   # merged q|k|v, gate|up
        for ours, theirs in self.names.items():
            param = layer._parameters.pop(ours, None)
            if param is None:                                 # symmetric: the zero points are checked, not kept
                param = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
                if shard_ids is not None:
                    param.shard_ids = shard_ids
            per_row = theirs != "qweight" and self.scheme.group_size is None     # [out, 1]: whole on a row-parallel rank
            param.weight_loader = self._loader(theirs, per_channel_loader(layer, base) if per_row else base,
                                               param.numel() == 0)
            layer.register_parameter(theirs, param)
        g_idx = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
        g_idx.weight_loader = self._check_g_idx
        g_idx.optional_in_checkpoint = True                   # AWQ has none; old GPTQ checkpoints neither
        if shard_ids is not None:
            g_idx.shard_ids = shard_ids
        layer.register_parameter("g_idx", g_idx)

    def _loader(self, theirs: str, base, check_only: bool):
        convert = getattr(self, f"_convert_{theirs}")

        def load(param, loaded, *shard_id):
            ours = convert(loaded)                            # compressed-tensors' rows = outputs
            if check_only:
                return
            if base is None:
                param.data.copy_(ours)
            else:
                base(param, ours, *shard_id)
        return load

    def _convert_scales(self, scales):                        # [groups, out] -> [out, groups]
        return scales.t().contiguous()

    def _check_g_idx(self, param, g_idx, *shard_id):
        """desc_act without reordering writes g_idx = i // group_size; anything else regroups the
        inputs, which the kernels do not read (vLLM's exllama / Marlin kernels permute for it)."""
        n = g_idx.numel()
        size = self.scheme.group_size or n
        if not torch.equal(g_idx.to(torch.int64), torch.arange(n) // size):
            raise ValueError("gptq: g_idx regroups the inputs (desc_act with act-order); only inputs in their "
                             "groups' order are supported")

    def process_weights_after_loading(self, layer):
        for ours, theirs in self.names.items():
            param = layer._parameters.pop(theirs)
            if param.numel():
                layer.register_parameter(ours, param)
        del layer._parameters["g_idx"]
        super().process_weights_after_loading(layer)


class GPTQLinearMethod(_PackedFormatLinearMethod):
    def __init__(self, scheme: QuantScheme, backend: str = "auto", v2: bool = False):
        super().__init__(scheme, backend)
        self.v2 = v2

    def _convert_qweight(self, qweight):                      # [in / 8, out] -> [out, in / 8]
        return pack_int32(unpack_gptq(qweight, self.scheme.num_bits), self.scheme.num_bits, dim=1)

    def _convert_qzeros(self, qzeros):                        # [groups, out / 8] -> [out, groups] int8
        zero = unpack_int32(qzeros, self.scheme.num_bits, dim=1).t()
        if not self.v2:
            zero = zero + 1                                   # format "gptq" stores zero - 1
        if self.scheme.symmetric and bool(zero.any()):
            raise ValueError("gptq: sym is true but qzeros hold zero points other than the grid's middle")
        return zero.to(torch.int8).contiguous()


class AWQLinearMethod(_PackedFormatLinearMethod):
    def _convert_qweight(self, qweight):                      # [in, out / 8] -> [out, in / 8]
        return pack_int32(unpack_awq(qweight, 4), 4, dim=1)

    def _convert_qzeros(self, qzeros):                        # [groups, out / 8] -> [out, groups] int8
        return unpack_awq(qzeros, 4).contiguous()
