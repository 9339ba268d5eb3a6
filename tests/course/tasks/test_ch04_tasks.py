"""Chapter 04 tasks graded on their own: the batched rejection samplers (torch, Triton)
checked against a small oracle written here from the rule itself, not against the chapter's
reference (another task)."""
import pytest
import torch

from spec_decode.ops import rejection_sample
from spec_decode.synthetic import make_rejection_case


def oracle(case):
    """accept draft d at row j iff q(d) > 0 and u_j q(d) < p(d) (greedy: d == argmax); the first
    rejection emits argmax max(0, p - q) / E (q one-hot at d without draft probs), or
    argmax p / E when that residual is all zero; all accepted: the bonus token."""
    cu = [0] + case.cu_num_draft_tokens.tolist()
    out = torch.full((len(cu) - 1, case.max_spec_len + 1), -1, dtype=torch.long)
    for r in range(len(cu) - 1):
        tokens = []
        for j in range(cu[r], cu[r + 1]):
            d = int(case.draft_token_ids[j])
            greedy = case.is_greedy is not None and bool(case.is_greedy[r])
            if greedy:
                best = int(case.target_argmax[j])
                if d != best:
                    tokens.append(best)
                    break
            else:
                p = case.target_probs[j]
                q = case.draft_probs[j] if case.draft_probs is not None else torch.zeros_like(p).index_fill(0, torch.tensor([d]), 1.0)
                if not (bool(q[d] > 0) and bool(case.uniform_probs[j] * q[d] < p[d])):
                    score = torch.clamp(p - q, min=0.0) * case.inv_exponential[r]
                    if case.draft_probs is None:
                        score = p.clone().index_fill(0, torch.tensor([d]), 0.0) * case.inv_exponential[r]
                    if not bool(score.max() > 0):
                        score = p * case.inv_exponential[r]
                    tokens.append(int(torch.argmax(score)))
                    break
            tokens.append(d)
        else:
            tokens.append(int(case.bonus_token_ids[r]))
        out[r, :len(tokens)] = torch.tensor(tokens)
    return out


CASES = [dict(num=[3, 5, 0, 1, 6, 2], vocab=300, greedy=None, ngram=False),
         dict(num=[2, 4, 1], vocab=17, greedy=[False, True, False], ngram=False),
         dict(num=[4, 2, 3], vocab=50, greedy=None, ngram=True)]


def check(backend, spec):
    for seed in range(3):
        case = make_rejection_case(spec["num"], spec["vocab"], greedy=spec["greedy"], ngram=spec["ngram"], seed=seed)
        got = rejection_sample(*case.args(), backend=backend)
        assert torch.equal(got.long(), oracle(case)), f"seed {seed}"


@pytest.mark.parametrize("spec", CASES, ids=["random", "mixed_greedy", "ngram"])
def test_torch_rejection_sampler_equals_the_rule(spec):
    check("torch", spec)


@pytest.mark.parametrize("spec", CASES, ids=["random", "mixed_greedy", "ngram"])
def test_triton_rejection_sampler_equals_the_rule(spec):
    check("triton", spec)
