"""The engine's CPU fast paths and their switches: `EngineConfig.cpu_kernels` ("auto" | "off"), the
CustomOps bound to the fused layer ops (`cpu_layer_ops`), malloc's tuning (`cpu_keep_freed_memory`).

  * greedy tokens are identical with every CPU kernel on ("auto") and none ("off"), on SmolLM2
    and on a tiny random model: the kernels change speed, not what the engine generates;
  * with "off", no kernels_cpu extension is built or loaded, and malloc is left alone;
  * a model switched to the fused layer ops computes what the torch layers do;
  * bad or conflicting settings are refused with a message.

The kernels themselves: tests/kernels_cpu/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tolerances import assert_close

from kernels_cpu import build, malloc
from mini_vllm import SamplingParams
from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import KEEP_FREED_MEMORY_ENV, EngineConfig
from mini_vllm.models.linear_method import UNQUANTIZED
from mini_vllm.models.loader import get_model, use_cpu_layer_ops
from model_executor.custom_op import CustomOp

MAX_NEW = 16
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
]


def greedy_tokens(llm) -> list[list[int]]:
    outputs = llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_off_and_auto_agree(make_llm, model_dir):
    auto = make_llm(model_dir)
    off = make_llm(model_dir, cpu_kernels="off")
    runner = off.llm_engine.engine_core.model_runner
    assert runner.attn_backend == "torch"
    assert all(m.platform == "native" for m in runner.model.modules() if isinstance(m, CustomOp))
    assert all(m.linear_method is UNQUANTIZED for m in runner.model.modules() if hasattr(m, "linear_method"))
    tokens = greedy_tokens(auto)
    assert all(len(t) == MAX_NEW for t in tokens)
    assert greedy_tokens(off) == tokens


@pytest.mark.model
def test_off_and_auto_give_the_same_greedy_tokens_on_smollm2(smollm2_dir, make_llm):
    check_off_and_auto_agree(make_llm, smollm2_dir)


def test_off_and_auto_give_the_same_greedy_tokens_on_a_tiny_model(tiny_engine_models, make_llm):
    model_dir, _ = tiny_engine_models["llama"]
    check_off_and_auto_agree(make_llm, model_dir)


def test_the_switches_are_validated():
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(cpu_kernels="fast")
    for conflict in (dict(cpu_gemm_backend="cpu"), dict(cpu_gemm_backend="onednn"), dict(cpu_layer_ops="cpu"),
                     dict(attention_backend="cpu")):
        with pytest.raises(ValueError, match=f"cpu_kernels='off' runs the engine on torch ops alone, but "
                                             f"{next(iter(conflict))}="):
            EngineConfig(cpu_kernels="off", **conflict)
    off = EngineConfig(cpu_kernels="off", device="cpu")
    assert (off.cpu_gemm_backend, off.cpu_layer_ops, off.cpu_keep_freed_memory) == ("torch", "torch", False)
    assert off.resolved_attention_backend == "torch"
    assert EngineConfig(cpu_kernels="off", device="cpu", attention_backend="reference").resolved_attention_backend \
        == "reference"
    with pytest.raises(ValueError, match="cpu_keep_freed_memory must be True or False"):
        EngineConfig(cpu_keep_freed_memory="yes")


def test_keep_freed_memory_defaults_to_on_unless_the_environment_says_0(monkeypatch):
    """On by default; $VFS_CPU_KEEP_FREED_MEMORY=0 (what tests/conftest.py sets for the test
    process) turns the default off; a field given explicitly wins either way."""
    monkeypatch.delenv(KEEP_FREED_MEMORY_ENV, raising=False)
    assert EngineConfig().cpu_keep_freed_memory is True
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "0")
    assert EngineConfig().cpu_keep_freed_memory is False
    assert EngineConfig(cpu_keep_freed_memory=True).cpu_keep_freed_memory is True
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "1")
    assert EngineConfig().cpu_keep_freed_memory is True
    assert EngineConfig(cpu_keep_freed_memory=False).cpu_keep_freed_memory is False
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{KEEP_FREED_MEMORY_ENV} must be 0 or 1"):
        EngineConfig()


def test_the_cli_passes_the_switch():
    import argparse

    from mini_vllm.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).cpu_kernels == "auto"
    assert engine_config(parser.parse_args(["--cpu-kernels", "off", "--device", "cpu"])).cpu_layer_ops == "torch"


# Builds an engine (or not) in a fresh process, then counts the minor page faults of allocating +
# filling 64 MiB that was just freed (16384 pages of 4 KiB), and lists the kernels_cpu extensions the
# process loaded. With cpu_kernels="off" every way to build or configure one raises.
PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    import kernels_cpu
    from kernels_cpu import build
    model_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "engine, cpu_kernels=off":
        def refuse(*args, **kwargs):
            raise AssertionError("cpu_kernels='off' reached kernels_cpu")
        build.build_extension = kernels_cpu.configure_process = refuse
    if mode != "no engine":
        from mini_vllm import LLM, SamplingParams
        kwargs = {"engine": {}, "engine, cpu_keep_freed_memory=False": dict(cpu_keep_freed_memory=False),
                  "engine, cpu_kernels=off": dict(cpu_kernels="off")}[mode]
        llm = LLM(model_dir, device="cpu", max_model_len=256, num_gpu_blocks_override=64, **kwargs)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    def faults_of_a_fresh_64_mib_buffer():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del x
        return after - before
    faults_of_a_fresh_64_mib_buffer()                        # the first time, the pages are new either way
    def shared_libraries():                                  # what the process mapped: the built .so files too
        try:
            return sorted({l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps") if "/vfs_" in l})
        except OSError:
            return None
    print(json.dumps(dict(faults=min(faults_of_a_fresh_64_mib_buffer() for _ in range(3)),
                          loaded=build.loaded_extensions(), libraries=shared_libraries())))
""")
PAGES_IN_64_MIB = (64 << 20) // 4096


def probe(mode: str, model_dir) -> dict:
    # The engine's own default, not the test suite's (tests/conftest.py turns it off for the engines
    # of the test process; the subprocess would inherit that).
    env = {k: v for k, v in os.environ.items() if k != KEEP_FREED_MEMORY_ENV}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), mode], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_off_builds_and_loads_no_cpu_kernel(tiny_engine_models):
    model_dir, _ = tiny_engine_models["llama"]
    off = probe("engine, cpu_kernels=off", model_dir)
    assert off["loaded"] == [] and not off["libraries"]
    on = probe("engine", model_dir)                            # the same probe sees them when they run
    assert on["loaded"] == [f"vfs_cpu_{k}_{build.cpu_isa()}" for k in ("attention", "gemm", "layer_ops")]
    assert on["libraries"] is None or len(on["libraries"]) == 3
    if malloc._glibc() is not None:                             # and "off" left malloc alone
        assert off["faults"] >= PAGES_IN_64_MIB * 0.9


@pytest.mark.skipif(malloc._glibc() is None, reason="keep_freed_memory configures glibc's malloc")
def test_an_engine_on_the_cpu_keeps_freed_memory_for_reuse(tiny_engine_models):
    model_dir, _ = tiny_engine_models["llama"]
    # Without it (no engine, or an engine told not to), every reuse of the 64 MiB faults in every page.
    assert probe("no engine", model_dir)["faults"] >= PAGES_IN_64_MIB * 0.9
    assert probe("engine, cpu_keep_freed_memory=False", model_dir)["faults"] >= PAGES_IN_64_MIB * 0.9
    # With it, the freed block is handed back: (almost) no page is mapped again.
    assert probe("engine", model_dir)["faults"] < PAGES_IN_64_MIB * 0.05


def test_engines_of_the_test_process_leave_malloc_alone(tiny_engine_models, make_llm, monkeypatch):
    """tests/conftest.py: an engine a test builds in this process does not configure malloc, so the
    pytest process gives back what each engine freed (the setting could not be undone). Asked
    directly, not through page faults: in a long-lived process a 64 MiB buffer can come from a hole
    in the heap and be reused without faults whatever malloc's settings."""
    import kernels_cpu

    calls = []
    monkeypatch.setattr(kernels_cpu, "configure_process", lambda: calls.append("configured"))
    model_dir, _ = tiny_engine_models["llama"]
    llm = make_llm(model_dir, device="cpu")
    assert llm.llm_engine.config.cpu_keep_freed_memory is False and calls == []
    assert greedy_tokens(llm)                                   # it ran a step or more, still untouched
    make_llm(model_dir, device="cpu", cpu_keep_freed_memory=True)   # the call it would make (only recorded here)
    assert calls == ["configured"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_config(request, tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp(f"layer-ops-{request.param}")
    tiny_checkpoint(path, request.param)
    return ModelConfig.from_pretrained(path)


def test_a_model_switched_to_the_kernels_computes_what_the_torch_layers_do(tiny_config):
    from mini_vllm.model_inputs import prepare_inputs

    def logits(model):
        inputs = prepare_inputs([[5, 17, 99, 3, 250], [300, 2]], [0, 0], [[0, 1], [2]], 4)
        caches = tiny_config.kv_cache_spec(4).allocate_per_layer(3, "cpu")
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
            return model.compute_logits(hidden[inputs.logits_indices])

    def bound_to_cpu(model):
        return [m for m in model.modules() if isinstance(m, CustomOp) and m.platform == "cpu"]

    plain = get_model(tiny_config, cpu_layer_ops="torch")
    fused = get_model(tiny_config, cpu_layer_ops="cpu")
    layers = tiny_config.num_hidden_layers
    # per layer: 2 norms, the activation, the attention block and its rotation (bound too; the block's
    # forward_cpu fuses the rotation into its own C++ pass, so it runs only under Qwen3's
    # forward_native) (+ Qwen3's q/k norms: bound too, but they take the kernel only for 2-D inputs,
    # so they run torch for [T, heads, D]); + the final norm
    assert len(bound_to_cpu(fused)) == layers * (5 + 2 * (tiny_config.architecture.startswith("Qwen3"))) + 1
    assert not bound_to_cpu(plain)
    assert_close(logits(fused), logits(plain), dtype=torch.float32)
    assert use_cpu_layer_ops(plain, "torch") == 0
    with pytest.raises(ValueError, match="cpu_layer_ops must be one of"):
        use_cpu_layer_ops(plain, "fused")
    assert use_cpu_layer_ops(fused, "torch") == 0 and not bound_to_cpu(fused)      # bound back to torch
    assert torch.equal(logits(fused), logits(plain))
