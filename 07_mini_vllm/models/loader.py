"""Build a model from an HF-format directory: construct it, then stream safetensors into it.

Mirrors vLLM's `DefaultModelLoader` (vllm/model_executor/model_loader/default_loader.py:
`_get_weights_iterator` over `*.safetensors`, honouring `model.safetensors.index.json`) and the
`load_weights` methods of its model files (the `stacked_params_mapping` loop that sends
`q_proj`/`k_proj`/`v_proj` into slices of the merged `qkv_proj`).

Strict on purpose: every parameter (and every shard of a merged one) must be written exactly
once, and every checkpoint tensor must land somewhere. A missing tensor would otherwise leave
uninitialised memory in the model, and an unexpected one usually means the wrong architecture
— both would run and silently generate garbage.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from kernels_cpu import layer_ops
from model_executor.custom_op import CustomOp
from model_executor.linear import Linear, VocabEmbedding

from mini_vllm.config import ModelConfig, check_model_dir
from mini_vllm.models.llama import PPMissingLayer
from mini_vllm.models.linear_method import UNQUANTIZED, dispatch_cpu_unquantized_gemm, select_cpu_linear_method
from mini_vllm.models.quantization import (add_kv_cache_scales, get_quantization_config, process_kv_cache_scales,
                                           process_quantized_layers, quant_kernel_backend,
                                           quantize_linear_layers)
from mini_vllm.models.registry import get_model_class

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by the shard index if there is one, else every *.safetensors."""
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing from {model_dir}: {missing}")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, CPU tensor) for every tensor of every shard, read lazily (mmap)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded_weight)            # casts to the model's dtype and device


def skipped_weight(model: nn.Module, name: str) -> bool:
    """Checkpoint tensors we deliberately ignore."""
    if "rotary_emb.inv_freq" in name:           # some old Llama checkpoints store RoPE frequencies; we recompute them
        return True
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding): the embedding wins, as in vLLM.
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return True
    return is_pp_missing_parameter(name, model)


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """The tensor belongs to a layer another pipeline stage holds (vLLM: is_pp_missing_parameter):
    skipped here, loaded there. Without pipeline parallelism there are no such layers."""
    missing = getattr(model, "_pp_missing_prefixes", None)
    if missing is None:
        missing = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
        model._pp_missing_prefixes = missing
    return bool(missing) and name.startswith(missing)


def remap_kv_scale_name(name: str, params: dict) -> str:
    """A checkpoint's KV-cache scale `...self_attn.k_scale` (or the older single `kv_scale`) is the
    attention op's parameter `...self_attn.attn.k_scale` (vLLM: maybe_remap_kv_scale_name)."""
    for suffix, ours in ((".k_scale", ".attn.k_scale"), (".v_scale", ".attn.v_scale"), (".kv_scale", ".attn.k_scale")):
        if name.endswith(suffix) and name not in params:
            remapped = name[:-len(suffix)] + ours
            if remapped in params:
                return remapped
    return name


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters, mapping pieces into merged parameters."""
    params = dict(model.named_parameters())     # tied weights appear once (under model.embed_tokens)
    expected = {(name, sid) for name, p in params.items() for sid in getattr(p, "shard_ids", (None,))
                if not getattr(p, "optional_in_checkpoint", False)}
    optional = {name for name, p in params.items() if getattr(p, "optional_in_checkpoint", False)}
    weights = ((remap_kv_scale_name(name, params), tensor) for name, tensor in weights)
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    ### BEGIN SOLUTION
    for ckpt_name, tensor in weights:
        if skipped_weight(model, ckpt_name):
            continue
        for param_piece, ckpt_piece, shard_id in model.stacked_params_mapping:
            if ckpt_piece in ckpt_name:
                name = ckpt_name.replace(ckpt_piece, param_piece)
                break
        else:
            name, shard_id = ckpt_name, None
        param = params.get(name)
        if param is None or ((name, shard_id) not in expected and name not in optional):
            unexpected.append(ckpt_name)
            continue
        if (name, shard_id) in loaded:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} was loaded twice (duplicate across shards?)")
        try:
            if shard_id is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"{ckpt_name}: {e}") from None
        loaded.add((name, shard_id))
    ### END SOLUTION
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this {type(model).__name__} has no parameter for "
                         f"(wrong architecture?): {', '.join(sorted(unexpected)[:10])}")
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [n if sid is None else f"{n} (shard {sid!r})" for n, sid in missing]
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {type(model).__name__}: {', '.join(names[:10])}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters created inside are `dtype` (scoped: restores the previous default on exit)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def process_weights_after_loading(model: nn.Module, cpu_gemm_backend: str = "auto", remove_weight: bool = True) -> int:
    """Give every CPU linear (and the lm_head) the matmul `cpu_gemm_backend` picks, its weight
    packed once for it; returns how many weights were packed.

    vLLM: `model_loader/utils.py: process_weights_after_loading`, which on a CPU reaches
    `layers/utils.py: dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` (oneDNN).
    The methods and how "auto" chooses: linear_method.py. Quantized layers (chapter 10) keep their
    own methods (models/quantization.py). remove_weight: drop each Linear's
    unpacked weight once packed — the packed copy is all its matmul reads, and keeping both
    nearly doubles the weights' memory (`python -m benchmarks.bench_model_memory` measures it).
    The tied lm_head cannot give up its matrix: it is the input embedding too.
    """
    lm_head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules()
              if isinstance(m, Linear) and m.linear_method is UNQUANTIZED and m.packed_weight is None]
    if isinstance(lm_head, VocabEmbedding) and lm_head.packed_weight is None:
        layers.append(lm_head)                          # tied: the embedding matrix, packed once more
    method = select_cpu_linear_method(cpu_gemm_backend, [m.weight for m in layers])
    if method is UNQUANTIZED:
        return 0
    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, method)
        if remove_weight and isinstance(layer, Linear):
            layer.drop_unpacked_weight()
    return len(layers)


CPU_LAYER_OPS = ("auto", "cpu", "torch")    # EngineConfig.cpu_layer_ops


def use_cpu_layer_ops(model: nn.Module, mode: str = "auto") -> int:
    """Bind every CustomOp of the model (norms, the MLP activation, the attention blocks' split +
    RoPE) to its fused C++ forward (`forward_cpu`: kernels_cpu/layer_ops.py) or to its PyTorch one;
    returns how many now run forward_cpu.

    vLLM binds `CustomOp.forward_cpu` by platform when a layer is built; here the layers are
    built first and bound once their weights are on the CPU (as the linears get their methods).
    "auto": where the kernels build (a C++ compiler) and the model is on the CPU; "cpu" insists;
    "torch" keeps every layer's PyTorch forward (the readable oracle)."""
    if mode not in CPU_LAYER_OPS:
        raise ValueError(f"cpu_layer_ops must be one of {CPU_LAYER_OPS}, got {mode!r}")
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    if mode == "torch":
        for op in ops:
            op.dispatch_forward("native")
        return 0
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    reason = layer_ops.unavailable_reason() if on_cpu else "the model is not on the CPU"
    if reason is not None:
        if mode == "cpu":
            raise ValueError(f"cpu_layer_ops='cpu' cannot be used: {reason}")
        return 0
    for op in ops:
        op.dispatch_forward("cpu")
    return len(ops)


CUDA_LAYER_OPS = ("auto", "triton", "torch")    # EngineConfig.cuda_layer_ops
FUSED_ATTENTION_BACKENDS = ("triton", "cuda")    # the GPU backends that also get the fused layer ops


def use_cuda_layer_ops(model: nn.Module, mode: str = "auto", attn_backend: str = "triton") -> int:
    """Bind every CustomOp of the model (norms, the MLP activation, the attention blocks' RoPE + v
    copy) to its fused Triton forward (`forward_cuda`: paged_attention/model/triton_layer_ops.py);
    returns how many now run forward_cuda.

    vLLM binds `CustomOp.forward_cuda` on a CUDA platform when a layer is built. "auto": when the
    model is on a CUDA device and attention runs on a GPU backend (triton, cuda; the "torch" and
    "reference" backends are debugging paths and keep the PyTorch forwards too); "triton" insists
    (the model must be on a CUDA device); "torch" leaves every forward as it is (the readable
    oracle unless use_cpu_layer_ops bound the CPU kernels)."""
    if mode not in CUDA_LAYER_OPS:
        raise ValueError(f"cuda_layer_ops must be one of {CUDA_LAYER_OPS}, got {mode!r}")
    if mode == "torch":
        return 0
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    if not on_cuda:
        if mode == "triton":
            raise ValueError("cuda_layer_ops='triton' cannot be used: the model is not on a CUDA device")
        return 0
    if mode == "auto" and attn_backend not in FUSED_ATTENTION_BACKENDS:
        return 0
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.dispatch_forward("cuda")
    return len(ops)


def get_model(model_config: ModelConfig, device: str | torch.device = "cpu", attn_backend: str = "torch",
              cpu_gemm_backend: str = "torch", cpu_layer_ops: str = "torch", cuda_layer_ops: str = "torch",
              embed_on_last_stage: bool = False) -> nn.Module:
    """Construct the architecture's class directly on `device` in `model_config.dtype`, load its
    weights, then choose the fast ops, once: on a CPU, each linear's matmul
    (`process_weights_after_loading`) and the small ops' forwards (`use_cpu_layer_ops`); on a GPU
    the small ops' fused Triton forwards (`use_cuda_layer_ops`).
    cpu_gemm_backend="torch", cpu_layer_ops="torch", cuda_layer_ops="torch": plain PyTorch throughout.
    embed_on_last_stage: pipeline parallel, the last stage holds the input embedding too (an EAGLE
    head drafts there)."""
    cls = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = cls(model_config, attn_backend=attn_backend, embed_on_last_stage=embed_on_last_stage)
        quant_config = get_quantization_config(model_config.quantization, model_config.quantization_config)
        # chapter 10: the quantized layers' parameters, and the kernels their methods will use
        quantize_linear_layers(model, quant_config, quant_kernel_backend(device, cpu_gemm_backend, attn_backend))
        add_kv_cache_scales(model, quant_config)        # the checkpoint's fp8 KV-cache scales, if it has them
    load_weights(model, iterate_weights(model_config.model))
    process_quantized_layers(model)
    process_kv_cache_scales(model)
    if torch.device(device).type == "cpu":
        process_weights_after_loading(model, cpu_gemm_backend)
    use_cpu_layer_ops(model, cpu_layer_ops)
    use_cuda_layer_ops(model, cuda_layer_ops, attn_backend)
    return model.eval()


def load_model(model: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               attn_backend: str = "torch", max_model_len: int | None = None) -> tuple[nn.Module, ModelConfig]:
    """Convenience: ModelConfig.from_pretrained + get_model."""
    config = ModelConfig.from_pretrained(model, dtype=dtype, max_model_len=max_model_len)
    return get_model(config, device=device, attn_backend=attn_backend), config
