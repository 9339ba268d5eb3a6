"""lora_shrink / lora_expand (chapter 09's ops.py): every backend gives the reference's numbers, and
shrink + expand gives the merged weight's.

Cases: random mixes of adapter slots and -1 (no adapter), interleaved and grouped, T = 1, 37 and
300 tokens; slots of different ranks zero-padded to max_rank, one slot of rank 0 (all zeros);
slices of unequal widths (q/k/v under GQA) with a gap in y; one scale or one per slot;
add_inputs True and False; fp32 / bf16 / fp16; strided views. Tolerances: fp32 within 1e-5
relative (plus 1e-5 of the largest value, for sums that cancel); bf16 / fp16 outputs within one
rounding of their dtype (2^-7 / 2^-10 relative), since the backends sum in fp32 in different
orders and one rounding at the end may land either side. The shrink's output is fp32 whatever
the input dtype: the 1e-5 tolerance there. Tokens without an adapter: zero rows in shrink's
output and their row of y untouched, bit for bit, on every backend.
"""
from __future__ import annotations

import pytest
import torch

from lora import ops, reference, torch_ops
from lora.reference import segments_from_token_lora

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def _cpu_reason() -> str | None:
    from lora import cpu_ops
    return cpu_ops.unavailable_reason()


def backend_param(name: str):
    if name == "cpu":
        return pytest.param("cpu", marks=pytest.mark.skipif(bool(reason := _cpu_reason()), reason=str(reason)))
    return name


KERNEL_BACKENDS = [backend_param(b) for b in ("torch", "triton", "cpu")]
ALL_BACKENDS = ["reference", *KERNEL_BACKENDS]


# ----------------------------------------------------------------------------- cases

HIDDEN = 72                       # not a multiple of 16 (the kernels' tails)
SIZES = (48, 16, 24)              # q / k / v-like slices of unequal widths
OFFSETS = (0, 48, 70)             # ... with a gap of 6 columns in y (70 = 64 + 6)
Y_WIDTH = 96
RANKS = (16, 8, 0, 4, 16)         # per slot; slot 2 is all zeros (rank 0); max_rank 16


def make_adapters(dtype: torch.dtype, g: torch.Generator, ranks=RANKS, sizes=SIZES, hidden=HIDDEN):
    """lora_a [slots, slices, max_rank, in], lora_b [slots, slices, max(sizes), max_rank], zero-padded
    past each slot's rank (and past each slice's width in B)."""
    max_rank, num_slices = max(ranks), len(sizes)
    lora_a = torch.zeros(len(ranks), num_slices, max_rank, hidden)
    lora_b = torch.zeros(len(ranks), num_slices, max(sizes), max_rank)
    for i, r in enumerate(ranks):
        lora_a[i, :, :r] = torch.randn(num_slices, r, hidden, generator=g)
        for s, size in enumerate(sizes):
            lora_b[i, s, :size, :r] = torch.randn(size, r, generator=g)
    return lora_a.to(dtype), lora_b.to(dtype)


def make_token_lora(T: int, layout: str, g: torch.Generator, num_slots: int = len(RANKS)) -> torch.Tensor:
    if layout == "none":
        return torch.full((T,), -1, dtype=torch.int64)
    if layout == "one":
        return torch.full((T,), 3, dtype=torch.int64)
    token_lora = torch.randint(-1, num_slots, (T,), generator=g)
    return token_lora.sort().values if layout == "grouped" else token_lora


CASES = {   # name: (T, layout, scale, add_inputs, token_lora as an int32 tensor / a list)
    "decode_1": (1, "mixed", 0.5, True, "tensor"),
    "mixed_37": (37, "mixed", [2.0, 0.5, 1.0, 0.25, 4.0], True, "tensor"),
    "grouped_300": (300, "grouped", 0.5, True, "tensor"),
    "mixed_300": (300, "mixed", 0.5, True, "int32"),
    "one_adapter": (20, "one", 1.0, True, "list"),
    "no_adapter": (9, "none", 1.0, True, "tensor"),
    "written_not_added": (23, "mixed", 0.5, False, "tensor"),
}


def make_case(name: str, dtype: torch.dtype):
    T, layout, scale, add_inputs, kind = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    lora_a, lora_b = make_adapters(dtype, g)
    token_lora = make_token_lora(T, layout, g)
    if T >= 37:
        assert (token_lora == -1).any() and (token_lora == 2).any()        # no adapter, and the rank-0 slot
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    y = torch.randn(T, Y_WIDTH, generator=g).to(dtype)
    token_lora = token_lora.to(torch.int32) if kind == "int32" else token_lora.tolist() if kind == "list" else token_lora
    return dict(x=x, lora_a=lora_a, lora_b=lora_b, token_lora=token_lora, scale=scale, y=y, add_inputs=add_inputs)


def run_ops(case: dict, backend: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(shrink's out, y after expand) for one backend."""
    num_slices, max_rank = case["lora_a"].shape[1], case["lora_a"].shape[2]
    T = case["x"].shape[0]
    out = torch.full((num_slices, T, max_rank), float("nan"))               # every element must be written
    mod = {"torch": torch_ops}.get(backend) if kw else None
    shrink = mod.lora_shrink if mod else ops.lora_shrink
    expand = mod.lora_expand if mod else ops.lora_expand
    extra = kw if mod else {"backend": backend}
    shrink(case["x"], case["lora_a"], case["token_lora"], case["scale"], out, **extra)
    y = case["y"].clone()
    expand(out, case["lora_b"], case["token_lora"], y, OFFSETS, SIZES, case["add_inputs"], **extra)
    return out, y


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-5 * scale + 1e-30)


def no_adapter_rows(case) -> torch.Tensor:
    return torch.as_tensor(case["token_lora"]).long() < 0


# ----------------------------------------------------------------------------- segments

def test_segments_by_hand():
    token_lora = torch.tensor([2, 2, -1, 0, 0, 0, 2])
    seg = segments_from_token_lora(token_lora)                              # consecutive runs
    assert seg.order.tolist() == list(range(7))
    assert (seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()) == ([0, 2, 3, 6], [2, 1, 3, 1], [2, -1, 0, 2])
    seg = segments_from_token_lora(token_lora, sort=True)                   # one segment per slot
    assert seg.order.tolist() == [2, 3, 4, 5, 0, 1, 6]                      # stable: a slot's tokens keep their order
    assert (seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()) == ([0, 1, 4], [1, 3, 3], [-1, 0, 2])
    empty = segments_from_token_lora(torch.zeros(0, dtype=torch.int64))
    assert all(t.numel() == 0 for t in empty)


@pytest.mark.parametrize("sort", [False, True])
def test_segments_cover_every_token_once(sort):
    g = torch.Generator().manual_seed(1)
    token_lora = torch.randint(-1, 4, (200,), generator=g)
    seg = segments_from_token_lora(token_lora, sort=sort)
    assert sorted(seg.order.tolist()) == list(range(200))
    assert int(seg.lengths.sum()) == 200 and (seg.lengths > 0).all()
    for start, length, slot in zip(seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()):
        assert (token_lora[seg.order[start:start + length]] == slot).all()
    if sort:
        assert seg.slots.tolist() == sorted(set(token_lora.tolist()))      # exactly one segment per slot


# ----------------------------------------------------------------------------- the reference

def test_reference_by_hand():
    """One token, one slice, rank 1: out = scale * (x . a), y += out * b."""
    x = torch.tensor([[1.0, 2.0, 3.0]])
    lora_a = torch.tensor([[[[1.0, 0.0, -1.0]]]])                           # [1 slot, 1 slice, rank 1, in 3]
    lora_b = torch.tensor([[[[2.0], [3.0]]]])                               # [1, 1, out 2, rank 1]
    out = torch.empty(1, 1, 1)
    ops.lora_shrink(x, lora_a, [0], 0.5, out, backend="reference")
    assert out.item() == 0.5 * (1 - 3)
    y = torch.tensor([[10.0, 20.0, 30.0]])
    ops.lora_expand(out, lora_b, [0], y, [1], [2], backend="reference")
    assert y.tolist() == [[10.0, 20.0 - 2.0, 30.0 - 3.0]]


def test_rank_padding_changes_nothing():
    """An adapter of rank 4 zero-padded to max_rank 16 gives its rank-4 result (exact zeros added)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 1, 4, HIDDEN, generator=g), torch.randn(1, 1, 48, 4, generator=g)
    x, y0 = torch.randn(5, HIDDEN, generator=g), torch.randn(5, 48, generator=g)
    a16, b16 = torch.zeros(1, 1, 16, HIDDEN), torch.zeros(1, 1, 48, 16)
    a16[:, :, :4], b16[:, :, :, :4] = a, b
    expected = y0 + 0.5 * (x @ a[0, 0].T) @ b[0, 0].T
    for backend in ("reference", "torch", "triton", *(["cpu"] if not _cpu_reason() else [])):
        for lora_a, lora_b, r in ((a, b, 4), (a16, b16, 16)):
            out, y = torch.empty(1, 5, r), y0.clone()
            ops.lora_shrink(x, lora_a, [0] * 5, 0.5, out, backend=backend)
            ops.lora_expand(out, lora_b, [0] * 5, y, [0], backend=backend)
            assert_close(y, expected, 1e-5)
            assert (out[..., 4:] == 0).all()


# ----------------------------------------------------------------------------- every backend == reference

@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_equals_reference(backend, dtype, case):
    c = make_case(case, dtype)
    expected_out, expected_y = run_ops(c, "reference")
    out, y = run_ops(c, backend)
    assert_close(out, expected_out, 1e-5)                                   # fp32 whatever x's dtype
    assert_close(y, expected_y, RTOL[dtype])
    none = no_adapter_rows(c)
    assert (out[:, none] == 0).all()                                        # written: zeros
    assert torch.equal(y[none], c["y"][none])                               # untouched, bit for bit
    assert torch.equal(y[:, 64:70], c["y"][:, 64:70])                       # the gap between slices too
    if any(slot >= 0 and RANKS[slot] > 0 for slot in torch.as_tensor(c["token_lora"]).tolist()):
        assert not torch.equal(y, c["y"])                                   # a case worth checking


@pytest.mark.parametrize("method", ["bgmv", "sgmv"])
@pytest.mark.parametrize("case", ["decode_1", "mixed_37", "grouped_300", "no_adapter", "written_not_added"])
def test_torch_methods_equal_reference(method, case):
    """Both of the torch backend's ways, forced, whatever the rule would pick."""
    c = make_case(case, torch.float32)
    expected_out, expected_y = run_ops(c, "reference")
    out, y = run_ops(c, "torch", method=method)
    assert_close(out, expected_out, 1e-5)
    assert_close(y, expected_y, 1e-5)


def test_the_rule_between_bgmv_and_sgmv():
    assert torch_ops.use_bgmv(1) and torch_ops.use_bgmv(torch_ops.BGMV_MAX_TOKENS)
    assert not torch_ops.use_bgmv(torch_ops.BGMV_MAX_TOKENS + 1)
    assert torch_ops.use_bgmv(300, "bgmv") and not torch_ops.use_bgmv(1, "sgmv")
    with pytest.raises(ValueError, match="method"):
        torch_ops.use_bgmv(4, "punica")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_rank_zero_slot_adds_nothing(backend):
    """Slot 2 is all zeros (a freed slot): its tokens get zero rows and y exactly as it was."""
    c = make_case("one_adapter", torch.bfloat16)
    c["token_lora"] = [2] * 20
    out, y = run_ops(c, backend)
    assert (out == 0).all() and torch.equal(y, c["y"])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_strided_views(backend):
    """x a column slice, y rows of a wider tensor, lora_a a slot slice: the same numbers."""
    c = make_case("mixed_37", torch.float32)
    expected_out, expected_y = run_ops(c, "reference")
    wide_x = torch.randn(37, HIDDEN + 8)
    wide_x[:, 3:3 + HIDDEN] = c["x"]
    wide_y = torch.randn(37, Y_WIDTH + 5)
    wide_y[:, 5:] = c["y"]
    c2 = dict(c, x=wide_x[:, 3:3 + HIDDEN], y=wide_y[:, 5:])
    out, y = run_ops(c2, backend)
    assert_close(out, expected_out, 1e-5)
    assert_close(y, expected_y, 1e-5)
    # y with strided columns (a transposed copy): expand must still write the right elements.
    y_t = c["y"].t().contiguous().t()
    ops.lora_expand(expected_out, c["lora_b"], c["token_lora"], y_t, OFFSETS, SIZES, backend=backend)
    assert_close(y_t, expected_y, 1e-5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_batch(backend):
    lora_a, lora_b = make_adapters(torch.float32, torch.Generator().manual_seed(0))
    out, y = torch.empty(3, 0, 16), torch.empty(0, Y_WIDTH)
    ops.lora_shrink(torch.empty(0, HIDDEN), lora_a, [], 1.0, out, backend=backend)
    ops.lora_expand(out, lora_b, [], y, OFFSETS, SIZES, backend=backend)


# ----------------------------------------------------------------------------- composition

def merged_output(x, weight, lora_a, lora_b, token_lora, scales, sizes):
    """x[t] @ (W + scale_i * B_i @ A_i)^T, the merged weight built per token (slice by slice)."""
    rows = []
    for t, slot in enumerate(token_lora):
        w = weight.clone()
        if slot >= 0:
            off = 0
            for s, size in enumerate(sizes):
                w[off:off + size] += scales[slot] * (lora_b[slot, s, :size] @ lora_a[slot, s])
                off += size
        rows.append(x[t] @ w.T)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_shrink_then_expand_is_the_merged_weight(backend):
    """y = x W^T, then add_lora_linear: each token's output is what the weight merged with its own
    adapter (W + scale B A, PEFT's merge_and_unload) gives."""
    g = torch.Generator().manual_seed(7)
    sizes = (48, 16, 16)
    lora_a, lora_b = make_adapters(torch.float32, g, sizes=sizes)
    x = torch.randn(40, HIDDEN, generator=g)
    weight = torch.randn(sum(sizes), HIDDEN, generator=g) / HIDDEN ** 0.5
    token_lora = make_token_lora(40, "mixed", g).tolist()
    scales = [2.0, 0.5, 1.0, 0.25, 4.0]
    expected = merged_output(x, weight, lora_a, lora_b, token_lora, scales, sizes)
    y = x @ weight.T
    ops.add_lora_linear(y, x, lora_a, lora_b, token_lora, scales, sizes, backend=backend)
    assert_close(y, expected, 1e-5)
    assert_close(reference.lora_linear(x, weight, lora_a, lora_b, token_lora, scales, sizes), expected, 1e-5)


# ----------------------------------------------------------------------------- errors

def _shrink_args(**over):
    g = torch.Generator().manual_seed(0)
    lora_a, _ = make_adapters(torch.float32, g)
    args = dict(x=torch.randn(4, HIDDEN), lora_a=lora_a, token_lora=[0, -1, 4, 2], scale=0.5,
                out=torch.zeros(3, 4, 16))
    args.update(over)
    return args


def _expand_args(**over):
    g = torch.Generator().manual_seed(0)
    _, lora_b = make_adapters(torch.float32, g)
    args = dict(buffer=torch.randn(3, 4, 16), lora_b=lora_b, token_lora=[0, -1, 4, 2], y=torch.randn(4, Y_WIDTH),
                slice_offsets=list(OFFSETS), slice_sizes=list(SIZES))
    args.update(over)
    return args


BAD_SHRINK = {
    "slot too big": (dict(token_lora=[0, 5, 1, 1]), r"\[-1, 5\)"),
    "slot below -1": (dict(token_lora=torch.tensor([0, -2, 1, 1])), r"\[-1, 5\)"),
    "token_lora length": (dict(token_lora=[0, 1]), "2 entries for 4 tokens"),
    "float token_lora": (dict(token_lora=torch.zeros(4)), "integer"),
    "1-D x": (dict(x=torch.randn(HIDDEN)), "2-D"),
    "fp64 x": (dict(x=torch.randn(4, HIDDEN, dtype=torch.float64)), "float32, bfloat16 or float16"),
    "dtype mismatch": (dict(x=torch.randn(4, HIDDEN, dtype=torch.bfloat16)), "x's dtype"),
    "in mismatch": (dict(x=torch.randn(4, HIDDEN + 1)), "features"),
    "3-D lora_a": (dict(lora_a=torch.randn(5, 16, HIDDEN)), "4-D"),
    "bf16 out": (dict(out=torch.zeros(3, 4, 16, dtype=torch.bfloat16)), "float32"),
    "out shape": (dict(out=torch.zeros(3, 4, 8)), r"\(3, 4, 16\)"),
    "scale per slot": (dict(scale=[1.0, 2.0]), "one per slot"),
}

BAD_EXPAND = {
    "slot too big": (dict(token_lora=[0, 1, 1, 7]), r"\[-1, 5\)"),
    "dtype mismatch": (dict(y=torch.randn(4, Y_WIDTH, dtype=torch.float16)), "y's dtype"),
    "bf16 buffer": (dict(buffer=torch.randn(3, 4, 16).bfloat16()), "float32"),
    "buffer shape": (dict(buffer=torch.randn(3, 5, 16)), r"\(3, 4, 16\)"),
    "slice past y": (dict(slice_offsets=[0, 48, 80]), "columns"),
    "slice too wide": (dict(slice_sizes=[49, 16, 24]), "49 wide"),
    "overlapping slices": (dict(slice_offsets=[0, 40, 70]), "overlap"),
    "slice count": (dict(slice_offsets=[0, 48]), "3 integers"),
    "1-D y": (dict(y=torch.randn(Y_WIDTH)), "2-D"),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", list(BAD_SHRINK))
def test_bad_shrink_arguments_raise_a_clear_value_error(backend, bad):
    over, match = BAD_SHRINK[bad]
    args = _shrink_args(**over)
    before = args["out"].clone()
    with pytest.raises(ValueError, match=match):
        ops.lora_shrink(**args, backend=backend)
    assert torch.equal(args["out"], before)                                 # nothing written


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", list(BAD_EXPAND))
def test_bad_expand_arguments_raise_a_clear_value_error(backend, bad):
    over, match = BAD_EXPAND[bad]
    args = _expand_args(**over)
    before = args["y"].clone()
    with pytest.raises(ValueError, match=match):
        ops.lora_expand(**args, backend=backend)
    assert torch.equal(args["y"], before)


def test_unknown_backends():
    args = _shrink_args()
    with pytest.raises(ValueError, match="choose one of"):
        ops.lora_shrink(**args, backend="numpy")
    with pytest.raises(ValueError, match="triton"):
        ops.lora_shrink(**args, backend="cuda")


# ----------------------------------------------------------------------------- the C++ kernels per ISA

@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_cpu_kernels_on_other_instruction_sets(isa):
    """The AVX2 and scalar builds (the best one is tested above) give the same numbers."""
    from kernels_cpu import build
    from kernels_cpu import lora_ops as cpu_lora
    if reason := (_cpu_reason() or build.why_not_runnable(isa)):
        pytest.skip(reason)
    for dtype in DTYPES:
        c = make_case("mixed_37", dtype)
        expected_out, expected_y = run_ops(c, "reference")
        slots = torch.as_tensor(c["token_lora"]).long()
        out, y = torch.empty_like(expected_out), c["y"].clone()
        cpu_lora.lora_shrink(c["x"], c["lora_a"], slots, reference.check_scale(c["scale"], 5, out.device), out, isa=isa)
        cpu_lora.lora_expand(out, c["lora_b"], slots, y, torch.tensor(OFFSETS), torch.tensor(SIZES), isa=isa)
        assert_close(out, expected_out, 1e-5)
        assert_close(y, expected_y, RTOL[dtype])


# ----------------------------------------------------------------------------- benchmark, GPU

def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_lora_ops.py at T = 16 on the qkv layer (it checks every side against the naive loop)."""
    from benchmarks import bench_lora_ops

    result = bench_lora_ops.main(["--quick", "--out-dir", str(tmp_path)])
    assert [(r["layer"], r["tokens"], r["layout"]) for r in result["rows"]] == [("qkv", 16, "mixed")]
    assert all(r["torch / naive"] > 0 for r in result["rows"]) and result["path"].exists()


def test_engine_benchmark_smoke(tmp_path):
    """benchmarks/bench_lora_engine.py --smoke: tiny model, two adapters; the mixed engine and the
    one-adapter-at-a-time engine give the same greedy tokens."""
    from benchmarks import bench_lora_engine

    result = bench_lora_engine.main(["--smoke", "--out-dir", str(tmp_path)])
    summary = result["summary"]
    assert summary["same_greedy_tokens"] == {"ours, one adapter at a time": 1.0}
    assert summary["mixed_over_base"] > 0 and result["path"].exists()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_on_the_gpu_equals_the_reference(dtype, case):
    """The native Triton kernels (what the engine runs on a GPU) give the CPU reference's numbers."""
    c = make_case(case, dtype)
    expected_out, expected_y = run_ops(c, "reference")
    token_lora = c["token_lora"]
    on_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    if isinstance(token_lora, list):
        on_gpu["token_lora"] = torch.tensor(token_lora, device="cuda")
    num_slices, T, max_rank = expected_out.shape
    out = torch.full((num_slices, T, max_rank), float("nan"), device="cuda")
    ops.lora_shrink(on_gpu["x"], on_gpu["lora_a"], on_gpu["token_lora"], c["scale"], out, backend="triton")
    y = on_gpu["y"].clone()
    ops.lora_expand(out, on_gpu["lora_b"], on_gpu["token_lora"], y, OFFSETS, SIZES, c["add_inputs"], backend="triton")
    assert_close(out.cpu(), expected_out, 1e-5)
    assert_close(y.cpu(), expected_y, RTOL[dtype])
