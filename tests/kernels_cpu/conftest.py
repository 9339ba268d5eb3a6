"""Set-up for the CPU kernels' tests (kernels_cpu/), loaded only when this folder is collected.

  * A line after collection says what the kernels were tested on: the best variant here is the
    one the engine runs, and whether their AVX-512 code ran natively, emulated by SIMDe, or not.
  * Which instruction-set builds the per-ISA tests run on this machine: a case this CPU cannot
    run, or the SIMDe-emulated build where the CPU runs AVX-512 natively (the same source, tested
    on the hardware), is skipped with the reason.
  * Those builds start ahead, in the background, at the lowest CPU priority, from the start of
    the session (`python -m kernels_cpu build KERNEL:ISA ...`).
"""
import os
import subprocess
import sys

import pytest
import torch

from kernels_cpu import build

# Each per-ISA test, and the kernel (`python -m kernels_cpu build` names) it builds its variants of.
PER_ISA_TESTS = {
    "test_other_instruction_sets": "attention",
    "test_every_instruction_set_variant_computes_f_linear": "gemm",
    "test_every_instruction_set_variant_computes_the_torch_layers": "layer_ops",
}
PREBUILD = pytest.StashKey()


def pytest_report_collectionfinish(config, start_path, items):
    """What the CPU kernels were tested on: their best variant here is the one the engine runs."""
    if not any(_in_this_folder(item) for item in items):
        return None
    avx512 = ("native" if "avx512" in build.runnable_isas() else
              "emulated by SIMDe" if "avx512_simde" in build.runnable_isas() else
              f"not run ({build.why_not_runnable('avx512_simde')})")
    return (f"CPU kernels: {build.cpu_isa()} (torch CPU capability {torch.backends.cpu.get_cpu_capability()}); "
            f"their AVX-512 builds: {avx512}")


def why_not_tested_here(isa: str) -> str | None:
    """Why the `isa` case is skipped here (None: it runs): this machine cannot run it, or it is
    the SIMDe-emulated build and the CPU runs the real instructions -- the same source as the
    native case, which tests it on the hardware (a redundant -O1 build of each kernel)."""
    if reason := build.why_not_runnable(isa):
        return reason
    emulated = isa.removesuffix("_simde")          # "avx512_simde" emulates "avx512"
    if isa in build.EMULATED_ISAS and build.why_not_runnable(emulated) is None:
        return f"this CPU runs {emulated} natively: the {emulated} case tests this code"
    return None


def _per_isa(item) -> str | None:
    """The isa of a per-ISA test case (None: not one)."""
    if getattr(item, "originalname", None) not in PER_ISA_TESTS or not _in_this_folder(item):
        return None
    return item.callspec.params["isa"]


def _in_this_folder(item) -> bool:
    return os.path.dirname(__file__) == os.path.dirname(str(item.path))


def pytest_collection_modifyitems(config, items):
    for item in items:
        isa = _per_isa(item)
        if isa is not None and (reason := why_not_tested_here(isa)):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session):
    session.config.stash[PREBUILD] = prebuild_in_background(session.items)


def pytest_sessionfinish(session, exitstatus):
    wait_for(session.config.stash.get(PREBUILD, None), exitstatus == pytest.ExitCode.INTERRUPTED)


def prebuild_in_background(items) -> subprocess.Popen | None:
    """Start building the variants the collected per-ISA tests will ask for, other than the one
    the engine uses (built by the first test that runs a kernel). Each is one 15-30 s compile
    and there are up to six, while a test session keeps only ~1.3 of CI's 2 cores busy: at the
    lowest CPU priority they compile in the idle time, and the tests find them built (or wait
    on torch's build lock for the one in progress). Nothing depends on it: a test that finds no
    build makes it itself, as it always did."""
    wanted = dict.fromkeys((PER_ISA_TESTS[item.originalname], isa) for item in items
                           if (isa := _per_isa(item)) is not None)          # in the order they run
    jobs = [f"{kernel}:{isa}" for kernel, isa in wanted if isa != build.cpu_isa() and why_not_tested_here(isa) is None]
    if not jobs or build.missing_build_tool() or items[0].config.option.collectonly:
        return None
    return subprocess.Popen([sys.executable, "-m", "kernels_cpu", "build", *jobs], stdout=subprocess.DEVNULL,
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
