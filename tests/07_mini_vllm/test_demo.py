"""`python -m mini_vllm demo` on the default model (SmolLM2-135M-Instruct)."""
import pytest

from mini_vllm.cli import main


@pytest.mark.model
def test_demo_on_the_default_model(capsys):
    main(["demo", "--num-prompts", "2", "--max-tokens", "8", "--kv-cache-memory", "0.1"])
    out = capsys.readouterr().out
    assert "KV cache:" in out and ">>> What is the capital of France?" in out
    assert "2 requests" in out and "output tok/s" in out
