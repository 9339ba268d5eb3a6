"""Megatron-style tensor parallelism: each linear split over the TP ranks, one all-reduce per pair.

Mirrors vLLM's `vllm/model_executor/layers/linear.py` (`ColumnParallelLinear`, `RowParallelLinear`,
`MergedColumnParallelLinear`, `QKVParallelLinear`) and `vocab_parallel_embedding.py`
(`VocabParallelEmbedding`, `ParallelLMHead`). Each class is the single-device layer
(linear.py) whose parameters hold only this rank's shard; its `weight_loader` cuts that shard out of
the full checkpoint tensor. With one rank (`parallel_state`'s default) every shard is the whole
tensor and the classes behave exactly like their parents.

Why column, then row (Megatron-LM): in an MLP, x @ [W1 | W1'] splits W1 by COLUMNS (output
features) — each rank computes its own slice of the hidden activation from the full input, no
communication; then the next matmul splits W2 by ROWS (input features) — each rank multiplies its
slice and holds a partial sum of the full output, so ONE all-reduce finishes the pair. Attention
is the same pair: q/k/v split by heads (column), o_proj by rows. Per layer: two all-reduces of
[T, hidden].

    ColumnParallelLinear   W [out / tp, in]              y_r = x W_r^T       [T, out / tp], no communication
    RowParallelLinear      W [out, in / tp]              y = sum_r x_r W_r^T  [T, out], all-reduce
    MergedColumnParallel   gate | up, each split by tp:  [T, 2 I / tp]  (rank r: gate_r | up_r)
    QKVParallelLinear      q | k | v by heads:           [T, (H + 2 KVH) D / tp]; KV heads replicated
                           when tp > KVH (each KV head then serves tp / KVH ranks)
    VocabParallelEmbedding rows [V / tp, hidden]:        ids outside the rank's range -> 0 rows; all-reduce
    ParallelLMHead         the same rows as a linear:    [T, V / tp] per rank, all-gathered into [T, V]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.linear import Linear, MergedColumnLinear, QKVLinear, VocabEmbedding
from model_executor.parallel_state import get_tp_group


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _check_full(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """The WHOLE checkpoint tensor must have the unsplit shape before a rank cuts its shard out of it:
    narrowing a tensor of the wrong size would silently load the wrong numbers."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def _copy(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    _check_full(loaded, tuple(target.shape), what)
    target.copy_(loaded)


class ColumnParallelLinear(Linear):
    """y = x W^T with W split by output features: rank r holds rows [r n, (r + 1) n) of W (n = out / tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_group()
        self.tp_group, self.tp_rank, self.tp_size = tp, tp.rank_in_group, tp.world_size
        super().__init__(input_size, _divide(output_size, self.tp_size, "output size"), bias)
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        n = param.shape[0]                                                   # rows of this rank
        _check_full(loaded_weight, (n * self.tp_size, *param.shape[1:]), "column-parallel weight")
        _copy(param.data, loaded_weight.narrow(0, self.tp_rank * n, n), "column-parallel weight")


class RowParallelLinear(Linear):
    """y = x W^T with W split by input features: rank r holds columns [r n, (r + 1) n) of W and reads
    x's slice [T, n] (a column-parallel layer's output); the partial products are all-reduced.

    The bias must be added once, not tp times: vLLM passes it to rank 0's matmul only; here rank 0
    loads it and the other ranks hold zeros, so the linear-method seam (packed CPU GEMMs included)
    stays one call `apply(layer, x)` and the all-reduce adds the bias exactly once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        tp = get_tp_group()
        self.tp_group, self.tp_rank, self.tp_size = tp, tp.rank_in_group, tp.world_size
        super().__init__(_divide(input_size, self.tp_size, "input size"), output_size, bias)
        self.reduce_results = reduce_results
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        n = param.shape[1]                                                   # input columns of this rank
        _check_full(loaded_weight, (param.shape[0], n * self.tp_size), "row-parallel weight")
        _copy(param.data, loaded_weight.narrow(1, self.tp_rank * n, n), "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _copy(param.data, loaded_weight if self.tp_rank == 0 else torch.zeros_like(loaded_weight), "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # [T, in / tp] -> [T, out]
        out = self.linear_method.apply(self, x)                # this rank's partial sum
        return self.tp_group.all_reduce(out) if self.reduce_results else out


class MergedColumnParallelLinear(MergedColumnLinear):
    """gate | up (each [I, hidden]) split by tp: rank r holds gate_r | up_r, so its [T, 2 I / tp]
    output is exactly what SiluAndMul needs for its slice of the intermediate features. (Cutting the
    stacked [2I, hidden] matrix in two would give rank 0 all of gate and rank 1 all of up: wrong.)"""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = get_tp_group()
        self.tp_group, self.tp_rank, self.tp_size = tp, tp.rank_in_group, tp.world_size
        super().__init__(input_size, [_divide(s, self.tp_size, "merged output size") for s in output_sizes], bias)

    def shard_offset_in_checkpoint(self, shard_id) -> int:
        """Where this rank's rows start inside the checkpoint's piece `shard_id`."""
        _, size = self.shard_slice(shard_id)
        return self.tp_rank * size

    def checkpoint_rows(self, shard_id) -> int:
        """Rows of the unsplit checkpoint piece `shard_id`."""
        return self.shard_slice(shard_id)[1] * self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_slice(shard_id)
        target = param.data.narrow(0, offset, size)
        _check_full(loaded_weight, (self.checkpoint_rows(shard_id), *target.shape[1:]), f"shard {shard_id!r}")
        _copy(target, loaded_weight.narrow(0, self.shard_offset_in_checkpoint(shard_id), size), f"shard {shard_id!r}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q | k | v split by heads: rank r gets query heads [r H/tp, (r + 1) H/tp) and the KV heads they
    read. GQA with tp > KVH: there are not enough KV heads to split, so each is REPLICATED on
    tp / KVH ranks (vLLM: num_kv_head_replicas) — rank r holds KV head r // (tp / KVH), which is exactly
    the one its query heads are grouped with. tp must divide H, and KVH and tp must divide one another."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp = get_tp_group()
        tp_size = tp.world_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "tensor_parallel_size must be a multiple of num_key_value_heads: tp")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.head_dim = head_dim
        # MergedColumnParallelLinear divides its output sizes by tp; give it the sizes times tp.
        local = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden_size, [s * tp_size for s in local], bias)
        self.shard_ids = ("q", "k", "v")
        for param in self.parameters():
            param.shard_ids = self.shard_ids

    def shard_offset_in_checkpoint(self, shard_id) -> int:
        _, size = self.shard_slice(shard_id)
        if shard_id == "q":
            return self.tp_rank * size
        return (self.tp_rank // self.num_kv_head_replicas) * size          # the KV head this rank's queries read

    def checkpoint_rows(self, shard_id) -> int:
        return (self.total_num_heads if shard_id == "q" else self.total_num_kv_heads) * self.head_dim


class VocabParallelEmbedding(VocabEmbedding):
    """Embedding rows split by vocabulary: rank r holds ids [r n, (r + 1) n), n = padded vocab / tp.

    A rank looks up the ids it owns and writes zeros for the others; the all-reduce then gives every
    rank the full [T, hidden] (exactly one rank contributed each row). The vocabulary is padded up to
    a multiple of tp (vLLM pads to 64 x tp, for kernel-friendly shapes); the padding rows are zeros
    and their logits are cut off after the gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = get_tp_group()
        self.tp_group, self.tp_rank, self.tp_size = tp, tp.rank_in_group, tp.world_size
        self.org_vocab_size = num_embeddings
        padded = -(-num_embeddings // self.tp_size) * self.tp_size
        per_rank = padded // self.tp_size
        super().__init__(per_rank, embedding_dim)
        self.vocab_start_index = self.tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _load_vocab_rows(self, param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)   # [T]
        local = torch.where(mine, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)   # [T, hidden], 0 if not mine
        return self.tp_group.all_reduce(out)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return _gather_logits(self, local_logits)


class ParallelLMHead(ColumnParallelLinear):
    """The output projection of an untied model: W [vocab, hidden] split by rows like the embedding
    (ids [r n, (r + 1) n) on rank r, padded) — which is a column-parallel linear: each rank computes
    its slice of the logits, [T, V / tp], and `gather_logits` concatenates them. vLLM derives it from
    VocabParallelEmbedding; here it is a Linear so that the CPU GEMMs pack it (and drop the unpacked
    copy) like every other linear. A tied model uses its VocabParallelEmbedding instead."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = get_tp_group()
        padded = -(-num_embeddings // tp.world_size) * tp.world_size
        super().__init__(embedding_dim, padded, bias=False)
        self.org_vocab_size = num_embeddings
        self.vocab_start_index = self.tp_rank * self.output_size
        self.vocab_end_index = self.vocab_start_index + self.output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _load_vocab_rows(self, param, loaded_weight)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return _gather_logits(self, local_logits)


def _load_vocab_rows(layer, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """This rank's rows [start, end) of a [vocab, hidden] checkpoint matrix; padding rows are zero."""
    _check_full(loaded_weight, (layer.org_vocab_size, param.shape[1]), "vocab-parallel weight")
    start, end = layer.vocab_start_index, min(layer.vocab_end_index, layer.org_vocab_size)
    param.data.zero_()
    _copy(param.data[:max(end - start, 0)], loaded_weight[start:end], "vocab-parallel weight")


def _gather_logits(layer, local_logits: torch.Tensor) -> torch.Tensor:
    """[N, V / tp] on each rank -> [N, vocab_size] on every rank (vLLM: LogitsProcessor._gather_logits;
    vLLM gathers to rank 0 only — here every rank samples, so every rank's persistent batch gets the token)."""
    if layer.tp_size == 1:
        return local_logits
    return layer.tp_group.all_gather(local_logits, dim=-1)[..., :layer.org_vocab_size]
