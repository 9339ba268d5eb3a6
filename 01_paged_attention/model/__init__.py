"""The Llama model code around this chapter's ops: one decoder layer, shared by chapter 04 and the engine.

Mirrors vLLM's `vllm/model_executor/` and `vllm/distributed/`:

    custom_op.py   CustomOp: a readable `forward_native` and, optionally, a faster `forward_cpu`, bound once
    linear.py      Linear (+ the linear-method seam: LinearMethodBase, UnquantizedLinearMethod),
                   MergedColumnLinear, QKVLinear, VocabEmbedding
                   (vLLM: layers/linear.py, layers/vocab_parallel_embedding.py)
    parallel_linear.py  ColumnParallelLinear, RowParallelLinear, MergedColumnParallelLinear,
                   QKVParallelLinear, VocabParallelEmbedding, ParallelLMHead: the linears above split over
                   tensor-parallel ranks (vLLM: layers/linear.py, vocab_parallel_embedding.py)
    parallel_state.py  the TP / PP groups and their collectives (vLLM: distributed/parallel_state.py);
                   one rank unless chapter 07's worker sets them up, and then the layers are chapter 01's
    layers.py      RMSNorm (fused residual add), rope_inv_freq + RotaryEmbedding (rope scaling),
                   apply_rotary_emb, SiluAndMul
                   (vLLM: layers/layernorm.py, layers/rotary_embedding/, layers/activation.py)
    llama.py       SelfAttention (vLLM's LlamaAttention), LlamaMLP, LlamaDecoderLayer, STACKED_PARAMS_MAPPING
                   (vLLM: models/llama.py)

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
