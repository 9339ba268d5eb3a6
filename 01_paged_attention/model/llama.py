"""The Llama decoder layer (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3), its attention op passed in.

Mirrors vLLM's `vllm/model_executor/models/llama.py`: `LlamaAttention` (merged qkv_proj; here
`SelfAttention`), `LlamaMLP` (merged gate_up_proj), `LlamaDecoderLayer` (pre-norm, the residual add
fused into the next norm). One class for every model of the repository:

    chapter 04  the EAGLE head (one layer) and the toy target      spec_decode/eagle.py, toy_model.py
    chapter 07  LlamaModel / LlamaForCausalLM, Qwen2, Qwen3         mini_vllm/models/llama.py, ...

`attn` is the seam between this code and the KV cache: a module called as

    out [T, H, D] = attn(query [T, H, D], key [T, KVH, D], value [T, KVH, D], kv_cache, attn_metadata)

that writes this step's K/V into `kv_cache` (chapter 01's reshape_and_cache through
`attn_metadata.slot_mapping`) and attends over the history (through `attn_metadata.block_tables`).
vLLM's `Attention` layer picks its backend by platform; here whoever builds the layer passes the op:
chapter 07's `PagedAttention` (chapter 05's unified attention), chapter 04's `TreeAttention` (tree
masks; no cache at all when training). The KV cache and the metadata are arguments, not state: vLLM
binds caches to layers and passes metadata through a global "forward context"; passing both
explicitly lets a reader see, at each call, exactly which tensors the kernels read and write.

`config`: anything with hidden_size, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps (and optionally mlp_bias): chapter 07's ModelConfig, chapter 04's
EagleConfig / ToyConfig. What differs between the families is three switches: qkv_bias / o_bias
(Qwen2: a bias on q/k/v only; Llama's attention_bias: on all four), qk_norm (Qwen3).
"""
from __future__ import annotations

import torch
from torch import nn

from model_executor.custom_op import CustomOp
from paged_attention.model.layers import QKRotation, RMSNorm, SiluAndMul
from model_executor.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

KVCache = tuple[torch.Tensor, torch.Tensor]   # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]

# HF checkpoints store q/k/v and gate/up as separate tensors; here each group is one merged parameter.
# (merged parameter, checkpoint piece, shard id) — vLLM: the stacked_params_mapping of
# LlamaForCausalLM.load_weights. Loaders send a piece into its rows of the merged parameter.
STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


class SelfAttention(CustomOp):
    """The attention block of a Llama/Qwen2/Qwen3 decoder layer: qkv -> (q/k norm) -> RoPE -> attn -> o_proj.

    qkv_bias: Qwen2 (and Llama/Qwen3 with attention_bias) add a bias to q/k/v; o_bias likewise on o_proj.
    qk_norm:  Qwen3 RMS-normalises each head of q and k before RoPE (stabilises attention logits).
    A CustomOp: on a CPU its forward_cpu splits q/k/v out of the qkv projection and rotates q and k in
    one C++ pass. The rotation is a CustomOp of its own, `self.rotary` (layers.QKRotation: q and k
    rotated, v copied; on a GPU one Triton kernel), so on a GPU this block runs forward_native with
    its norms and its rotation bound to their Triton forwards.

    Tensor parallel (parallel_linear.py; one rank unless chapter 07's worker set up a TP group): the
    projections are split by heads, so num_heads / num_kv_heads here are THIS rank's heads
    (H / tp, and KVH / tp or 1 replicated KV head) and attention runs on them alone — heads never
    talk to each other; o_proj (row-parallel) all-reduces the partial outputs.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, attn: nn.Module, *,
                 rms_norm_eps: float, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        # This rank's heads: all of them on one device.
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = QKRotation()
        self.attn = attn

    def forward_native(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       kv_cache: KVCache | None, attn_metadata) -> torch.Tensor:
        T = hidden_states.shape[0]                                                   # hidden_states [T, hidden]
        ### BEGIN SOLUTION
        qkv = self.qkv_proj(hidden_states)                                           # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)                                 # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)                              # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self.rotary(q, k, v, *rope)                                         # contiguous [T, H|KVH, D]
        out = self.attn(q, k, v, kv_cache, attn_metadata)                            # [T, H, D]
        return self.o_proj(out.view(T, self.q_size))                                 # [T, hidden]
        ### END SOLUTION

    def forward_cpu(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    kv_cache: KVCache | None, attn_metadata) -> torch.Tensor:
        """forward_native, with the split of qkv, both rotations and v's copy in one C++ pass
        (kernels_cpu.layer_ops.rope_split_qkv). Qwen3's q/k norms sit between the split and the
        rotation: its blocks run forward_native."""
        if self.q_norm is not None:
            return self.forward_native(hidden_states, rope, kv_cache, attn_metadata)
        from kernels_cpu import layer_ops                                            # only once chapter 07 bound this forward
        T = hidden_states.shape[0]
        cos, sin = rope                                                              # [T, 1, D] each
        q, k, v = layer_ops.rope_split_qkv(self.qkv_proj(hidden_states), cos.view(T, -1), sin.view(T, -1),
                                           self.num_heads, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, attn_metadata)                            # [T, H, D]
        return self.o_proj(out.view(T, self.q_size))                                 # [T, hidden]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul. Tensor parallel: gate_up split
    by columns, down by rows — one all-reduce (parallel_linear.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); `attn` is the attention op (see the top)."""

    def __init__(self, config, attn: nn.Module, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False):
        super().__init__()
        self.self_attn = SelfAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim, attn, rms_norm_eps=config.rms_norm_eps, qkv_bias=qkv_bias,
                                       o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache | None, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). `residual` carries the running sum;
        # each norm first adds the previous block's output into it (RMSNorm's fused add).
        ### BEGIN SOLUTION
        if residual is None:                                       # first layer: the residual is the embedding
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        ### END SOLUTION
        return hidden_states, residual
