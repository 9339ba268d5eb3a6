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

from mini_vllm.config import ModelConfig, check_model_dir
from mini_vllm.models import cpu_gemm
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
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters, mapping pieces into merged parameters."""
    params = dict(model.named_parameters())     # tied weights appear once (under model.embed_tokens)
    expected = {(name, sid) for name, p in params.items() for sid in getattr(p, "shard_ids", (None,))}
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
        if param is None or (name, shard_id) not in expected:
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
    """Pack every CPU linear weight (and the lm_head) for a faster matmul; returns how many.

    vLLM: `model_loader/utils.py: process_weights_after_loading`, which on a CPU reaches
    `layers/utils.py: dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` (oneDNN).
    "cpu" packs column panels for our C++ kernel (fp32; models/cpu_gemm.py), "onednn" packs for
    oneDNN's matmul (fp32, or bf16 where this CPU has it), "auto" takes the first of the two that
    can run every weight, and "torch" keeps plain F.linear (the readable path; what HF runs).
    remove_weight: drop each Linear's unpacked weight once packed — the packed copy is all its
    matmul reads, and keeping both doubles the weights' memory (SmolLM2 fp32: ~+430 MB). The tied
    lm_head cannot give up its matrix: it is the input embedding too.
    """
    if cpu_gemm_backend not in cpu_gemm.CPU_GEMMS:
        raise ValueError(f"cpu_gemm_backend must be one of {cpu_gemm.CPU_GEMMS}, got {cpu_gemm_backend!r}")
    if cpu_gemm_backend == "torch":
        return 0
    from mini_vllm.models.layers import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is None]
    lm_head = getattr(model, "lm_head", None)
    if not linears and getattr(model, "packed_lm_head", None) is not None:
        return 0                                         # packed already
    pack = _gemm_packer(cpu_gemm_backend, [m.weight for m in linears])
    if pack is None:
        return 0
    packed = 0
    for module in linears:
        module.packed_weight = pack(module.weight)
        packed += 1
    if lm_head is not None and hasattr(model, "packed_lm_head"):
        if isinstance(lm_head, Linear):
            model.packed_lm_head = lm_head.packed_weight
        else:                                            # tied: the embedding matrix, packed once more
            model.packed_lm_head = pack(lm_head.weight)
            packed += 1
    if remove_weight:
        for module in linears:
            module.drop_unpacked_weight()
    return packed


def _gemm_packer(cpu_gemm_backend: str, weights: list[torch.Tensor]):
    """The packing function of the backend that runs all `weights` (None: keep F.linear);
    ValueError saying why when an explicitly requested backend cannot."""
    if not weights:
        return None
    if cpu_gemm_backend in ("auto", "cpu"):
        reason = next((r for r in map(cpu_gemm.kernel_unavailable_reason, weights) if r), None)
        if reason is None:
            return cpu_gemm.pack_panels
        if cpu_gemm_backend == "cpu":
            raise ValueError(f"cpu_gemm_backend='cpu' cannot be used: {reason}")
    if all(cpu_gemm.can_pack(w) for w in weights):
        return cpu_gemm.pack_weight
    if cpu_gemm_backend == "onednn":
        raise ValueError("cpu_gemm_backend='onednn' needs CPU weights in fp32 (or bf16 on a CPU with "
                         "AVX-512 bw/vl/dq or AVX-NE-CONVERT) and a torch built with oneDNN (mkldnn "
                         f"available: {torch.backends.mkldnn.is_available()}, bf16 supported: "
                         f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()})")
    return None


CPU_LAYER_OPS = ("auto", "cpu", "torch")    # EngineConfig.cpu_layer_ops


def use_cpu_layer_ops(model: nn.Module, mode: str = "auto") -> int:
    """Switch the norms, the MLP activation and the attention blocks' split + RoPE to the fused
    C++ ops (models/cpu_layer_ops.py); returns how many modules now use them.

    vLLM picks `CustomOp.forward_cpu` by platform when a layer is built; here the layers are
    built first and switched once their weights are on the CPU (as the packed linears are).
    "auto": where the kernels build (a C++ compiler) and the model is on the CPU; "cpu" insists;
    "torch" keeps every layer's PyTorch forward (the readable oracle)."""
    if mode not in CPU_LAYER_OPS:
        raise ValueError(f"cpu_layer_ops must be one of {CPU_LAYER_OPS}, got {mode!r}")
    if mode == "torch":
        return 0
    from mini_vllm.models import cpu_layer_ops
    from mini_vllm.models.attention import SelfAttention
    from mini_vllm.models.layers import RMSNorm, SiluAndMul

    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    reason = cpu_layer_ops.unavailable_reason() if on_cpu else "the model is not on the CPU"
    if reason is not None:
        if mode == "cpu":
            raise ValueError(f"cpu_layer_ops='cpu' cannot be used: {reason}")
        return 0
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul, SelfAttention))]
    for module in modules:
        module.cpu_kernel = True
    return len(modules)


def get_model(model_config: ModelConfig, device: str | torch.device = "cpu", attn_backend: str = "torch",
              cpu_gemm_backend: str = "torch", cpu_layer_ops: str = "torch") -> nn.Module:
    """Construct the architecture's class directly on `device` in `model_config.dtype`, load its
    weights, then prepare them for the device's matmuls (`process_weights_after_loading`) and,
    on a CPU, switch the small ops to fused kernels (`use_cpu_layer_ops`)."""
    cls = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = cls(model_config, attn_backend=attn_backend)
    load_weights(model, iterate_weights(model_config.model))
    if torch.device(device).type == "cpu":
        process_weights_after_loading(model, cpu_gemm_backend)
    use_cpu_layer_ops(model, cpu_layer_ops)
    return model.eval()


def load_model(model: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               attn_backend: str = "torch", max_model_len: int | None = None) -> tuple[nn.Module, ModelConfig]:
    """Convenience: ModelConfig.from_pretrained + get_model."""
    config = ModelConfig.from_pretrained(model, dtype=dtype, max_model_len=max_model_len)
    return get_model(config, device=device, attn_backend=attn_backend), config
