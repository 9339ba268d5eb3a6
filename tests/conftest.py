"""Shared test set-up for every chapter.

Two jobs that must happen before any kernel module is imported:
  * without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1), so the
    same kernels the GPU runs are checked on a CPU-only CI machine;
  * tests marked `gpu` (CUDA kernels, native Triton) are skipped cleanly without CUDA.

And one rule for every engine a test builds (chapter 07, integration): it registers in
`engine_registry`, and after EVERY test each registered engine must be idle with all its KV
blocks free (device and CPU tier) and consistent bookkeeping.

Engines built by tests leave malloc alone by default ($VFS_CPU_KEEP_FREED_MEMORY=0, the default of
EngineConfig.cpu_keep_freed_memory): that setting is process-wide and cannot be undone, so this one
pytest process would keep the high-water mark of every engine the suite builds. The tests of the
setting itself run their engines in fresh processes with it on (tests/07_mini_vllm/test_cpu_kernels.py,
benchmarks/bench_cpu_malloc.py).

The CPU kernels' own set-up (what they were tested on, their per-ISA builds started in the
background) lives in tests/kernels_cpu/conftest.py: it runs only when that folder is collected.
"""
import os
import weakref

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before `import triton` anywhere: triton reads it when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Read when an EngineConfig is made (and inherited by the processes tests start: servers, notebooks).
os.environ.setdefault("VFS_CPU_KEEP_FREED_MEMORY", "0")
# torch._dynamo sets TORCHINDUCTOR_CACHE_DIR when it is first imported (transformers imports it on some
# paths): imported here, before any test, so the environment guard below sees torch's setting as given.
import torch._dynamo  # noqa: E402,F401


def pytest_report_header(config):
    return f"CUDA: {HAS_CUDA}"


# The longest test files, longest first (`pytest --durations` on a 2-core CPU). `make test` runs the suite in
# one process per core, handing out a test file at a time (pytest-xdist, --dist loadfile
# --no-loadscope-reorder) in collection order: started first, these cannot be the one file a
# process runs alone at the end (tests/test_suite_order.py).
LONGEST_FILES = ("course/test_proof.py", "integration/test_composition_serve_0.py",
                 "integration/test_composition_serve_1.py", "integration/test_composition_llm.py",
                 "07_mini_vllm/test_spec_decode_engine.py",
                 "07_mini_vllm/test_parallel_engine.py", "course/test_build_and_grade.py",
                 "07_mini_vllm/test_benchmarks.py", "07_mini_vllm/test_engine_parity.py",
                 "07_mini_vllm/test_notebook.py")


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}

    def key(item):
        rel = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(rel, len(rank))
    items.sort(key=key)                  # stable: every file keeps its own order


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
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


class EngineRegistry:
    """Engines (LLM or LLMEngine) made by tests, checked after every test (`append`, `remove`).

    An engine is held until the end of the test that made it, so it is checked then even when
    the test (or its function-scoped fixture) has dropped it. After that it is held only weakly:
    it is still checked after every later test for as long as something else holds it (a module-
    or session-scoped fixture), and once nothing does it is freed. Holding every engine for the
    whole session kept all their weights and KV caches in this one process (19 GB by the end)."""

    def __init__(self):
        self._this_test: list = []             # made since the last check
        self._earlier: list[weakref.ref] = []  # made by earlier tests

    def append(self, engine) -> None:
        self._this_test.append(engine)

    def remove(self, engine) -> None:
        """Stop checking `engine` (a test that shuts it down itself)."""
        if any(e is engine for e in self._this_test):
            self._this_test = [e for e in self._this_test if e is not engine]
        elif any(r() is engine for r in self._earlier):
            self._earlier = [r for r in self._earlier if r() is not engine]
        else:
            raise ValueError("engine_registry.remove: this engine was never registered")

    def __iter__(self):
        earlier = [r() for r in self._earlier]
        return iter(self._this_test + [e for e in earlier if e is not None])

    def test_finished(self) -> None:
        """The check after a test is done: from now on its engines are held only weakly."""
        self._earlier = [r for r in self._earlier if r() is not None]
        self._earlier += [weakref.ref(e) for e in self._this_test]
        self._this_test = []


_PYTEST_OWN_ENVIRON = {"PYTEST_CURRENT_TEST"}      # pytest sets it for each phase of each test


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _PYTEST_OWN_ENVIRON}


def _check_environ_restored(before: dict[str, str], what: str) -> None:
    """Fail (after putting it back) when os.environ differs from `before`: a test that changes the
    environment changes it for every later test in this process, and for every process they start."""
    after = _environ()
    if after == before:
        return
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    pytest.fail(f"{what} left os.environ changed: {', '.join(changed)} (restore it, e.g. with monkeypatch)",
                pytrace=False)


@pytest.fixture(autouse=True)
def environ_restored_after_test():
    """Every test leaves os.environ as it found it."""
    before = _environ()
    yield
    _check_environ_restored(before, "this test")


@pytest.fixture(autouse=True, scope="module")
def environ_restored_after_module():
    """... and so does every module's fixtures (a server started once per module, say)."""
    before = _environ()
    yield
    _check_environ_restored(before, "this module's fixtures")


@pytest.fixture(scope="session")
def engine_registry():
    """Engines made by tests; checked after every test (EngineRegistry)."""
    return EngineRegistry()


@pytest.fixture(scope="session")
def make_llm(engine_registry):
    """make_llm(model_dir, **EngineConfig fields) -> LLM (registered for the end-of-test check)."""
    from mini_vllm import LLM

    def make(model_dir, **kwargs):
        if "kv_cache_memory" not in kwargs:
            # A small pool: tests stay fast (KV invariant checks are O(blocks)) and reach preemption.
            kwargs.setdefault("num_gpu_blocks_override", 256)
        kwargs.setdefault("max_model_len", 512)
        llm = LLM(str(model_dir), **kwargs)
        engine_registry.append(llm)
        return llm
    return make


@pytest.fixture(autouse=True)
def all_kv_blocks_free_after_test(engine_registry):
    yield
    try:
        for llm in engine_registry:
            engine = getattr(llm, "llm_engine", llm)
            assert not engine.has_unfinished_requests(), "a test left requests running"
            engine.engine_core.check_invariants()        # includes: every device and CPU block free
    finally:
        engine_registry.test_finished()
