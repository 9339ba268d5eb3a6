"""Tensor-parallel layers, one process: build rank r of a tp-way split, load the full checkpoint
tensor through its weight_loader, and check that the ranks' pieces put back together (concatenated
for column-parallel, summed for row-parallel) are exactly the single-device layer's output.

No process group: `set_groups_for_testing` makes the layers believe they are rank r of n, and the
group's all-reduce is replaced by the identity so a rank's partial result can be inspected (the
sum over ranks is what the real all-reduce computes; tests/07_mini_vllm/test_parallel_engine.py runs
the real collectives across processes)."""
import pytest
import torch

from model_executor.linear import Linear, MergedColumnLinear, QKVLinear, VocabEmbedding
from model_executor.parallel_linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)
from model_executor.parallel_state import GroupCoordinator, get_tp_group, set_groups_for_testing


class NoCommGroup(GroupCoordinator):
    """Rank r of n, with collectives that return this rank's own part (the test sums the parts)."""

    def all_reduce(self, x):
        return x


@pytest.fixture
def as_rank():
    def make(rank: int, world: int):
        set_groups_for_testing(tp=NoCommGroup(list(range(world)), rank))
    yield make
    set_groups_for_testing()


def test_single_rank_by_default():
    tp = get_tp_group()
    assert (tp.world_size, tp.rank_in_group) == (1, 0)
    assert tp.all_reduce(x := torch.ones(3)) is x                        # the identity: no torch.distributed


@pytest.mark.parametrize("world", [2, 4])
def test_column_then_row_parallel_equals_the_full_mlp(as_rank, world):
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    w1, b1, w2, b2 = torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    full = torch.relu(x @ w1.T + b1) @ w2.T + b2                          # [5, 16]
    total = torch.zeros(5, 16)
    for rank in range(world):
        as_rank(rank, world)
        col, row = ColumnParallelLinear(16, 32, bias=True), RowParallelLinear(32, 16, bias=True)
        assert col.weight.shape == (32 // world, 16) and row.weight.shape == (16, 32 // world)
        col.weight.weight_loader(col.weight, w1)
        col.bias.weight_loader(col.bias, b1)
        row.weight.weight_loader(row.weight, w2)
        row.bias.weight_loader(row.bias, b2)
        total += row(torch.relu(col(x)))                                  # this rank's partial sum
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)        # the bias counted once


@pytest.mark.parametrize("world", [2, 4])
def test_merged_gate_up_shards_keep_gate_and_up_paired(as_rank, world):
    torch.manual_seed(1)
    gate, up, x = torch.randn(8, 6), torch.randn(8, 6), torch.randn(3, 6)
    single = MergedColumnLinear(6, [8, 8])
    single.weight.weight_loader(single.weight, gate, 0)
    single.weight.weight_loader(single.weight, up, 1)
    g_full, u_full = single(x).chunk(2, dim=-1)                           # [3, 8] each
    gs, us = [], []
    for rank in range(world):
        as_rank(rank, world)
        layer = MergedColumnParallelLinear(6, [8, 8])
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)                                  # rank r: gate_r | up_r
        gs.append(g)
        us.append(u)
    # Same dot products; a BLAS may block a smaller matmul differently, so fp32 rounding, not bit equality.
    torch.testing.assert_close(torch.cat(gs, -1), g_full)
    torch.testing.assert_close(torch.cat(us, -1), u_full)


@pytest.mark.parametrize("heads,kv_heads,world,replicas", [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (9, 3, 3, 1)])
def test_qkv_split_by_heads_with_kv_replication(as_rank, heads, kv_heads, world, replicas):
    torch.manual_seed(2)
    D, hidden = 4, 12
    wq, wk, wv = torch.randn(heads * D, hidden), torch.randn(kv_heads * D, hidden), torch.randn(kv_heads * D, hidden)
    x = torch.randn(3, hidden)
    q_full = (x @ wq.T).view(3, heads, D)
    k_full, v_full = (x @ wk.T).view(3, kv_heads, D), (x @ wv.T).view(3, kv_heads, D)
    for rank in range(world):
        as_rank(rank, world)
        layer = QKVParallelLinear(hidden, D, heads, kv_heads)
        assert layer.num_kv_head_replicas == replicas
        for shard, w in zip("qkv", (wq, wk, wv)):
            layer.weight.weight_loader(layer.weight, w, shard)
        q, k, v = layer(x).split([layer.num_heads * D, layer.num_kv_heads * D, layer.num_kv_heads * D], dim=-1)
        hq = heads // world
        torch.testing.assert_close(q.view(3, hq, D), q_full[:, rank * hq:(rank + 1) * hq])
        # The KV head(s) this rank's query heads are grouped with (GQA: head h reads kv head h // (H / KVH)).
        first_kv = rank * hq // (heads // kv_heads)
        torch.testing.assert_close(k.view(3, -1, D), k_full[:, first_kv:first_kv + layer.num_kv_heads])
        torch.testing.assert_close(v.view(3, -1, D), v_full[:, first_kv:first_kv + layer.num_kv_heads])
    set_groups_for_testing()
    one, plain = QKVParallelLinear(hidden, D, heads, kv_heads), QKVLinear(hidden, D, heads, kv_heads)
    assert (one.weight.shape, one.output_sizes, one.shard_ids) == (plain.weight.shape, plain.output_sizes, plain.shard_ids)


def test_indivisible_splits_are_refused(as_rank):
    as_rank(0, 2)
    with pytest.raises(ValueError, match="num_attention_heads \\(9\\) is not divisible by tensor_parallel_size \\(2\\)"):
        QKVParallelLinear(16, 4, 9, 3)
    as_rank(0, 4)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        QKVParallelLinear(16, 4, 12, 3)


@pytest.mark.parametrize("vocab,world", [(10, 2), (11, 3)])                 # 11 % 3: the last rank's rows are padding
def test_vocab_parallel_embedding_and_gathered_logits(as_rank, vocab, world):
    torch.manual_seed(3)
    table, ids, h = torch.randn(vocab, 6), torch.tensor([0, 3, vocab - 1, 5, 3]), torch.randn(4, 6)
    full = VocabEmbedding(vocab, 6)
    full.weight.data.copy_(table)
    total, local_logits = torch.zeros(5, 6), []
    for rank in range(world):
        as_rank(rank, world)
        emb = VocabParallelEmbedding(vocab, 6)
        emb.weight.weight_loader(emb.weight, table)
        total += emb(ids)                                                 # zeros for ids another rank owns
        local_logits.append(emb.linear_method.apply(emb, h))               # [4, padded vocab / world]
    assert torch.equal(total, full(ids))
    logits = torch.cat(local_logits, -1)[:, :vocab]                        # what gather_logits computes
    torch.testing.assert_close(logits, h @ table.T)


def test_one_rank_layers_are_the_single_device_layers():
    """With no group set up the parallel classes are the plain ones (chapter 04 and every
    single-process engine build them): same shapes, same outputs."""
    torch.manual_seed(4)
    w, x = torch.randn(6, 8), torch.randn(2, 8)
    plain, row = Linear(8, 6), RowParallelLinear(8, 6)
    plain.weight.data.copy_(w)
    row.weight.weight_loader(row.weight, w)
    assert torch.equal(row(x), plain(x))                                  # the same matmul: bit for bit


def test_a_wrong_sized_checkpoint_tensor_is_refused_before_it_is_cut(as_rank):
    """A rank narrows the checkpoint tensor to its shard: the full tensor's shape is checked first,
    or a too-big tensor would load silently."""
    as_rank(1, 2)
    col, row, qkv = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8), QKVParallelLinear(8, 2, 4, 2)
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \(18, 8\), expected \(16, 8\)"):
        col.weight.weight_loader(col.weight, torch.zeros(18, 8))
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \(8, 18\), expected \(8, 16\)"):
        row.weight.weight_loader(row.weight, torch.zeros(8, 18))
    with pytest.raises(ValueError, match=r"shard 'k': checkpoint tensor has shape \(6, 8\), expected \(4, 8\)"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(6, 8), "k")
