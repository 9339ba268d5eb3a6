"""Shared test set-up for every chapter.

Two jobs that must happen before any kernel module is imported:
  * without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1), so the
    same kernels the GPU runs are checked on a CPU-only CI machine;
  * tests marked `gpu` (CUDA kernels, native Triton) are skipped cleanly without CUDA.

And one rule for every engine a test builds (chapter 07, integration): it registers in
`engine_registry`, and after EVERY test each registered engine must be idle with all its KV
blocks free (device and CPU tier) and consistent bookkeeping.

And one speed-up: the CPU kernels' builds that only the per-ISA tests use compile in the
background, at the lowest priority, from the start of the session (tests/cpu_isas.py).
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before `import triton` anywhere: triton reads it when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    """What the CPU kernels were tested on: their best variant here is the one the engine runs."""
    from paged_attention import cpu_ops
    avx512 = ("native" if "avx512" in cpu_ops.runnable_isas() else
              "emulated by SIMDe" if "avx512_simde" in cpu_ops.runnable_isas() else
              f"not run ({cpu_ops.why_not_runnable('avx512_simde')})")
    return (f"CPU kernels: {cpu_ops.cpu_isa()} (torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}); their AVX-512 builds: {avx512}; CUDA: {HAS_CUDA}")


PREBUILD = pytest.StashKey()


def pytest_collection_finish(session):
    from cpu_isas import prebuild_in_background
    session.config.stash[PREBUILD] = prebuild_in_background(session.items)


def pytest_sessionfinish(session, exitstatus):
    from cpu_isas import wait_for
    wait_for(session.config.stash.get(PREBUILD, None), exitstatus == pytest.ExitCode.INTERRUPTED)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run with `make test-gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device kernels run on: CUDA when present, else CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def engine_registry():
    """Engines (LLM or LLMEngine) made by tests; checked after every test."""
    return []


@pytest.fixture(autouse=True)
def all_kv_blocks_free_after_test(engine_registry):
    yield
    for llm in engine_registry:
        engine = getattr(llm, "llm_engine", llm)
        assert not engine.has_unfinished_requests(), "a test left requests running"
        engine.engine_core.check_invariants()        # includes: every device and CPU block free
