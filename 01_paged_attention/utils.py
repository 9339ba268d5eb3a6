"""Integer helpers for block arithmetic, shared by every chapter (vLLM: `vllm.utils.cdiv`).

No imports: chapters 02 and 03 use `cdiv` without paying for torch."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers: how many b-token blocks hold a tokens."""
    return -(-a // b)
