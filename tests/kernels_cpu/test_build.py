"""kernels_cpu/build.py: what a machine that cannot build the kernels is told, and a build killed
midway (its lock left behind) does not hang the next load. The attention kernel stands for every
kernel here (they load through the same `build.load_extension`); the extension cache
($TORCH_EXTENSIONS_DIR) and the process's registry are swapped out, so nothing real is rebuilt."""
from __future__ import annotations

import pathlib

import pytest

from kernels_cpu import attention as cpu_attention
from kernels_cpu import build


def test_no_compiler_is_a_clear_error(monkeypatch):
    """Without a compiler, load() says so (and is_available() is False) instead of a build trace."""
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*no-such-compiler-xyz"):
        cpu_attention.load()
    assert not cpu_attention.is_available()
    assert "no-such-compiler-xyz" in cpu_attention.unavailable_reason()


def test_no_ninja_is_a_clear_error(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    with pytest.raises(RuntimeError, match="needs ninja"):
        cpu_attention.load()


def _lock_in_build_dir(name: str, age_s: float):
    import os
    import time
    from torch.utils.cpp_extension import _get_build_directory
    lock = pathlib.Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_killed_build_does_not_hang_the_next_load(monkeypatch, tmp_path):
    """A build killed midway leaves torch's build lock behind, and torch waits for it without a
    time limit: load() clears a lock older than any build (with a warning) before building,
    and leaves a fresh one -- another process's build in progress -- alone."""
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.clear_stale_build_lock("vfs_no_lock") is None
    fresh = _lock_in_build_dir("vfs_fresh", age_s=5)
    assert build.clear_stale_build_lock("vfs_fresh") is None and fresh.exists()
    stale = _lock_in_build_dir("vfs_cpu_attention_scalar", age_s=build.STALE_LOCK_SECONDS + 60)

    class Built:                                  # what the build returns, without building
        @staticmethod
        def isa():
            return "scalar"

    def fake_build(name, **_):                    # torch's FileBaton would wait here forever
        assert not (tmp_path / name / "lock").exists(), "the stale lock is still there: the load would hang"
        return Built

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    with pytest.warns(RuntimeWarning, match="stale build lock .*vfs_cpu_attention_scalar"):
        assert cpu_attention.load("scalar") is Built
    assert not stale.exists()


def test_the_registry_names_what_this_process_loaded(monkeypatch):
    """loaded_extensions(): each extension once, by its build name, whether it was asked for by
    name or as the default variant (tests/07_mini_vllm/test_cpu_kernels.py reads it)."""
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    assert build.loaded_extensions() == []

    class Built:
        @staticmethod
        def isa():
            return build.cpu_isa()

    monkeypatch.setattr(build, "build_extension", lambda name, *_: Built)
    assert cpu_attention.load() is Built and cpu_attention.load(build.cpu_isa()) is Built
    assert build.loaded_extensions() == [f"vfs_cpu_attention_{build.cpu_isa()}"]


def test_the_package_is_a_leaf():
    """kernels_cpu imports torch only: no chapter (the chapters reach it, never the reverse)."""
    import subprocess
    import sys
    chapters = ["paged_attention", "kvcache", "scheduler", "spec_decode", "chunked_prefill", "global_prefix_cache",
                "mini_vllm", "kernels_cuda"]
    code = ("import sys, kernels_cpu, kernels_cpu.__main__, kernels_cpu.malloc, kernels_cpu.dev.attention, "
            "kernels_cpu.dev.gemm, kernels_cpu.quant_gemm; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {chapters!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
