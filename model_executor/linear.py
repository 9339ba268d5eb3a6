"""Linear layers over a flat batch of tokens, and the one seam through which a faster matmul enters.

Mirrors vLLM's `vllm/model_executor/layers/linear.py` (`LinearMethodBase`, `UnquantizedLinearMethod`,
`RowParallelLinear`, `MergedColumnParallelLinear`, `QKVParallelLinear`) and
`vocab_parallel_embedding.py: VocabParallelEmbedding`, on one device (no parallel split):

    Linear               y = x @ W^T (+ b)
    MergedColumnLinear   several linears reading the same input, stacked: one matmul (gate | up)
    QKVLinear            q | k | v as one matmul, shards of different sizes under GQA
    VocabEmbedding       token id -> row; a tied lm_head runs it as a linear through the same seam

The seam: a layer's forward is `self.linear_method.apply(self, x)`, `F.linear` here
(`UnquantizedLinearMethod`); chapter 07 swaps in CPU GEMMs on packed weights after loading
(mini_vllm/models/linear_method.py), and the model code does not change.

Parameters are created uninitialised (`torch.empty`) and without gradients: a loader overwrites every
one of them and fails loudly if one is missing (chapter 07's loader, chapter 04's
`EagleHead.from_pretrained`), so a random init would be wasted work (seconds for SmolLM2 on a CPU).
A model that runs on random weights or is trained (chapter 04's toy target and EAGLE head) calls
`reset_parameters()`: nn.Linear's / nn.Embedding's init; a trainer turns gradients on.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethodBase:
    """What a layer with a `weight` [out, in] (and a `bias` [out] or None) computes with."""

    def pack(self, weight: torch.Tensor):
        """The packed copy of `weight` this method reads (None: it reads `weight` itself)."""
        return None

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: give `layer` the parameters this method's checkpoint tensors load into
        (a quantized method replaces `weight`; model_executor/quantization_config.py)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After loading: repack the loaded tensors once for this method's kernel."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


UNQUANTIZED = UnquantizedLinearMethod()          # every layer's method until someone picks another


class Linear(nn.Module):
    """y = x @ W^T (+ b) through `linear_method`. `packed_weight`: W packed once for the method's
    GEMM (None: the method reads `weight` itself)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.linear_method: LinearMethodBase = UNQUANTIZED
        self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        return self.linear_method.apply(self, x)

    def reset_parameters(self) -> None:
        """nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in)) for W (kaiming_uniform_, a=sqrt(5)) and b."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.input_size) if self.input_size > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def drop_unpacked_weight(self) -> None:
        """Once packed, the row-major weight is dead memory: replace it by an empty tensor (vLLM:
        `dispatch_cpu_unquantized_gemm(remove_weight=True)`). Only the packed copy is read."""
        if self.packed_weight is None:
            raise ValueError("drop_unpacked_weight: this Linear has no packed weight to run on")
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)


class MergedColumnLinear(Linear):
    """Several linears that read the same input, stacked along the output dim: ONE matmul.

    Why: q/k/v (and gate/up) projections all read the same normed hidden state. One GEMM over
    the stacked weight reads the input once and launches one kernel instead of three — what
    matters in a GPU decode step, where each small GEMM is bound by launch overhead and by reading
    its weights (on a CPU at SmolLM2's sizes the gain is within noise). Checkpoints still store the
    pieces separately, so each piece is a *shard* with its own `weight_loader`
    (vLLM: `MergedColumnParallelLinear.weight_loader(param, loaded_weight, loaded_shard_id)`).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids: tuple = tuple(range(len(output_sizes)))
        for param in self.parameters():
            param.weight_loader = self.weight_loader     # the loader calls param.weight_loader(param, tensor, shard_id)
            param.shard_ids = self.shard_ids             # every shard must be loaded exactly once

    def shard_slice(self, shard_id) -> tuple[int, int]:
        """(first row, number of rows) of the shard in the stacked W (or b)."""
        index = self.shard_ids.index(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_slice(shard_id)
        target = param.data.narrow(0, offset, size)      # rows [offset, offset + size) of W (or b)
        if loaded_weight.shape != target.shape:
            raise ValueError(f"shard {shard_id!r}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(loaded_weight)


class QKVLinear(MergedColumnLinear):
    """q, k and v projections as one matmul: output = [q (H*D) | k (KVH*D) | v (KVH*D)].

    With GQA the three shards have different sizes (vLLM: `QKVParallelLinear`, shard ids "q"/"k"/"v").
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)
        self.shard_ids = ("q", "k", "v")
        for param in self.parameters():
            param.shard_ids = self.shard_ids


class VocabEmbedding(nn.Module):
    """token id -> row of the embedding matrix (vLLM: VocabParallelEmbedding, one device).

    A tied lm_head (SmolLM2, small Qwens) is this matrix: chapter 07's `compute_logits` runs it as
    a linear through the same seam as a Linear (`linear_method`, `packed_weight`; bias None)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.bias = None
        self.linear_method: LinearMethodBase = UNQUANTIZED
        self.packed_weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)

    def reset_parameters(self) -> None:
        """nn.Embedding's init: N(0, 1)."""
        nn.init.normal_(self.weight)
