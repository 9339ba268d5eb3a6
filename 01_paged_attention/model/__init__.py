"""The Llama decoder layer around this chapter's ops, shared by chapter 04 and the engine.

Mirrors vLLM's `vllm/model_executor/models/llama.py` and `vllm/model_executor/layers/`:

    layers.py      RMSNorm (fused residual add), rope_inv_freq + RotaryEmbedding (rope scaling),
                   apply_rotary_emb + QKRotation (the rotation as a CustomOp), SiluAndMul
                   (vLLM: layers/layernorm.py, layers/rotary_embedding/, layers/activation.py)
    llama.py       SelfAttention (vLLM's LlamaAttention), LlamaMLP, LlamaDecoderLayer, STACKED_PARAMS_MAPPING
                   (vLLM: models/llama.py)
    triton_layer_ops.py  the small layers' fused Triton kernels (their `forward_cuda`)

Built on the package every chapter shares, `model_executor/`: CustomOp (a readable forward per
platform), the linear layers with their seam for a faster matmul, and tensor parallelism (the rank
groups and the linears split over them; one rank unless chapter 07's worker sets them up).

The decoder layer does not choose its attention: it is built with an attention op,
`attn(query, key, value, kv_cache, attn_metadata) -> out`, that writes this step's K/V into the
cache and reads the history (vLLM's `Attention` layer and its backend). Its users bring their own:

    chapter 04  spec_decode/attention.py: TreeAttention — chapter 01's reshape_and_cache + tree-masked
                paged attention; with no cache, causal attention within each sequence (EAGLE training)
    chapter 07  mini_vllm/models/attention.py: PagedAttention — chapter 05's unified attention

Every activation is 2-D `[num_tokens, ...]`: the tokens of all requests of a step laid end to end, no
batch dimension and no padding (vLLM v1's layout). Numerics follow HF transformers op for op (fp32 norm
statistics, the same RoPE frequencies and rotation), so fp32 results agree with HF to rounding.
"""
