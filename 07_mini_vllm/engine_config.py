"""EngineConfig: every knob of the engine, validated once, in one flat dataclass.

Mirrors vLLM's `vllm/engine/arg_utils.py: EngineArgs` (one flat list of user-facing
arguments, the same names) and the configs it is split into (`vllm/config/`: `CacheConfig`,
`SchedulerConfig`, `CompilationConfig`). Flat because that is how users pass them:
`LLM(model, max_num_seqs=64, enable_prefix_caching=False)`. What depends on the checkpoint
(`max_model_len` by default, the dtype) is resolved once the model's `ModelConfig` is read,
by `resolve(model_config)`.

Defaults follow vLLM v1: prefix caching and chunked prefill on, recompute preemption,
16-token blocks, CUDA graphs unless `enforce_eager`. KV memory: on a GPU,
`gpu_memory_utilization` of the device's memory is the engine's, and whatever the weights and
the profiled activations leave goes to KV blocks; on a CPU there is nothing to profile
against, so `kv_cache_memory` bytes are given explicitly (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paged_attention.kv_quant import check_kv_cache_dtype
from scheduler import POLICIES, SchedulerConfig

from mini_vllm.models.linear_method import CPU_GEMMS
from mini_vllm.models.loader import CPU_LAYER_OPS, CUDA_LAYER_OPS
from mini_vllm.parallel_config import ParallelConfig
from mini_vllm.sampler import LOGPROBS_MODES
from mini_vllm.sampling_params import MAX_LOGPROBS
from mini_vllm.speculative_config import SpeculativeConfig

GiB = 1 << 30
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)    # vLLM's MaxLoRARanks

# attention_backend -> what runs (see models/attention.py: ATTENTION_BACKENDS). "auto" picks
# Triton on a GPU (vLLM's TritonAttentionBackend) and, on a CPU, the C++ kernel of kernels_cpu
# (vLLM's CPU attention) when it builds here and cpu_kernels allows it, else the vectorized torch path.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "cuda", "reference")
CPU_KERNELS = ("auto", "off")             # EngineConfig.cpu_kernels

# The default of EngineConfig.cpu_keep_freed_memory, for a process that builds many engines: the
# test suite sets it to 0 (tests/conftest.py), since malloc's setting is process-wide and kept,
# so one pytest process would otherwise hold on to the high-water mark of every engine it ran.
KEEP_FREED_MEMORY_ENV = "VFS_CPU_KEEP_FREED_MEMORY"


def keep_freed_memory_default() -> bool:
    """True unless $VFS_CPU_KEEP_FREED_MEMORY is 0 / false (a field given explicitly wins)."""
    value = os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{KEEP_FREED_MEMORY_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")


@dataclass
class EngineConfig:
    model: str | Path | None = None
    """An HF-format checkpoint directory (config.json + *.safetensors + tokenizer). None: the
    default model, SmolLM2-135M-Instruct, converted once (`mini_vllm.default_model`)."""

    tokenizer: str | Path | None = None
    """Tokenizer directory; None = the model directory."""

    dtype: str | torch.dtype = "auto"
    """'auto' = the checkpoint's dtype; or float32 / bfloat16 / float16."""

    device: str = "auto"
    """'auto' = cuda if available, else cpu."""

    attention_backend: str = "auto"
    """auto | cpu (the C++ kernel, CPU default) | torch (vectorized SDPA) | triton (GPU default) |
    cuda (CUDA cache write + Triton attention) | reference (the loops)."""

    max_model_len: int | None = None
    """Longest prompt + output; None = the model's max_position_embeddings (or its sliding window)."""

    block_size: int = 16
    """Tokens per KV block (vLLM's default)."""

    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before (chapter 02)."""

    enable_chunked_prefill: bool = True
    """Split prompts across steps to fit the token budget (chapter 05); off: the scheduler without chapter 05's
    layer (engine_scheduler.py), so a whole prompt must fit one step's budget."""

    max_num_seqs: int = 128
    """Most requests running at once (also the largest CUDA-graph batch)."""

    max_num_batched_tokens: int | None = None
    """The token budget of one step. None: 2048 with chunked prefill, else max(max_model_len, 2048)
    (without chunking a whole prompt must fit in one step)."""

    scheduling_policy: str = "fcfs"
    """fcfs | priority | srtf | two_level (chapter 03)."""

    preemption_mode: str = "recompute"
    """recompute (vLLM v1) | swap (v0: the victim's blocks go to a CPU tier of `swap_space` GiB)."""

    swap_space: float = 0.0
    """GiB of CPU memory for swapped-out KV blocks (preemption_mode='swap')."""

    gpu_memory_utilization: float = 0.9
    """GPU: the fraction of the device's memory this engine may use (weights + activations + KV)."""

    kv_cache_memory: int | None = None
    """Bytes for KV blocks (of each rank, with tensor / pipeline parallelism). Default: 2 GiB on a CPU; on a
    GPU None = profile (gpu_memory_utilization)."""

    num_gpu_blocks_override: int | None = None
    """Exactly this many KV blocks, skipping the memory computation (tests: a tiny pool forces preemption).
    Unlike a computed size it may be too small for one max_model_len request: such requests then fail
    with an error instead of the engine refusing to start."""

    enforce_eager: bool = False
    """Never use CUDA graphs (they are only used on a GPU with the triton/cuda backends anyway)."""

    cuda_graph_sizes: list[int] | None = None
    """Decode batch sizes to capture; None: 1, 2, 4, 8, ... up to max_num_seqs (and max_num_seqs itself)."""

    cpu_kernels: str = "auto"
    """The master switch of the CPU fast paths (kernels_cpu/): auto (each where it builds and runs:
    the knobs below, and the attention backend "cpu") | off (the whole engine on torch ops alone:
    attention "torch" unless attention_backend names another, F.linear, the layers' PyTorch
    forwards, malloc left alone; the knobs below left at auto become torch / False, and asking
    for a CPU kernel by name is an error). On a GPU the CPU kernels never run either way."""

    cpu_gemm_backend: str = "auto"
    """CPU linear layers, on weights packed at load time: auto (the first that runs the weights:
    cpu, then onednn) | cpu (our C++ kernel, fp32) | onednn (vLLM's choice) | torch (plain F.linear,
    no packing). See models/linear_method.py."""

    cpu_layer_ops: str = "auto"
    """CPU norms, SiLU-and-mul and RoPE: auto (fused C++ kernels where they build, kernels_cpu/layer_ops.py)
    | cpu (insist) | torch (each layer's PyTorch forward)."""

    cuda_layer_ops: str = "auto"
    """GPU norms, SiLU-and-mul and RoPE: auto (fused Triton kernels, paged_attention/model/triton_layer_ops.py,
    when the model is on a GPU with the triton or cuda attention backend) | triton (insist: the model
    must be on a GPU) | torch (each layer's PyTorch forward: the readable oracle, for debugging)."""

    cpu_keep_freed_memory: bool = field(default_factory=keep_freed_memory_default)
    """CPU: configure malloc to keep what it frees for reuse (kernels_cpu/malloc.py; vLLM preloads
    tcmalloc for the same reason) instead of unmapping big buffers and page-faulting them back in every
    prefill step. Process-wide: once an engine has set it, it stays for the process. Default True
    ($VFS_CPU_KEEP_FREED_MEMORY=0 makes it False: what the test suite does)."""

    cpu_warm_up: bool = False
    """CPU: at start-up, run one forward at the largest step the scheduler may ask for (`profile_run`:
    max_num_batched_tokens tokens), so that the first large step a client sends does not also pay that
    size's one-time costs (vLLM's CPU worker does the same: CPUModelRunner.warming_up_model). Off by
    default, since it costs every engine start one full step; `python -m mini_vllm serve` turns it on.
    On a GPU the memory profiling already runs that forward."""

    seed: int = 0
    """Seeds the random stream shared by sampled requests that bring no seed of their own."""

    max_logprobs: int = MAX_LOGPROBS
    """The most logprobs / prompt_logprobs a request may ask for (vLLM's --max-logprobs, default 20);
    -1: no limit (a request's -1 then means the whole vocabulary)."""

    logprobs_mode: str = "raw_logprobs"
    """What `logprobs` report (vLLM's LogprobsMode): raw_logprobs (the model's distribution) |
    raw_logits | processed_logprobs | processed_logits (after penalties, logits processors,
    temperature, min-p, top-k and top-p: the distribution the token was drawn from)."""

    generation_config: str | Path = "auto"
    """Default SamplingParams, as vLLM's --generation-config: auto (the model directory's
    generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)
    | vllm (SamplingParams' own defaults) | a directory holding a generation_config.json. Used only
    where no SamplingParams is given (LLM.get_default_sampling_params); EOS ids are always read."""

    kv_transfer_config: dict | Any | None = None
    """Remote K/V (chapter 06), vLLM's dict: {"kv_connector": "GlobalKVPoolConnector" (from scratch)
    | "MooncakeConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    "kv_connector_extra_config": {...}} (keys: global_prefix_cache/config.py), or a
    global_prefix_cache.KVTransferConfig. None: off. CPU only (the layers move host memory)."""

    speculative_config: dict | SpeculativeConfig | None = None
    """Speculative decoding (chapter 04), vLLM's dict: {"method": "ngram" | "draft_model" | "eagle" |
    "layer_skip", "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": n,
    "model": path, ...} (all keys: mini_vllm/speculative_config.py). None: off."""

    structured_outputs_config: dict | None = None
    """Structured output (chapter 08), vLLM's dict: {"backend": "from_scratch" (chapter 08's automata,
    the default) | "xgrammar" (the real library, a peer)}. A constrained request
    (SamplingParams.structured_outputs) loads the backend when it first arrives."""

    quantization: str | None = None
    """How the checkpoint's weights are quantized (chapter 10; vLLM's --quantization / -q):
    None reads the checkpoint's config.json (`quantization_config.quant_method`); a name
    ("compressed-tensors") must match it. The methods: mini_vllm/models/quantization.py."""

    kv_cache_dtype: str = "auto"
    """What the KV cache stores (vLLM's --kv-cache-dtype; paged_attention/kv_quant.py): "auto" (the
    model's dtype), "fp8" / "fp8_e4m3" (fp8 with one scale per layer for K and one for V: the
    checkpoint's k_scale / v_scale, else 1.0), "int8_per_token_head" / "fp8_per_token_head" (8 bits
    with one fp32 scale per token and KV head, computed as the row is written). One byte a number:
    the same kv_cache_memory holds 2x (vs bf16) or ~4x (vs fp32) the blocks."""

    enable_lora: bool = False
    """Multi-LoRA serving (chapter 09; vLLM's --enable-lora): requests may carry a LoRARequest, and
    the model's qkv / o / gate_up / down layers add each token's adapter update. Off: a request with an
    adapter is refused. With it on, CUDA graphs are not captured (the batch's adapters change per step)."""

    max_loras: int = 1
    """Adapters one step may use (vLLM's --max-loras): the device slots, and the scheduler's cap on
    distinct adapters among the requests it runs at once (a request of another adapter waits)."""

    max_lora_rank: int = 16
    """The largest rank an adapter may have (vLLM's --max-lora-rank, one of its values:
    1, 8, 16, 32, 64, 128, 256, 320, 512); every slot is allocated at this rank."""

    max_cpu_loras: int | None = None
    """Adapters kept in host memory (vLLM's --max-cpu-loras): a least-recently-used cache in front of
    the disk. None: max_loras. Must be >= max_loras."""

    tensor_parallel_size: int = 1
    """Ranks that split every layer (Megatron-style: heads, MLP features, vocabulary); each holds
    its heads' K/V. Must divide the attention heads (parallel_config.py says what else)."""

    pipeline_parallel_size: int = 1
    """Stages that split the layers; activations go from stage to stage each step."""

    distributed_executor_backend: str | None = None
    """Who runs the ranks (vLLM's name): "uni" (UniProcExecutor: the model runner in this process;
    one rank) | "mp" (MultiprocExecutor: one worker process per rank, torch.distributed between them:
    gloo on CPU, NCCL on GPU) | "ray" (RayDistributedExecutor: one Ray actor per rank; needs `ray`).
    None: "uni" for one rank, else "mp"."""

    max_concurrent_batches: int | None = None
    """Pipeline micro-batches: how many scheduled batches may be in flight at once (vLLM:
    Executor.max_concurrent_batches, EngineCore.step_with_batch_queue). None: pipeline_parallel_size
    (while stage 1 runs batch A, stage 0 runs batch B). 1: the stages step in lockstep. Either way
    only the last stage samples; the others get the tokens with the next schedule."""

    async_scheduling: bool = False
    """Schedule step N+1 while step N runs (vLLM's --async-scheduling; async_scheduler.py, core.py's
    batch queue of two, the runner's input ids from the previous step's sampled tokens on the device):
    the host's scheduling and output processing overlap the forward pass instead of following it.
    Off by default here (benchmarks/bench_host_overhead.py --async-ab). Refused where vLLM 0.32 refuses
    it: with the n-gram drafter, pipeline parallelism and the Ray executor (_check_async_scheduling)."""

    execute_model_timeout_s: float = 300.0
    """The multiprocess executor waits at most this long for a step (and for workers to start)
    before declaring the workers hung and failing the requests (vLLM: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
    A worker that dies is noticed at once, not after this timeout."""

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise ValueError(f"model must be a path (str or Path) or None, got {self.model!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available (use device='cpu')")
        self._check_cpu_kernels()
        if self.cpu_gemm_backend not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm_backend must be one of {CPU_GEMMS}, got {self.cpu_gemm_backend!r}")
        if self.cpu_layer_ops not in CPU_LAYER_OPS:
            raise ValueError(f"cpu_layer_ops must be one of {CPU_LAYER_OPS}, got {self.cpu_layer_ops!r}")
        if self.cuda_layer_ops not in CUDA_LAYER_OPS:
            raise ValueError(f"cuda_layer_ops must be one of {CUDA_LAYER_OPS}, got {self.cuda_layer_ops!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        _positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped-out KV)")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes or not all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive ints, got {self.cuda_graph_sizes!r}")
        if not isinstance(self.cpu_warm_up, bool):
            raise ValueError(f"cpu_warm_up must be True or False, got {self.cpu_warm_up!r}")
        if not isinstance(self.cpu_keep_freed_memory, bool):
            raise ValueError(f"cpu_keep_freed_memory must be True or False, got {self.cpu_keep_freed_memory!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: no limit), got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.generation_config, (str, Path)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if self.generation_config not in ("auto", "vllm") and not (Path(self.generation_config) /
                                                                   "generation_config.json").is_file():
            raise ValueError(f"generation_config={str(self.generation_config)!r}: no generation_config.json there "
                             "(use 'auto' for the model's, or 'vllm' for none)")
        if self.kv_transfer_config is not None:
            from global_prefix_cache.config import KVTransferConfig
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
            if self.resolved_device.type != "cpu":
                raise ValueError(f"kv_transfer_config needs device='cpu' (chapter 06 moves host memory; GPU K/V "
                                 f"would need GPUDirect RDMA or a staging copy), got {self.device!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.logprobs_mode.startswith("processed"):
                raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not supported with speculative decoding "
                                 "(accepted drafts report the raw distribution); use raw_logprobs or raw_logits")
        self._check_structured_outputs()
        self._check_lora()
        self._check_parallel()
        self._check_async_scheduling()

    def _check_structured_outputs(self) -> None:
        from mini_vllm.structured_output_backend import BACKENDS, DEFAULT_BACKEND
        config = dict(self.structured_outputs_config or {})
        unknown = set(config) - {"backend"}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {sorted(unknown)} (known: ['backend'])")
        config.setdefault("backend", DEFAULT_BACKEND)
        if config["backend"] not in BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {sorted(BACKENDS)}, got {config['backend']!r}")
        self.structured_outputs_config = config

    def _check_lora(self) -> None:
        """vLLM's LoRAConfig checks, with its messages."""
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method's name or None, got {self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        _positive_int("max_loras", self.max_loras)
        if self.max_lora_rank not in MAX_LORA_RANKS or isinstance(self.max_lora_rank, bool):
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}, got {self.max_lora_rank!r}")
        _positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    def _check_parallel(self) -> None:
        """The split itself (parallel_config.py; against the model once it is read: LLMEngine) and
        what the multiprocess executor does not carry: features whose state lives in the model
        runner of the engine's own process."""
        parallel = self.parallel_config                       # validates the sizes and the backend
        if not isinstance(self.execute_model_timeout_s, (int, float)) or not self.execute_model_timeout_s > 0:
            raise ValueError(f"execute_model_timeout_s must be > 0 seconds, got {self.execute_model_timeout_s!r}")
        mcb = self.max_concurrent_batches
        if mcb is not None and (not isinstance(mcb, int) or isinstance(mcb, bool) or not 1 <= mcb <= self.pipeline_parallel_size):
            raise ValueError(f"max_concurrent_batches must be None or an integer in 1..pipeline_parallel_size "
                             f"({self.pipeline_parallel_size}): more batches than stages would only queue; got {mcb!r}")
        spec = self.speculative_config
        if spec is not None and spec.uses_tree and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config tree_depth: the accepted branch's K/V moves to its chain slots in every "
                             "layer after verification, and only the last pipeline stage learns which branch that is "
                             "(draft a chain: leave tree_depth out)")
        if parallel.executor_backend == "uni":
            return
        if self.speculative_config is not None and self.speculative_config.method == "layer_skip" \
                and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config method 'layer_skip' drafts with the target's first layers, which live "
                             "on pipeline stage 0; the drafter runs where the tokens are sampled, on the last stage "
                             "(use 'draft_model' with a small checkpoint, or 'eagle')")
        if self.resolved_device.type == "cuda" and self.num_gpu_blocks_override is None and self.kv_cache_memory is None:
            raise ValueError("the multiprocess executor does not profile GPU memory: give kv_cache_memory (bytes per "
                             "rank) or num_gpu_blocks_override")

    def _check_async_scheduling(self) -> None:
        """What async scheduling does not run with — where real vLLM 0.32 refuses the same pair, with
        its reason (the vLLM check is named beside each)."""
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if not self.async_scheduling:
            return
        spec = self.speculative_config
        conflicts = [
            # VllmConfig.__post_init__: async scheduling with a speculative method it cannot overlap.
            (spec is not None and spec.method == "ngram",
             "Currently, async scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash kind "
             "of speculative decoding (speculative_config method 'ngram' is vLLM's CPU n-gram proposer)"),
            # VllmConfig._validate_v1_model_runner: the model runner here is vLLM's V1 runner's shape.
            (self.pipeline_parallel_size > 1,
             "Model Runner V1 does not support: pipeline parallelism with async scheduling"),
            # VllmConfig.__post_init__: RayDistributedExecutor.supports_async_scheduling() is False.
            (self.parallel_config.executor_backend == "ray", "`ray` does not support async scheduling yet."),
            # Ours: a step in flight is scheduled with placeholder drafts the runner fills from its own
            # proposals — a chain's; a tree's positions and mask are laid out when it is verified.
            (spec is not None and spec.uses_tree,
             "speculative_config tree_depth (EAGLE-2 trees) runs with synchronous scheduling only"),
        ]
        for conflict, why in conflicts:
            if conflict:
                raise ValueError(f"async_scheduling=True: {why}")

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.distributed_executor_backend,
                              self.max_concurrent_batches)

    def _check_cpu_kernels(self) -> None:
        """Validate the master switch; with "off", a CPU kernel asked for by name is a conflict,
        and the knobs left at their defaults become their torch values."""
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")
        if self.cpu_kernels == "auto":
            return
        asked = {"cpu_gemm_backend": self.cpu_gemm_backend in ("cpu", "onednn"),
                 "cpu_layer_ops": self.cpu_layer_ops == "cpu", "attention_backend": self.attention_backend == "cpu"}
        for name, conflict in asked.items():
            if conflict:
                raise ValueError(f"cpu_kernels='off' runs the engine on torch ops alone, but {name}="
                                 f"{getattr(self, name)!r} asks for a CPU kernel: drop one of the two")
        if self.cpu_gemm_backend == "auto":
            self.cpu_gemm_backend = "torch"
        if self.cpu_layer_ops == "auto":
            self.cpu_layer_ops = "torch"
        self.cpu_keep_freed_memory = False

    # ------------------------------------------------------------------ derived values
    @property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.resolved_device.type == "cuda":
            return "triton"
        if self.cpu_kernels == "off":
            return "torch"
        from paged_attention import cpu_ops
        return "cpu" if cpu_ops.is_available() else "torch"

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        return max(budget, self.max_num_seqs)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """Chapter 03's SchedulerConfig, or chapter 05's ChunkedPrefillConfig when chunking is on."""
        kwargs = dict(max_num_seqs=self.max_num_seqs,
                      max_num_batched_tokens=self.resolve_max_num_batched_tokens(max_model_len),
                      max_model_len=max_model_len, policy=self.scheduling_policy,
                      preemption_mode=self.preemption_mode,
                      # Room for the next step's drafts (vLLM reserves them for EAGLE): a request
                      # that gets k drafts needs k more slots than its plain decode step.
                      num_lookahead_tokens=self.num_speculative_tokens)
        if self.enable_chunked_prefill:
            from chunked_prefill import ChunkedPrefillConfig
            return ChunkedPrefillConfig(**kwargs)
        return SchedulerConfig(**kwargs)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    def capture_sizes(self) -> list[int]:
        """Decode batch sizes with a CUDA graph, ascending (vLLM: cudagraph_capture_sizes)."""
        if self.cuda_graph_sizes is not None:
            return sorted({s for s in self.cuda_graph_sizes if s <= self.max_num_seqs})
        sizes, s = [], 1
        while s < self.max_num_seqs:
            sizes.append(s)
            s *= 2
        return sizes + [self.max_num_seqs]
