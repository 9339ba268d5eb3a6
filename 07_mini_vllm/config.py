"""ModelConfig: the few numbers from an HF checkpoint's config.json that our models need.

Mirrors vLLM's `vllm/config/model.py: ModelConfig` (which also wraps
`transformers.AutoConfig`): read once, validated once, with clear errors, so that model code
can trust every field. The raw `transformers` config stays available as `hf_config`.

Two generations of transformers spell RoPE differently, and a silent fallback to the
default theta (10000) would still run but give wrong answers, so both are read explicitly:
  * transformers 5: `config.rope_parameters = {"rope_type": ..., "rope_theta": ..., "factor": ...}`
  * transformers 4: `config.rope_theta` + `config.rope_scaling = {"rope_type"|"type": ..., ...}`
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcache.cache_engine import KVCacheSpec
from mini_vllm.models.registry import SUPPORTED_ARCHITECTURES
from mini_vllm.models.quantization import verify_quantization
from paged_attention.kv_quant import KVQuant, check_kv_cache_dtype, kv_quant_for

# RoPE variants our RotaryEmbedding implements (chapter 01's paged_attention/model/layers.py: rope_inv_freq).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of float32, bfloat16, float16")


@dataclass(frozen=True)
class ModelConfig:
    model: Path                       # the HF-format checkpoint directory
    architecture: str                 # e.g. "LlamaForCausalLM"; picks the class in models/registry.py
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int          # < num_attention_heads: GQA; 1: MQA
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None         # None for plain RoPE, else {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool         # lm_head.weight is embed_tokens.weight
    attention_bias: bool              # bias on q/k/v/o projections (Llama, Qwen3 flag; Qwen2 always has q/k/v bias)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]    # config.json + generation_config.json, in that order
    bos_token_id: int | None
    dtype: torch.dtype                # the dtype weights and activations are computed in
    max_model_len: int                # longest sequence (prompt + output) the engine may run
    hf_config: Any = field(default=None, repr=False, compare=False)
    quantization: str | None = None   # the checkpoint's quantization method (models/quantization.py); None: floats
    quantization_config: dict | None = field(default=None, repr=False)   # config.json's quantization_config
    kv_cache_dtype: str = "auto"      # vLLM's --kv-cache-dtype: "auto" (= dtype) or an 8-bit cache (kv_quant.py)

    def __post_init__(self):
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({self.max_position_embeddings})")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {self.dtype} is not supported; use float32, bfloat16 or float16")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype in ("float16", "bfloat16") and getattr(torch, self.kv_cache_dtype) != self.dtype:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} differs from the model's dtype {self.dtype}: a "
                             "float cache here is in the model's dtype; use 'auto' or an 8-bit kv_cache_dtype")
        if self.kv_quant is not None and self.kv_quant.per_token_head and self.head_dim % 4:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} stores each row's fp32 scale after its "
                             f"head_dim numbers and needs head_dim % 4 == 0; this model's head_dim is {self.head_dim}")

    @property
    def kv_quant(self) -> KVQuant | None:
        """The 8-bit cache every attention layer writes and reads (None: a float cache). Per-tensor fp8
        scales are 1.0 unless the checkpoint brings its own (the loader sets them per layer)."""
        return kv_quant_for(self.kv_cache_dtype)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype | None = None) -> KVCacheSpec:
        """This model's paged KV cache in chapter 02's terms: one K and one V tensor per layer, each
        [num_blocks, block_size, num_key_value_heads, head_dim] (chapter 01's layout, vLLM's
        FlashAttention layout), in the model's dtype unless another is given; with an 8-bit
        kv_cache_dtype, int8 / fp8 rows (+ each row's fp32 scale for the per-token-head modes)."""
        kv_quant = self.kv_quant if dtype is None else None
        if kv_quant is not None:      # 8 bits a number (+ each row's scale): paged_attention/kv_quant.py
            return KVCacheSpec(self.num_hidden_layers, block_size, self.num_key_value_heads, self.head_dim,
                               kv_quant.storage_dtype, kv_quant.cache_head_dim(self.head_dim))
        return KVCacheSpec(self.num_hidden_layers, block_size, self.num_key_value_heads, self.head_dim,
                           dtype or self.dtype)

    @classmethod
    def from_pretrained(cls, model: str | Path, dtype: str | torch.dtype = "auto",
                        max_model_len: int | None = None, quantization: str | None = None,
                        kv_cache_dtype: str = "auto") -> "ModelConfig":
        """Read and validate `model/config.json` (via transformers.AutoConfig).

        dtype: "auto" = the checkpoint's dtype (config "dtype"/"torch_dtype"), fp32 if it names none.
        max_model_len: default = max_position_embeddings (or a smaller sliding window).
        quantization: None = whatever the checkpoint's quantization_config says; a method's name
        must match it (vLLM's check, models/quantization.py).
        """
        path = Path(model).expanduser()
        check_model_dir(path)
        raw = json.loads((path / "config.json").read_text())
        architectures = raw.get("architectures") or []
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(f"{path}/config.json declares architectures {architectures or '(none)'}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (our MLP is SiLU-gated)")
        # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) differs from full
        # attention only once a sequence outgrows the window: cap max_model_len at the window (as early
        # vLLM did) instead of silently attending too far.
        sliding_window = getattr(hf, "sliding_window", None)
        limit = min(hf.max_position_embeddings, sliding_window or hf.max_position_embeddings)
        if max_model_len is not None and max_model_len > limit:
            why = f"the sliding window ({sliding_window})" if limit < hf.max_position_embeddings else "max_position_embeddings"
            raise ValueError(f"max_model_len={max_model_len} exceeds {why} = {limit}: full attention is only exact up to there")
        rope_theta, rope_scaling = read_rope(hf)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if dtype == "auto":
            checkpoint_dtype = getattr(hf, "dtype", None) or raw.get("torch_dtype") or raw.get("dtype")
            dtype = parse_dtype(checkpoint_dtype) if checkpoint_dtype is not None else torch.float32
        else:
            dtype = parse_dtype(dtype)
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        return cls(
            model=path,
            architecture=supported[0],
            num_hidden_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=read_eos_token_ids(path, hf),
            bos_token_id=getattr(hf, "bos_token_id", None),
            dtype=dtype,
            max_model_len=max_model_len if max_model_len is not None else limit,
            hf_config=hf,
            quantization=verify_quantization(raw.get("quantization_config"), quantization, path),
            quantization_config=raw.get("quantization_config"),
            kv_cache_dtype=kv_cache_dtype,
        )


def weights_fingerprint(path: Path, sample_bytes: int = 1 << 16) -> str:
    """A short id of a checkpoint's weights: sha256 over config.json and, per weight file, its
    name, size and three samples (start, middle, end). Two engines' K/V are interchangeable only
    if their weights are the same (chapter 06 keys shared K/V by this): a name or config.json
    alone would let a fine-tune, or another random initialisation of the same architecture,
    read this model's K/V. Milliseconds for any model size."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            for offset in sorted({0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)}):
                f.seek(offset)
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]


def check_model_dir(path: Path) -> None:
    """The clear errors for a directory that is not an HF-format checkpoint."""
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is not a directory (expected an HF-format checkpoint directory)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: expected an HF-format checkpoint directory "
                                "(config.json + *.safetensors + tokenizer files)")
    if not any(path.glob("*.safetensors")):
        hint = " (found PyTorch .bin files: convert them to safetensors)" if any(path.glob("*.bin")) else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weights{hint}")


def read_rope(hf) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a transformers 5 or 4 config."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and params:                      # transformers 5
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type RoPE parameters are not supported: {params}")
        theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
        scaling = dict(params)
    else:                                                         # transformers 4
        theta = getattr(hf, "rope_theta", None)
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
    if theta is None:
        raise ValueError("config has no rope_theta (neither in rope_parameters nor at the top level)")
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
    return float(theta), {"rope_type": rope_type, **scaling}


def read_eos_token_ids(path: Path, hf) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (chat models often add ids there,
    e.g. Llama 3 Instruct's <|eot_id|>), de-duplicated in order. vLLM merges the same two."""
    ids: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(getattr(hf, "eos_token_id", None))
    gen = path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return tuple(ids)


# The generation_config.json fields vLLM turns into default sampling parameters
# (vllm/config/model.py: ModelConfig.get_diff_sampling_param); HF's max_new_tokens is max_tokens.
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def read_default_sampling_params(directory: Path) -> dict:
    """{SamplingParams field: value} that the model's creator recommends in `directory`'s
    generation_config.json — only the fields it sets (an empty dict when there is no file)."""
    gen = Path(directory) / "generation_config.json"
    if not gen.is_file():
        return {}
    config = json.loads(gen.read_text())
    diff = {name: config[name] for name in GENERATION_CONFIG_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff
