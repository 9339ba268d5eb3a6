"""The one table of numerical tolerances every kernel test uses.

Why per dtype: a kernel and its reference add the same numbers in a different order
(blocked online softmax vs one big softmax), so they agree to the rounding of the
accumulation dtype, not bit for bit. fp32 agrees to ~1e-5; fp16 keeps 10 mantissa bits
(~1e-3 relative); bf16 keeps 7 (one ulp near 1.0 is 2**-7 ~ 7.8e-3, and a result
rounded twice can be 2 ulp off). Token ids and slot writes are exact: use `torch.equal`.
"""
import torch

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def tol(dtype: torch.dtype) -> dict:
    return TOLERANCES[dtype]


def mismatch(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, what: str = "") -> str:
    """One line a student can act on: how many elements differ, the first one (its index, the value
    expected, the value got) and the largest error."""
    n, total = int(bad.sum()), bad.numel()
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    line = (f"{what + ': ' if what else ''}{n} of {total} elements differ; the first at index {list(first)}: "
            f"expected {expected[first].item()!r}, got {actual[first].item()!r}")
    if actual.is_floating_point() or expected.is_floating_point():
        a, e = actual.double(), expected.double()
        finite = torch.isfinite(a) & torch.isfinite(e) & bad
        if finite.any():
            line += f"; max abs error {float((a - e).abs()[finite].max()):.6g}"
        nan = int((actual.isnan() != expected.isnan()).sum()) if actual.is_floating_point() and expected.is_floating_point() else 0
        if nan:
            line += f"; {nan} NaN where the other has a number (or the reverse)"
    return line


def _same_layout(actual, expected, what):
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what + ': ' if what else ''}shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """torch.equal (exact: token ids, slot writes, cache rows), failing with `mismatch`'s line."""
    _same_layout(actual, expected, what)
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what + ': ' if what else ''}dtype {actual.dtype}, expected {expected.dtype}")
    if torch.equal(actual, expected):
        return
    a, e = actual.cpu(), expected.cpu()
    bad = a != e
    raise AssertionError(mismatch(a, e, bad, what))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = ""):
    """assert_close with the table's tolerance for `dtype` (default: expected's dtype); a failure's
    first line is `mismatch`'s (index, expected, got, max error), torch's own report follows."""
    dtype = dtype or expected.dtype
    a, e = actual.float().cpu(), expected.float().cpu()
    try:
        torch.testing.assert_close(a, e, **TOLERANCES[dtype], msg=msg or None)
    except AssertionError as error:
        if a.shape != e.shape:
            raise
        t = TOLERANCES[dtype]
        bad = ~torch.isclose(a, e, atol=t["atol"], rtol=t["rtol"], equal_nan=True)
        if not bad.any():
            raise
        head = mismatch(a, e, bad, msg) + f" (dtype {str(dtype).removeprefix('torch.')}: atol {t['atol']}, rtol {t['rtol']})"
        raise AssertionError(head + "\n" + str(error)) from None
