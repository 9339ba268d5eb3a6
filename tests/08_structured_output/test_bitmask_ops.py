"""apply_token_bitmask_inplace (chapter 08's ops.py): every backend gives the reference's bits,
and the reference gives xgrammar's (the library vLLM calls) on the same inputs.

Bitwise: a disallowed logit is exactly -inf, every other logit keeps its exact bits (NaN and
+inf included), over fp32 / bf16 / fp16, random masks (bit 31 set: negative words), all-allowed
(-1) and none-allowed (0) rows, a vocabulary that is not a multiple of 32, a mask narrower than
the logits (the tail is disallowed) or wider (the extra bits are ignored), indices: a subset of
rows, speculative decoding's runs of consecutive rows, a repeated row (the masks intersect), an
int32 index tensor, a strided logits view. Plus pack/unpack and clear errors for bad arguments.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from structured_output import ops
from structured_output.reference import num_words, pack_bitmask, unpack_bitmask

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _cpu_reason() -> str | None:
    from structured_output import cpu_ops
    return cpu_ops.unavailable_reason()


def backend_param(name: str):
    if name == "cpu":
        return pytest.param("cpu", marks=pytest.mark.skipif(bool(reason := _cpu_reason()), reason=str(reason)))
    return name


KERNEL_BACKENDS = [backend_param(b) for b in ("torch", "triton", "cpu")]


# ----------------------------------------------------------------------------- cases

def random_words(g: torch.Generator, rows: int, words: int, kind: str = "random") -> torch.Tensor:
    """int32 [rows, words]: "random" (any 32 bits: about half the words negative), "permissive"
    (mostly -1, a few bits cleared), "strict" (mostly 0, a few bits set)."""
    if kind == "random":
        return torch.randint(-2 ** 31, 2 ** 31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    allowed = torch.rand(rows, words * 32, generator=g) < (0.98 if kind == "permissive" else 0.002)
    return pack_bitmask(allowed)


def make_case(name: str, dtype: torch.dtype):
    """(logits, bitmask, indices) for one named case; logits hold NaN and +inf too."""
    g = torch.Generator().manual_seed(hash(name) % 1000)
    strided = False
    indices = None
    if name == "random":                     # vocab not a multiple of 32, any words
        rows, vocab, mask_rows, words = 5, 1000, 5, num_words(1000)
        bitmask = random_words(g, mask_rows, words)
    elif name == "all_or_nothing":           # whole rows of -1 / 0, and single-bit words (bit 31: INT_MIN)
        rows, vocab, mask_rows, words = 4, 65, 4, 3
        bitmask = torch.tensor([[-1, -1, -1], [0, 0, 0], [-2 ** 31, 1, -1], [2 ** 30, -2, 0]], dtype=torch.int32)
    elif name == "narrow_mask":              # logits wider than the mask: tokens >= 128 disallowed
        rows, vocab, mask_rows, words = 3, 200, 3, 4
        bitmask = random_words(g, mask_rows, words)
    elif name == "wide_mask":                # mask bits past vocab 70 ignored
        rows, vocab, mask_rows, words = 3, 70, 3, 5
        bitmask = random_words(g, mask_rows, words)
    elif name == "indices_subset":           # only the structured requests' rows
        rows, vocab, mask_rows, words = 7, 300, 3, num_words(300)
        bitmask = random_words(g, mask_rows, words)
        indices = [5, 0, 3]
    elif name == "spec_decode_runs":         # two requests with 3 and 2 consecutive rows, as a tensor
        rows, vocab, mask_rows, words = 8, 97, 5, num_words(97)
        bitmask = random_words(g, mask_rows, words)
        indices = torch.tensor([1, 2, 3, 6, 7], dtype=torch.int32)
    elif name == "repeated_index":           # row 2 gets both masks: their intersection
        rows, vocab, mask_rows, words = 5, 64, 3, 2
        bitmask = random_words(g, mask_rows, words)
        indices = [2, 4, 2]
    elif name == "strided_logits":           # a column slice of a wider tensor
        rows, vocab, mask_rows, words = 3, 100, 3, num_words(100)
        bitmask = random_words(g, mask_rows, words)
        strided = True
    elif name == "transposed":               # logits and bitmask with non-unit column strides
        rows, vocab, mask_rows, words = 4, 90, 2, num_words(90)
        bitmask = random_words(g, mask_rows, words)
        indices = [3, 1]
    elif name in ("smollm2_permissive", "smollm2_strict"):   # the cpu kernel's fast paths, several threads' worth
        rows, vocab, mask_rows, words = 4, 49152, 4, 1536
        bitmask = random_words(g, mask_rows, words, name.split("_")[1])
    else:
        raise KeyError(name)
    wide = torch.randn(rows, vocab + (9 if strided else 0), generator=g) * 5
    wide[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    logits = wide.to(dtype)[:, 4:4 + vocab] if strided else wide.to(dtype)
    if name == "transposed":
        logits = logits.t().contiguous().t()                              # column stride = rows
        bitmask = torch.stack([bitmask, bitmask], dim=2)[:, :, 0]         # word stride 2
    return logits, bitmask, indices


CASES = ["random", "all_or_nothing", "narrow_mask", "wide_mask", "indices_subset", "spec_decode_runs",
         "repeated_index", "strided_logits", "transposed"]
BIG_CASES = ["smollm2_permissive", "smollm2_strict"]


def reference_result(logits, bitmask, indices):
    out = logits.clone()
    ops.apply_token_bitmask_inplace(out, bitmask, indices, backend="reference")
    return out


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    ia, ib = a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype])
    diff = (ia != ib).nonzero()
    assert diff.numel() == 0, f"{len(diff)} logits differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs {b[tuple(diff[0])]}"


# ----------------------------------------------------------------------------- pack / unpack / reference

@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_pack_unpack_round_trip(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(6, vocab, generator=g) < 0.5
    allowed[0] = True
    allowed[1] = False
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (6, num_words(vocab))
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    assert torch.equal(pack_bitmask(unpack_bitmask(packed, vocab)), packed)
    # Wider than the mask: the tokens past 32 * words come back disallowed.
    assert not unpack_bitmask(packed, 32 * packed.shape[1] + 5)[:, -5:].any()


def test_the_packed_layout():
    """Token t <-> bit t % 32 of word t // 32; bit 31 is the sign bit; -1 allows all 32."""
    allowed = torch.zeros(3, 64, dtype=torch.bool)
    allowed[0, [0, 33]] = True
    allowed[1, 31] = True
    allowed[2, :32] = True
    assert pack_bitmask(allowed).tolist() == [[1, 2], [-2 ** 31, 0], [-1, 0]]
    words = torch.randint(-2 ** 31, 2 ** 31, (4, 3), dtype=torch.int64).to(torch.int32)
    unpacked = unpack_bitmask(words, 96)
    for r in range(4):
        for t in range(96):
            assert unpacked[r, t].item() == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


def test_reference_by_hand():
    logits = torch.arange(1.0, 71.0).reshape(1, 70)
    bitmask = torch.tensor([[0b101, -1]], dtype=torch.int32)         # tokens 0, 2, 32..63 allowed; 64.. past the mask
    ops.apply_token_bitmask_inplace(logits, bitmask, backend="reference")
    kept = (~torch.isinf(logits[0])).nonzero().flatten().tolist()
    assert kept == [0, 2, *range(32, 64)]
    assert logits[0, 2] == 3.0 and logits[0, 1] == float("-inf")


# ----------------------------------------------------------------------------- every backend == reference

@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_backend_equals_reference_bitwise(backend, dtype, case):
    logits, bitmask, indices = make_case(case, dtype)
    expected = reference_result(logits, bitmask, indices)
    ops.apply_token_bitmask_inplace(logits, bitmask, indices, backend=backend)
    assert_same_bits(logits, expected)
    assert (expected == float("-inf")).any() and (expected[0, 3:] != float("-inf")).any()   # a case worth checking


@pytest.mark.parametrize("backend", [backend_param("torch"), backend_param("cpu")])
@pytest.mark.parametrize("case", BIG_CASES)
def test_backend_on_a_real_vocabulary(backend, case):
    logits, bitmask, indices = make_case(case, torch.bfloat16)
    expected = reference_result(logits, bitmask, indices)
    ops.apply_token_bitmask_inplace(logits, bitmask, indices, backend=backend)
    assert_same_bits(logits, expected)


def test_triton_on_a_real_vocabulary():
    """One row of SmolLM2's vocabulary through the Triton kernel (48 programs; interpreter on CPU)."""
    logits, bitmask, _ = make_case("smollm2_permissive", torch.float32)
    logits, bitmask = logits[:1].clone(), bitmask[:1].clone()
    expected = reference_result(logits, bitmask, None)
    ops.apply_token_bitmask_inplace(logits, bitmask, backend="triton")
    assert_same_bits(logits, expected)


@pytest.mark.parametrize("backend", ["reference", *KERNEL_BACKENDS])
def test_empty_and_degenerate_shapes(backend):
    logits = torch.randn(3, 40)
    ops.apply_token_bitmask_inplace(logits, torch.zeros(0, 2, dtype=torch.int32), [], backend=backend)
    assert not logits.isinf().any()                           # no mask rows: nothing happens
    ops.apply_token_bitmask_inplace(logits, torch.zeros(3, 0, dtype=torch.int32), backend=backend)
    assert logits.isinf().all()                               # a mask of no words allows nothing


# ----------------------------------------------------------------------------- the oracle: xgrammar

def xgrammar_result(logits, bitmask, indices):
    """xgrammar's op (what vLLM calls) on the same inputs. Its indices name the SAME row of logits
    and bitmask, so the mask rows are scattered to their logits rows first, into an all-allowed
    (-1) mask: what vLLM's apply_grammar_bitmask does before calling it. Both go in contiguous:
    xgrammar 0.2.8's CPU kernel ignores the mask's column stride, and the logits' column stride
    when there are indices (it writes the wrong elements of a transposed view); ours read any view."""
    xgr = pytest.importorskip("xgrammar")
    out = logits.contiguous().clone()
    if indices is None:
        full, index_list = bitmask.contiguous(), None
    else:
        index_list = [int(i) for i in indices]
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[index_list] = bitmask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # its warning about a mask narrower than the logits
        xgr.apply_token_bitmask_inplace(out, full, indices=index_list)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [c for c in CASES if c != "repeated_index"] + BIG_CASES)
def test_reference_equals_xgrammar(dtype, case):
    logits, bitmask, indices = make_case(case, dtype)
    ours = reference_result(logits, bitmask, indices)
    theirs = xgrammar_result(logits, bitmask, indices)
    covered = 32 * bitmask.shape[1]
    assert_same_bits(ours[:, :covered], theirs[:, :covered])
    if covered < logits.shape[1]:
        # The one deliberate difference: xgrammar leaves tokens past the mask alone (and warns);
        # we forbid them. Those columns are untouched there and -inf here.
        assert_same_bits(theirs[:, covered:], logits[:, covered:])
        assert (ours[:, covered:] == float("-inf")).all()


# ----------------------------------------------------------------------------- errors

BAD_ARGS = {
    "1-D logits": (lambda: (torch.randn(64), torch.zeros(1, 2, dtype=torch.int32), None), "2-D"),
    "int logits": (lambda: (torch.zeros(1, 64, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int32), None), "float32"),
    "fp64 logits": (lambda: (torch.zeros(1, 64, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.int32), None), "float32"),
    "int64 bitmask": (lambda: (torch.randn(1, 64), torch.zeros(1, 2, dtype=torch.int64), None), "int32"),
    "1-D bitmask": (lambda: (torch.randn(1, 64), torch.zeros(2, dtype=torch.int32), None), "2-D"),
    "row mismatch": (lambda: (torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), None), "indices="),
    "indices length": (lambda: (torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), [0]), "1 indices"),
    "index too big": (lambda: (torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), [0, 3]), r"\[0, 3\)"),
    "negative index": (lambda: (torch.randn(3, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([-1])), r"\[0, 3\)"),
    "float indices": (lambda: (torch.randn(3, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1.0])), "integer"),
}


@pytest.mark.parametrize("backend", ["reference", *KERNEL_BACKENDS])
@pytest.mark.parametrize("bad", list(BAD_ARGS))
def test_bad_arguments_raise_a_clear_value_error(backend, bad):
    make, match = BAD_ARGS[bad]
    logits, bitmask, indices = make()
    before = logits.clone()
    with pytest.raises(ValueError, match=match):
        ops.apply_token_bitmask_inplace(logits, bitmask, indices, backend=backend)
    assert torch.equal(logits, before)                         # nothing written


def test_unknown_backends():
    logits, bitmask = torch.randn(1, 32), torch.full((1, 1), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="choose one of"):
        ops.apply_token_bitmask_inplace(logits, bitmask, backend="numpy")
    with pytest.raises(ValueError, match="triton"):
        ops.apply_token_bitmask_inplace(logits, bitmask, backend="cuda")
    with pytest.raises(ValueError, match="pack_bitmask"):
        pack_bitmask(torch.zeros(2, 3))


def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_token_bitmask.py at batch 1 (it checks every side against xgrammar first)."""
    from benchmarks import bench_token_bitmask

    result = bench_token_bitmask.main(["--smoke", "--out-dir", str(tmp_path)])
    assert [(r["batch"], r["mask"]) for r in result["rows"]] == [(1, "permissive"), (1, "strict"), (1, "random")]
    assert all(r["torch / xgrammar"] > 0 for r in result["rows"]) and result["path"].exists()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + BIG_CASES)
def test_triton_on_the_gpu_equals_the_reference(dtype, case):
    """The native Triton kernel (what the engine runs on a GPU) gives the CPU reference's bits."""
    logits, bitmask, indices = make_case(case, dtype)
    expected = reference_result(logits, bitmask, indices)
    on_gpu = logits.cuda()
    if isinstance(indices, torch.Tensor):
        indices = indices.cuda()
    ops.apply_token_bitmask_inplace(on_gpu, bitmask.cuda(), indices, backend="triton")
    assert_same_bits(on_gpu.cpu(), expected)
