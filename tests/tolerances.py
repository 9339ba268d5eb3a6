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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = ""):
    """assert_close with the table's tolerance for `dtype` (default: expected's dtype)."""
    dtype = dtype or expected.dtype
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype], msg=msg or None)
