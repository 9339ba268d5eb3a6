"""Copy-on-write sharing [Kwon 2025, §3.4.4]: fork, append with copy-on-write, free by ref counts.
Exact block ids, then the same trace executed on real tensors."""
import pytest
import torch

from kvcache import BlockSpaceManager, SimpleRequest
from kvcache.cache_engine import CacheEngine, KVCacheSpec


def prefilled(m, rid, tokens):
    r = SimpleRequest(rid, tokens)
    m.allocate_slots(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    m.cache_blocks(r, r.num_computed_tokens)
    return r


def fork(m, parent, rid):
    child = SimpleRequest(rid, list(parent.all_token_ids[:parent.num_computed_tokens]),
                          num_computed_tokens=parent.num_computed_tokens)
    m.fork(parent, child)
    return child


def refs(m, ids):
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def test_parallel_sampling_copies_only_the_shared_partial_block():
    """[Kwon 2025, Fig. 3.8]: two samples share the prompt; the first to write its last block
    copies it, the second then owns the original and writes in place."""
    m = BlockSpaceManager(8, 4)
    a1 = prefilled(m, "A1", list(range(7)))            # blocks [0, 1]; block 1 holds 3 of 4 tokens
    a2 = fork(m, a1, "A2")
    assert m.get_block_ids("A2") == [0, 1] and refs(m, [0, 1]) == [2, 2]
    a1.append_output_token_ids(50)
    new, copies = m.append_slots(a1, 1)
    assert (new.get_block_ids(), copies) == ([], [(1, 2)])
    assert m.get_block_ids("A1") == [0, 2] and refs(m, [0, 1, 2]) == [2, 1, 1]
    a2.append_output_token_ids(60)
    new, copies = m.append_slots(a2, 1)
    assert (new.get_block_ids(), copies) == ([], [])   # ref 1 now: A2 writes block 1 in place
    assert m.get_block_ids("A2") == [0, 1]
    m.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    m = BlockSpaceManager(8, 4)
    p = prefilled(m, "p", list(range(8)))
    c = fork(m, p, "c")
    c.append_output_token_ids(9)
    new, copies = m.append_slots(c, 1)
    assert (new.get_block_ids(), copies) == ([2], [])
    assert m.get_block_ids("c") == [0, 1, 2] and refs(m, [0, 1, 2]) == [2, 2, 1]


def test_beam_search_sharing_and_freeing_by_ref_count():
    """[Kwon 2025, Fig. 3.9] in miniature: beams fork, diverge, and dropped beams free exactly
    the blocks no surviving beam references."""
    m = BlockSpaceManager(12, 4)
    root = prefilled(m, "b0", list(range(8)))          # [0, 1]
    beams = [fork(m, root, f"b{i}") for i in (1, 2, 3)]
    assert refs(m, [0, 1]) == [4, 4]
    for i, b in enumerate([root] + beams):             # each beam decodes 4 tokens into its own block
        for t in range(4):
            b.append_output_token_ids(100 * i + t)
            new, copies = m.append_slots(b, 1)
            assert copies == []
            b.num_computed_tokens += 1
            m.cache_blocks(b, b.num_computed_tokens)
    assert [m.get_block_ids(f"b{i}") for i in range(4)] == [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]]
    survivor = beams[0]
    grand = [fork(m, survivor, f"g{i}") for i in range(2)]
    for b in [root] + beams[1:]:                       # the other beams fall out of the top-k
        m.free(b)
    assert refs(m, [0, 1, 3]) == [3, 3, 3] and refs(m, [2, 4, 5]) == [0, 0, 0]
    for g in grand:
        m.free(g)
    m.free(survivor)
    assert m.num_free_blocks == 12
    m.check_invariants()


def test_allocate_slots_refuses_to_write_a_shared_block():
    m = BlockSpaceManager(8, 4)
    a = prefilled(m, "a", list(range(7)))
    fork(m, a, "b")
    a.append_output_token_ids(1)
    with pytest.raises(ValueError, match="would write into block 1, shared by 2 block tables: use append_slots"):
        m.allocate_slots(a, 1)


def test_append_slots_returns_none_when_the_copy_does_not_fit():
    m = BlockSpaceManager(2, 4)
    a = prefilled(m, "a", list(range(7)))              # both blocks
    b = fork(m, a, "b")
    b.append_output_token_ids(1)
    before = (m.get_block_ids("a"), m.get_block_ids("b"), refs(m, [0, 1]))
    assert m.append_slots(b, 1) is None
    assert (m.get_block_ids("a"), m.get_block_ids("b"), refs(m, [0, 1])) == before
    m.check_invariants()


def test_fork_errors():
    m = BlockSpaceManager(8, 4)
    a = prefilled(m, "a", list(range(7)))
    with pytest.raises(ValueError, match="must start where parent"):
        m.fork(a, SimpleRequest("x", list(range(7))))
    with pytest.raises(ValueError, match="must start where parent"):
        m.fork(a, SimpleRequest("x", [9] * 7, num_computed_tokens=7))
    with pytest.raises(ValueError, match="parent 'zz' holds no device blocks"):
        m.fork(SimpleRequest("zz", [1]), SimpleRequest("y", [1]))
    fork(m, a, "b")
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork(a, SimpleRequest("b", list(range(7)), num_computed_tokens=7))
    with pytest.raises(ValueError, match="holds no device blocks"):
        m.append_slots(SimpleRequest("q", [1]), 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_on_write_keeps_every_sample_s_kv(backend):
    """Run the [Kwon 2025, Fig. 3.8] trace on real caches: write each token's K/V where the block table
    says, copy what append_slots says, and check both samples read back their own history."""
    B = 4
    spec = KVCacheSpec(num_layers=2, block_size=B, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    eng = CacheEngine(spec, num_gpu_blocks=6, backend=backend)
    m = BlockSpaceManager(6, B)

    def write(r, pos, value):                       # the token at `pos` gets K = V = value
        block = m.get_block_ids(r.request_id)[pos // B]
        for c in eng.key_caches + eng.value_caches:
            c[block, pos % B] = value

    def history(r):                                 # what attention would read for r
        ids = m.get_block_ids(r.request_id)
        return [eng.key_caches[1][ids[p // B], p % B, 0, 0].item() for p in range(r.num_computed_tokens)]

    a1 = prefilled(m, "A1", [1, 2, 3, 4, 5, 6])
    for p, t in enumerate(a1.all_token_ids):
        write(a1, p, t)
    a2 = fork(m, a1, "A2")
    for r, tok in ((a1, 71), (a2, 81), (a1, 72), (a2, 82), (a1, 73), (a2, 83)):
        r.append_output_token_ids(tok)
        new, copies = m.append_slots(r, 1)
        eng.copy(copies)                            # before this step's K/V writes
        write(r, r.num_computed_tokens, tok)
        r.num_computed_tokens += 1
    assert history(a1) == [1, 2, 3, 4, 5, 6, 71, 72, 73]
    assert history(a2) == [1, 2, 3, 4, 5, 6, 81, 82, 83]
    m.check_invariants()
