"""The command line: generate (prompts and a prompts file), chat (streaming, history kept), bench."""
from __future__ import annotations

import io

import pytest

from mini_vllm.cli import main
from mini_vllm.llm_engine import LLMEngine


def test_generate_prompts_and_file(tiny_engine_models, tmp_path, capsys):
    model_dir, _ = tiny_engine_models["llama"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\nsecond line\n")
    main(["generate", "--model", str(model_dir), "--prompt", "Hello there", "--prompts-file", str(prompts),
          "--max-tokens", "5", "--ignore-eos", "--max-model-len", "128", "--kv-cache-memory", "0.01"])
    out = capsys.readouterr().out
    assert out.count(">>> ") == 3 and ">>> second line" in out and "[length]" in out
    assert "3 requests" in out and "output tok/s" in out and "15 output tokens" in out
    with pytest.raises(SystemExit, match="--prompt"):
        main(["generate", "--model", str(model_dir)])


def test_chat_streams_and_keeps_history(tiny_engine_models, capsys, monkeypatch):
    from mini_vllm import cli

    model_dir, _ = tiny_engine_models["llama"]
    seen = []
    original = LLMEngine.apply_chat_template
    monkeypatch.setattr(LLMEngine, "apply_chat_template",
                        lambda self, messages, *a, **k: seen.append([m["role"] for m in messages]) or
                        original(self, messages, *a, **k))
    cli.cmd_chat(cli.build_parser().parse_args(["chat", "--model", str(model_dir), "--max-tokens", "4",
                                                "--system", "Be brief.", "--max-model-len", "256",
                                                "--kv-cache-memory", "0.01"]),
                 stdin=io.StringIO("hello\nand again\n\n"))
    out = capsys.readouterr().out
    assert out.count("model> ") == 2
    assert seen == [["system", "user"], ["system", "user", "assistant", "user"]]


def test_bench_command(tiny_engine_models, capsys):
    model_dir, _ = tiny_engine_models["qwen2"]
    main(["bench", "--model", str(model_dir), "--num-requests", "5", "--input-len", "4", "12", "--output-len", "2", "6",
          "--max-model-len", "64", "--kv-cache-memory", "0.01"])
    out = capsys.readouterr().out
    assert "5 requests" in out and "random prompts of 4-12 tokens" in out and "output tok/s" in out


def test_the_structured_outputs_flag_reaches_the_engine_config():
    """`serve` / `generate` take vLLM's --structured-outputs-config (JSON) like the other config flags."""
    from mini_vllm.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--model", "m", "--structured-outputs-config", '{"backend": "xgrammar"}'])
    assert engine_config(args).structured_outputs_config == {"backend": "xgrammar"}
    args = build_parser().parse_args(["serve", "--model", "m", "--structured-outputs-config", '{"backend": "nope"}'])
    with pytest.raises(ValueError, match="backend must be one of"):
        engine_config(args)
