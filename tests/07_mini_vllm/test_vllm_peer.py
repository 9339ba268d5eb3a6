"""The real-vLLM benchmark peer says why it cannot run instead of crashing (benchmarks/vllm_peer.py).

The peer is asked, not guessed at: a subprocess of its venv loads its kernels. Stand-in interpreters
play the three outcomes (vLLM itself is never installed in CI)."""
import os

from benchmarks import bench_vllm_ab, vllm_peer


def fake_venv(tmp_path, script: str):
    venv = tmp_path / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\n" + script + "\n")
    os.chmod(python, 0o755)
    return venv


def test_not_set_up(tmp_path):
    assert vllm_peer.unavailable_reason(tmp_path / ".venv-vllm") == vllm_peer.SETUP_HINT


def test_kernels_that_load_mean_it_can_run(tmp_path):
    assert vllm_peer.unavailable_reason(fake_venv(tmp_path, "exit 0")) is None


def test_a_kernel_library_built_for_missing_instructions_is_named(tmp_path):
    reason = vllm_peer.unavailable_reason(fake_venv(tmp_path, "kill -ILL $$"))
    assert reason and "SIGILL" in reason and "lacks" in reason


def test_a_broken_install_says_its_last_error(tmp_path):
    reason = vllm_peer.unavailable_reason(fake_venv(tmp_path, "echo 'ImportError: libfoo.so' >&2; exit 1"))
    assert reason and reason.endswith("ImportError: libfoo.so")


def test_the_interleaved_ab_skips_with_the_reason(tmp_path, monkeypatch):
    """Without a runnable peer the A/B writes nothing and says why (it never starts our engine)."""
    monkeypatch.setattr(vllm_peer, "unavailable_reason", lambda venv=vllm_peer.VENV: vllm_peer.SETUP_HINT)
    assert bench_vllm_ab.main(["--out-dir", str(tmp_path)]) == dict(skipped=vllm_peer.SETUP_HINT)
    assert not list(tmp_path.iterdir())
