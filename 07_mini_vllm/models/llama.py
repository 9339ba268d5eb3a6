"""The Llama family (Llama 2/3, SmolLM2, Mistral-style GQA) on paged attention, from scratch.

Mirrors vLLM's `vllm/model_executor/models/llama.py`: `LlamaModel`, `LlamaForCausalLM` (+
`compute_logits`, and `load_weights`' stacked_params_mapping, used by loader.py). The layers are
chapter 01's (paged_attention/model/: `LlamaDecoderLayer`, its `SelfAttention` — vLLM's
`LlamaAttention` — and `LlamaMLP`, the linears, norms and RoPE), the same class chapter 04's EAGLE
head is made of; the engine builds each layer with its attention op, attention.py's `PagedAttention`
(chapter 05's unified attention over the paged cache).

The forward contract the engine's model runner relies on (same as vLLM v1):

    hidden = model(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata)   # [T, hidden]
    logits = model.compute_logits(hidden[logits_indices])                                # [N, vocab] fp32

`T` tokens of any number of requests, laid end to end (no padding); `kv_caches[i]` is layer i's
(key_cache, value_cache); `attn_metadata` (chapter 01's AttentionMetadata) says where each token's
K/V go and which blocks each request reads. Only the rows that are sampled go through the
vocabulary projection: for a 500-token prefill that is 1 row, not 500.

Qwen2 and Qwen3 differ from Llama in three switches, chosen by `attention_options` (qwen2.py, qwen3.py).

Parallel (set up by the worker, `model_executor.parallel_state`; one rank otherwise):
  * tensor parallel: the layers split themselves (model_executor/parallel_linear.py); here the
    embedding and the LM head are split by vocabulary and the logits all-gathered, so every rank
    samples the same token from the same [N, vocab] logits.
  * pipeline parallel: this rank builds only its layers [start_layer, end_layer) (the others are
    `PPMissingLayer` placeholders, so parameter names keep their global layer index and the loader
    skips what another stage holds — vLLM: make_layers, PPMissingLayer). A stage receives the
    previous stage's (hidden, residual) [T, hidden] each, runs its layers and sends them on; the
    last stage normalises, computes the logits and broadcasts them to the other stages, which
    therefore sample the same tokens and keep their persistent batch in step (vLLM sends the
    sampled token ids instead: fewer bytes, one more code path in the model runner).
"""
from __future__ import annotations

import torch
from torch import nn

from paged_attention.metadata import AttentionMetadata
from paged_attention.model.layers import RMSNorm, RotaryEmbedding
from paged_attention.model.llama import STACKED_PARAMS_MAPPING, KVCache, LlamaDecoderLayer, LlamaMLP
from model_executor.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from model_executor.parallel_state import get_pp_group

from mini_vllm.config import ModelConfig
from mini_vllm.models.attention import PagedAttention

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel", "PPMissingLayer", "get_pp_indices"]


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: no parameters, never called (vLLM: PPMissingLayer)."""


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank`: as even as possible, earlier stages one more
    when it does not divide (vLLM: get_pp_indices, which gives the extra layers to later stages' peers)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, attn_backend: str,
                 embed_on_last_stage: bool = False):
        super().__init__()
        # The pipeline group this model was built for (its stage's layers, its neighbours): kept, so that a
        # drafter built whole beside the last stage (parallel_state.whole_model_on_this_stage) stays whole.
        self.pp = pp = get_pp_group()
        self.start_layer, self.end_layer = get_pp_indices(config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        # The first stage embeds; the last needs the matrix too when the LM head is tied to it, or when
        # an EAGLE head drafts there (it embeds the tokens it proposes).
        needs_embedding = pp.is_first_rank or (pp.is_last_rank and (config.tie_word_embeddings or embed_on_last_stage))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if needs_embedding
                             else PPMissingLayer())
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self._attention(config, attn_backend), qkv_bias=qkv_bias, o_bias=o_bias,
                              qk_norm=qk_norm)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        # One table for all layers, sized for the longest sequence the engine will run.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                          config.rope_scaling, dtype=config.dtype)
        self.hidden_size = config.hidden_size

    @staticmethod
    def _attention(config: ModelConfig, attn_backend: str) -> PagedAttention:
        layer_attn = PagedAttention(config.num_attention_heads, config.head_dim, config.num_key_value_heads,
                                    scale=config.head_dim ** -0.5, backend=attn_backend, kv_quant=config.kv_quant)
        return layer_attn

    @property
    def local_layers(self) -> nn.ModuleList:
        """This stage's layers (all of them without pipeline parallelism), one KV cache each."""
        return self.layers[self.start_layer:self.end_layer]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        pp = self.pp
        rope = self.rotary_emb.cos_sin(positions)                                  # computed once, used by every layer
        if pp.is_first_rank:
            hidden_states, residual = self.embed_tokens(input_ids), None           # [T, hidden]
        else:                                                                      # the previous stage's activations
            hidden_states = pp.recv(self.rotary_emb.cos_sin_cache.new_empty(input_ids.shape[0], self.hidden_size),
                                    pp.rank_in_group - 1)
            residual = pp.recv(torch.empty_like(hidden_states), pp.rank_in_group - 1)
        for layer, kv_cache in zip(self.local_layers, kv_caches):
            hidden_states, residual = layer(hidden_states, residual, rope, kv_cache, attn_metadata)
        if not pp.is_last_rank:
            if residual is None:                                                   # a stage of zero layers cannot exist
                raise RuntimeError("a pipeline stage ran no layer")
            pp.send(hidden_states, pp.rank_in_group + 1)
            pp.send(residual, pp.rank_in_group + 1)
            return hidden_states                                                   # not normalised: only the shape is used
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states                                                       # [T, hidden]


class LlamaForCausalLM(nn.Module):
    # Checkpoint names -> our merged parameters: (our param, checkpoint piece, shard id), the layer's
    # (vLLM: LlamaForCausalLM.load_weights' stacked_params_mapping). Used by loader.load_weights.
    stacked_params_mapping = STACKED_PARAMS_MAPPING

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        """What differs between the families' attention blocks. Llama: one flag for all biases."""
        return dict(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=False)

    def __init__(self, config: ModelConfig, attn_backend: str = "torch", embed_on_last_stage: bool = False):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend=attn_backend, embed_on_last_stage=embed_on_last_stage,
                                **self.attention_options(config))
        # Tied embeddings (SmolLM2, small Qwens): the output projection IS the input embedding matrix.
        if not self.model.pp.is_last_rank:
            self.lm_head = PPMissingLayer()
        elif config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be 1-D [num_tokens] (a flat ragged batch), got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input tokens but attn_metadata.slot_mapping has {attn_metadata.num_tokens}")
        if len(kv_caches) != len(self.model.local_layers):
            raise ValueError(f"expected one (key_cache, value_cache) per layer ({len(self.model.local_layers)}), "
                             f"got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (the sampler works in fp32 whatever the model dtype).
        Tensor parallel: each rank's [N, vocab / tp] slice, all-gathered. Pipeline parallel: only the
        last stage has the LM head; it is the only one that samples (pipeline_stages.py)."""
        if not self.model.pp.is_last_rank:
            raise RuntimeError("compute_logits on a pipeline stage before the last: only the last stage samples")
        local = self.lm_head.linear_method.apply(self.lm_head, hidden_states)          # [N, vocab / tp]
        return self.lm_head.gather_logits(local).float()                               # [N, vocab]
