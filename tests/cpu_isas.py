"""Which instruction-set builds of the CPU kernels the per-ISA tests run on this machine, and
their builds started ahead, in the background (tests/conftest.py)."""
import os
import subprocess
import sys

import pytest

from paged_attention import cpu_ops

# Each per-ISA test, and the kernel loader it builds its variants with (module, function).
PER_ISA_TESTS = {
    "test_other_instruction_sets": ("paged_attention.cpu_ops", "load"),
    "test_every_instruction_set_variant_computes_f_linear": ("mini_vllm.models.cpu_gemm", "load_kernel"),
    "test_every_instruction_set_variant_computes_the_torch_layers": ("mini_vllm.models.cpu_layer_ops", "load"),
}


def why_not_tested_here(isa: str) -> str | None:
    """Why the `isa` case is skipped here (None: it runs): this machine cannot run it, or it is
    the SIMDe-emulated build and the CPU runs the real instructions -- the same source as the
    native case, which tests it on the hardware (a redundant -O1 build of each kernel)."""
    if reason := cpu_ops.why_not_runnable(isa):
        return reason
    emulated = isa.removesuffix("_simde")          # "avx512_simde" emulates "avx512"
    if isa in cpu_ops.EMULATED_ISAS and cpu_ops.why_not_runnable(emulated) is None:
        return f"this CPU runs {emulated} natively: the {emulated} case tests this code"
    return None


def skip_unless_tested_here(isa: str) -> None:
    if reason := why_not_tested_here(isa):
        pytest.skip(reason)


def prebuild_in_background(items) -> subprocess.Popen | None:
    """Start building the variants the collected per-ISA tests will ask for, other than the one
    the engine uses (built by the first test that runs a kernel). Each is one 15-30 s compile
    and there are up to six, while a test session keeps only ~1.3 of CI's 2 cores busy: at the
    lowest CPU priority they compile in the idle time, and the tests find them built (or wait
    on torch's build lock for the one in progress). Nothing depends on it: a test that finds no
    build makes it itself, as it always did."""
    wanted = dict.fromkeys((item.callspec.params["isa"], *PER_ISA_TESTS[item.originalname]) for item in items
                           if getattr(item, "originalname", None) in PER_ISA_TESTS)   # in the order they run
    jobs = [f"{module}:{function}:{isa}" for isa, module, function in wanted
            if isa != cpu_ops.cpu_isa() and why_not_tested_here(isa) is None]
    if not jobs or cpu_ops.missing_build_tool() or items[0].config.option.collectonly:
        return None
    return subprocess.Popen([sys.executable, __file__, *jobs], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))


def wait_for(builder: subprocess.Popen | None, interrupted: bool) -> None:
    """At the session's end, let the builder finish: a killed build leaves torch's lock behind
    (and it builds only what the selected tests ask for, so a full run finds it done)."""
    if builder is None:
        return
    try:
        builder.wait(timeout=60 if interrupted else 900)
    except subprocess.TimeoutExpired:
        builder.kill()
        builder.wait()


if __name__ == "__main__":                          # the builder: MODULE:FUNCTION:ISA ...
    import importlib
    for job in sys.argv[1:]:
        module, function, isa = job.split(":")
        try:
            getattr(importlib.import_module(module), function)(isa)
        except Exception:                           # noqa: BLE001 — the test that needs it reports it
            pass
