"""cpu_malloc.keep_freed_memory: after an engine starts on a CPU, a big buffer freed and allocated
again is served from memory the process kept, not faulted back in page by page (cpu_malloc.py says
why this costs prefill ~10%). Each case runs in its own process: malloc's configuration is
process-wide and cannot be undone."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mini_vllm import cpu_malloc

# Builds an engine (or not), then counts the minor page faults of allocating + filling 64 MiB
# that was just freed (16384 pages of 4 KiB).
PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    model_dir, mode = sys.argv[1], sys.argv[2]
    if mode != "no engine":
        from mini_vllm import LLM, SamplingParams
        llm = LLM(model_dir, device="cpu", cpu_keep_freed_memory=(mode == "engine"), max_model_len=256,
                  num_gpu_blocks_override=64)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    def faults_of_a_fresh_64_mib_buffer():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del x
        return after - before
    faults_of_a_fresh_64_mib_buffer()                        # the first time, the pages are new either way
    print(json.dumps(min(faults_of_a_fresh_64_mib_buffer() for _ in range(3))))
""")
PAGES_IN_64_MIB = (64 << 20) // 4096


def faults_after(mode: str, model_dir) -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), mode], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_malloc._glibc() is None, reason="keep_freed_memory configures glibc's malloc")
def test_an_engine_on_the_cpu_keeps_freed_memory_for_reuse(tiny_engine_models):
    model_dir, _ = tiny_engine_models["llama"]
    # Without it (no engine, or an engine told not to), every reuse of the 64 MiB faults in every page.
    assert faults_after("no engine", model_dir) >= PAGES_IN_64_MIB * 0.9
    assert faults_after("engine, cpu_keep_freed_memory=False", model_dir) >= PAGES_IN_64_MIB * 0.9
    # With it, the freed block is handed back: (almost) no page is mapped again.
    assert faults_after("engine", model_dir) < PAGES_IN_64_MIB * 0.05


def test_keep_freed_memory_says_whether_it_applied():
    reason = cpu_malloc.keep_freed_memory()        # idempotent; this pytest process may already have it
    if cpu_malloc._glibc() is None:
        assert reason and "not glibc" in reason
    else:
        assert reason is None


def test_the_engine_switch_is_validated():
    from mini_vllm.engine_config import EngineConfig

    with pytest.raises(ValueError, match="cpu_keep_freed_memory must be True or False"):
        EngineConfig(cpu_keep_freed_memory="yes")
