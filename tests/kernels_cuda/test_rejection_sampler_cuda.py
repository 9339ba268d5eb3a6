"""The CUDA (and native Triton) rejection sampler on a GPU == the reference, token for token.
`make test-gpu`; skipped without CUDA. The same .cu file is checked on the CPU, in the emulator,
by tests/04_spec_decode/test_cuda_kernels_emulated.py."""
import pytest
import torch

from spec_decode import RejectionSampler, SpecDecodeMetadata, SpecSamplingMetadata
from spec_decode.ops import rejection_sample
from spec_decode.synthetic import make_rejection_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("vocab", [7, 1000, 32000, 151_936])
def test_equals_reference(backend, ngram, vocab):
    greedy = [i % 3 == 0 for i in range(64)]
    num_draft = [(i * 7) % 9 for i in range(64)]
    case = make_rejection_case(num_draft, vocab, greedy=greedy, ngram=ngram, seed=vocab, extra_spec_len=1)
    ref = rejection_sample(*case.args(), backend="reference")
    out = rejection_sample(*case.to("cuda").args(), backend=backend)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_big_batch_all_random(backend):
    case = make_rejection_case([5] * 512, 4096, seed=3)
    assert torch.equal(rejection_sample(*case.to("cuda").args(), backend=backend).cpu(),
                       rejection_sample(*case.args(), backend="torch"))


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_module_on_gpu(backend):
    torch.manual_seed(0)
    drafts = [[1, 2, 3], [], [4, 5]]
    md = SpecDecodeMetadata.from_draft_token_ids(drafts, device="cuda")
    logits = torch.randn(5, 500, device="cuda")
    sm = SpecSamplingMetadata.from_lists([0.0, 0.7, 1.0], top_k=[-1, 20, -1], device="cuda")
    outs = [RejectionSampler(b, generator=torch.Generator("cuda").manual_seed(1))(
        md, None, logits, torch.tensor([7, 8, 9], device="cuda"), sm) for b in ("torch", backend)]
    assert torch.equal(outs[0], outs[1])
