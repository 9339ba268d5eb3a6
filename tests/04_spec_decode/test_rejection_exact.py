"""Exact tests of rejection sampling: every backend == the per-request loop, token for token,
given the same random numbers; hand-worked cases; the sampler module; bad input."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from spec_decode import RejectionSampler, SpecDecodeMetadata, SpecSamplingMetadata
from spec_decode.ops import rejection_sample
from spec_decode.reference import PLACEHOLDER_TOKEN_ID
from spec_decode.synthetic import make_rejection_case


def run(case, backend):
    return rejection_sample(*case.args(), backend=backend)


@settings(max_examples=60, deadline=None)
@given(num_draft=st.lists(st.integers(0, 6), min_size=1, max_size=6), vocab=st.integers(1, 300),
       greedy_bits=st.integers(0, 63), mode=st.sampled_from(["random", "greedy", "mixed"]), ngram=st.booleans(),
       seed=st.integers(0, 10_000), extra=st.integers(0, 2))
def test_torch_equals_reference(num_draft, vocab, greedy_bits, mode, ngram, seed, extra):
    greedy = None if mode == "random" else (
        [True] * len(num_draft) if mode == "greedy" else [bool(greedy_bits >> i & 1) for i in range(len(num_draft))])
    case = make_rejection_case(num_draft, vocab, greedy=greedy, ngram=ngram, seed=seed, extra_spec_len=extra)
    if greedy is not None and all(greedy):
        case.target_probs = None                         # an all-greedy batch needs no probabilities
    assert torch.equal(run(case, "torch"), run(case, "reference"))


@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("greedy", [None, [True, False, False, True, False, True, False]])
def test_triton_equals_reference(ngram, greedy):
    # vocab 300 with BLOCK_V 64: several vocab tiles and a partial last one.
    case = make_rejection_case([3, 0, 5, 1, 2, 4, 6], 300, greedy=greedy, ngram=ngram, seed=11, extra_spec_len=1)
    from spec_decode import triton_ops
    out = triton_ops.rejection_sample(*case.args(), block_v=64)
    assert torch.equal(out, run(case, "reference"))


def test_triton_all_greedy_and_small_vocab():
    case = make_rejection_case([2, 4, 0], 5, greedy=[True, True, True], seed=4)
    case.target_probs = None
    assert torch.equal(run(case, "triton"), run(case, "reference"))


def test_edge_rows_of_the_synthetic_case_are_hit():
    """The synthetic case really contains the corners: a rejection with an all-zero residual
    (fallback to p), masked target entries, and both accepted and rejected drafts."""
    case = make_rejection_case([6, 6], 50, seed=0)
    p, q, d = case.target_probs, case.draft_probs, case.draft_token_ids
    assert q[3, d[3]] == 0 and torch.equal(p[3], q[3])            # q(d) = 0 and p == q: rejected, residual empty
    assert (p == 0).any()
    out = run(case, "reference")
    assert (out >= 0).sum() >= 3


def test_hand_worked_examples():
    V = 4
    inv_exp = torch.ones(1, V)                                    # race = plain argmax of the residual
    def one(drafts, q, p, u, bonus=3, greedy=None, argmax=None):
        out = rejection_sample(torch.tensor(drafts, dtype=torch.long), torch.tensor([len(drafts)], dtype=torch.int32),
                               None if q is None else torch.tensor(q), torch.tensor(p).reshape(-1, V),
                               None if argmax is None else torch.tensor(argmax), torch.tensor([bonus]),
                               None if greedy is None else torch.tensor([greedy]), torch.tensor(u, dtype=torch.float32), inv_exp,
                               len(drafts), backend="reference")
        return RejectionSampler.parse_output(out, V)[0]
    p = [[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    q = [[0.1, 0.3, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25]]
    # d1 = 1: p/q = 2 >= 1 -> always accepted; d2 = 0: p == q -> accepted; then the bonus.
    assert one([1, 0], q, p, [0.99, 0.99]) == [1, 0, 3]
    # d1 = 2: p/q = 0.4; u = 0.5 rejects; residual max(0, p - q) = [0, .3, 0, 0] -> 1.
    assert one([2, 0], q, p, [0.5, 0.0]) == [1]
    assert one([2, 0], q, p, [0.3, 0.0]) == [2, 0, 3]              # u = 0.3 < 0.4 accepts
    # n-gram (q one-hot): accept with prob p(d) = 0.2; rejected -> residual p without d -> argmax = 1.
    assert one([2], None, p[:1], [0.19]) == [2, 3]
    assert one([2], None, p[:1], [0.21]) == [1]
    # A draft the target gives 0 is never accepted, even with u = 0 exactly.
    assert one([3], None, [[0.5, 0.5, 0.0, 0.0]], [0.0]) == [0]
    # Greedy: accept iff the draft is the argmax; the recovered token IS the argmax.
    assert one([1, 2], None, p, [0.0, 0.0], greedy=True, argmax=[1, 0]) == [1, 0]
    assert one([1, 0], None, p, [0.9, 0.9], greedy=True, argmax=[1, 0]) == [1, 0, 3]
    # No drafts: the bonus token alone (a plain decode step).
    assert one([], None, [], []) == [3]


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_empty_batch_and_zero_drafts(backend):
    case = make_rejection_case([0, 0], 7, seed=1)
    out = run(case, backend)
    assert out.shape == (2, 1) and torch.equal(out[:, 0], case.bonus_token_ids.int())
    case = make_rejection_case([], 7, seed=1)
    assert run(case, backend).shape == (0, 1)


def test_all_accepted_emits_k_plus_one_tokens():
    """Every draft accepted -> k drafts + the bonus. (Dropping the bonus would keep the
    distribution right, see test_distribution.py, but lose a token per step.)"""
    case = make_rejection_case([4, 2], 9, seed=2)
    case.draft_probs = torch.softmax(torch.randn(6, 9), -1)
    case.target_probs = case.draft_probs.clone()               # p == q > 0: every draft accepted
    for backend in ("reference", "torch", "triton"):
        out = RejectionSampler.parse_output(run(case, backend), 9)
        assert out == [case.draft_token_ids[:4].tolist() + [int(case.bonus_token_ids[0])],
                       case.draft_token_ids[4:].tolist() + [int(case.bonus_token_ids[1])]]


def test_greedy_uses_raw_logits_not_rounded_probabilities():
    """logits [0, 1e-8]: softmax rounds both to the same fp32 probability and its argmax
    would be token 0; greedy decoding (and so greedy verification) must pick token 1."""
    logits = torch.tensor([[0.0, 1e-8, -5.0]])
    assert logits.softmax(-1)[0, 0] == logits.softmax(-1)[0, 1]
    md = SpecDecodeMetadata.from_draft_token_ids([[1]])
    sm = SpecSamplingMetadata.from_lists([0.0])
    out = RejectionSampler()(md, None, logits, torch.tensor([2]), sm)
    assert RejectionSampler.parse_output(out, 3) == [[1, 2]]


def test_seeded_request_is_independent_of_its_batch():
    """A seeded request's tokens depend on its seed only, not on who else is in the batch."""
    V = 40
    torch.manual_seed(0)
    logits = torch.randn(7, V)
    drafts = [[3, 5, 7], [1, 2, 3, 4]]
    def sample(batch_drafts, batch_logits, seeded_row):
        md = SpecDecodeMetadata.from_draft_token_ids(batch_drafts)
        gens = {seeded_row: torch.Generator().manual_seed(1234)}
        sm = SpecSamplingMetadata.from_lists([0.8] * len(batch_drafts), generators=gens)
        out = RejectionSampler(generator=torch.Generator().manual_seed(len(batch_drafts)))(
            md, None, batch_logits, torch.zeros(len(batch_drafts), dtype=torch.long), sm)
        return RejectionSampler.parse_output(out, V)[seeded_row]
    alone = sample(drafts[:1], logits[:3], 0)
    with_other = sample(drafts[::-1], torch.cat((logits[3:], logits[:3])), 1)
    assert alone == with_other


def test_sampler_module_matches_the_ops_on_every_backend():
    V = 30
    torch.manual_seed(1)
    drafts = [[1, 2, 3], [], [4, 5], [6]]
    md = SpecDecodeMetadata.from_draft_token_ids(drafts)
    logits = torch.randn(6, V) * 3
    q = torch.softmax(torch.randn(6, V), -1)
    sm = SpecSamplingMetadata.from_lists([0.0, 0.7, 1.3, 0.5], top_k=[-1, 5, -1, 3], top_p=[1.0, 0.9, 0.8, 1.0])
    outs = [RejectionSampler(b, generator=torch.Generator().manual_seed(9))(md, q, logits, torch.arange(4), sm)
            for b in ("reference", "torch", "triton")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # The greedy request (row 0) accepts exactly the drafts matching the raw argmax.
    amax = logits[:3].argmax(-1).tolist()
    n = next((j for j in range(3) if drafts[0][j] != amax[j]), 3)
    assert RejectionSampler.parse_output(outs[0], V)[0] == drafts[0][:n] + ([amax[n]] if n < 3 else [0])


class TestBadInput:
    def case(self):
        return make_rejection_case([2, 3], 10, seed=0)

    def call(self, case, **overrides):
        args = dict(zip(["draft_token_ids", "cu_num_draft_tokens", "draft_probs", "target_probs", "target_argmax",
                         "bonus_token_ids", "is_greedy", "uniform_probs", "inv_exponential", "max_spec_len"],
                        case.args()))
        args.update(overrides)
        return rejection_sample(**args)

    def test_draft_ids_out_of_vocab(self):
        case = self.case()
        for bad in (10, -1):
            d = case.draft_token_ids.clone()
            d[1] = bad
            with pytest.raises(ValueError, match="draft_token_ids out of range"):
                self.call(case, draft_token_ids=d)

    def test_shapes_and_dtypes(self):
        case = self.case()
        with pytest.raises(ValueError, match="draft_probs must have shape"):
            self.call(case, draft_probs=case.draft_probs[:, :9])      # a drafter with another vocabulary
        with pytest.raises(TypeError, match="float32"):
            self.call(case, target_probs=case.target_probs.double())
        with pytest.raises(ValueError, match="max_spec_len"):
            self.call(case, max_spec_len=2)
        with pytest.raises(ValueError, match="non-decreasing"):
            self.call(case, cu_num_draft_tokens=torch.tensor([3, 2], dtype=torch.int32))
        with pytest.raises(ValueError, match="target_argmax"):
            self.call(case, is_greedy=torch.tensor([True, False]))
        with pytest.raises(ValueError, match="target_probs is needed"):
            self.call(case, target_probs=None)
        with pytest.raises(FloatingPointError):
            p = case.target_probs.clone()
            p[0, 0] = float("nan")
            self.call(case, target_probs=p)
        with pytest.raises(ValueError, match="unknown backend"):
            rejection_sample(*case.args(), backend="tpu")

    def test_cuda_backend_without_gpu(self):
        if torch.cuda.is_available():
            pytest.skip("has a GPU")
        with pytest.raises(RuntimeError, match="needs CUDA"):
            rejection_sample(*self.case().args(), backend="cuda")

    def test_metadata_errors(self):
        with pytest.raises(ValueError, match="target_logits must be"):
            RejectionSampler()(SpecDecodeMetadata.from_draft_token_ids([[1, 2]]), None, torch.zeros(3, 5),
                               torch.tensor([0]), SpecSamplingMetadata.from_lists([1.0]))
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            SpecSamplingMetadata.from_lists([-1.0])
