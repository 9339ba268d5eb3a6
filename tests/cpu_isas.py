"""Which instruction-set builds of the CPU kernels a per-ISA test runs on this machine."""
import pytest

from paged_attention import cpu_ops


def skip_unless_tested_here(isa: str) -> None:
    """Skip the `isa` case where this machine cannot run it, and the SIMDe-emulated build where
    the CPU runs the real instructions: it is the same source as the native case, which tests
    it on the hardware (and a redundant -O1 build of every kernel costs CI a minute)."""
    if reason := cpu_ops.why_not_runnable(isa):
        pytest.skip(reason)
    emulated = isa.removesuffix("_simde")          # "avx512_simde" emulates "avx512"
    if isa in cpu_ops.EMULATED_ISAS and cpu_ops.why_not_runnable(emulated) is None:
        pytest.skip(f"this CPU runs {emulated} natively: the {emulated} case tests this code")
