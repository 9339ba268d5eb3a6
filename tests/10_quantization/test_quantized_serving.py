"""A quantized checkpoint through every front end: the command line (-q / --quantization), AsyncLLM
behind the OpenAI server, and features that change the engine around the weights (TP, LoRA, ...)
in the composition matrix (tests/integration)."""
import httpx2 as httpx
import pytest
from openai_server_thread import API_KEY, NAME, ServerThread

from mini_vllm import SamplingParams
from mini_vllm.cli import main

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_generate_command_runs_a_quantized_checkpoint(tiny_quantized, capsys):
    path = tiny_quantized["w4a16_g32"]
    main(["generate", "--model", str(path), "-q", "compressed-tensors", "--prompt", "Hello there", "--max-tokens", "4",
          "--ignore-eos", "--max-model-len", "128", "--kv-cache-memory", "0.01"])
    assert "4 output tokens" in capsys.readouterr().out
    with pytest.raises(ValueError, match="Unknown quantization method: fp8"):
        main(["generate", "--model", str(path), "--quantization", "fp8", "--prompt", "x"])


def test_server_answers_as_the_offline_engine(tiny_quantized, make_llm):
    path = tiny_quantized["w8a8"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in make_llm(path).generate(PROMPTS, params)]
    server = ServerThread(path)
    try:
        body = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": NAME, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True}, timeout=120).json()
        assert [c["token_ids"] for c in body["choices"]] == offline
        server.wait_idle()
    finally:
        server.stop()
