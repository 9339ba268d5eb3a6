"""kernels_cpu/dev: every version of each kernel still builds and still computes the reference's
answer (the commands' --smoke mode: tiny shapes, no timing), so the tuning story cannot rot."""
from __future__ import annotations

import pytest

from kernels_cpu import build

pytestmark = pytest.mark.skipif(build.missing_build_tool() is not None, reason=f"{build.missing_build_tool()}")


@pytest.mark.parametrize("kernel", ["attention", "gemm"])
def test_every_version_builds_and_matches_the_reference(kernel, capsys):
    import importlib
    dev = importlib.import_module(f"kernels_cpu.dev.{kernel}")
    rows = dev.main(["--smoke"])
    assert sorted({r["version"] for r in rows}) == sorted(dev.VERSIONS)
    assert all(r["max_error"] < 1e-4 and "ms" not in r for r in rows)
    printed = capsys.readouterr().out
    assert all(f"v{v} " in printed for v in dev.VERSIONS)
