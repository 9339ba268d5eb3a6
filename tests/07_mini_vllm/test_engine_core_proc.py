"""The engine core in its own process (core_proc.py, core_client.py) and AsyncLLM: the same
outputs as the in-process engine, aborts that free blocks, and a dead core that fails fast.

A tiny random Llama with SmolLM2's tokenizer: random weights make every token a coin toss, so
equal outputs of the two paths mean the same requests ran the same way."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mini_vllm.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):"]


def _params():
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=10, n=2, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=5, max_tokens=16, stop=["e"])]


def _summary(outputs):
    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs] if c.logprobs else None)
             for c in o.outputs] for o in outputs]


def _mp_llm(model_dir, **kwargs):
    """An LLM whose core runs in its own process (the caller set VLLM_ENABLE_V1_MULTIPROCESSING=1).
    Not in engine_registry: the test checks its blocks itself, then shuts its process down."""
    from mini_vllm.llm import LLM

    return LLM(str(model_dir), **{"max_model_len": 512, "num_gpu_blocks_override": 256, **kwargs})


@pytest.fixture(scope="module")
def tiny_llama(tiny_engine_models):
    return tiny_engine_models["llama"][0]


def test_multiprocess_llm_matches_in_process(tiny_llama, make_llm, monkeypatch):
    """LLM.generate through the core process (VLLM_ENABLE_V1_MULTIPROCESSING=1) returns what the
    in-process engine returns: greedy, seeded n = 2 with logprobs, a stop string. An abort frees
    the request's blocks; a killed core fails the next generate at once."""
    inproc = make_llm(tiny_llama)
    expected = _summary(inproc.generate(PROMPTS, _params(), use_tqdm=False))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = _mp_llm(tiny_llama)
    try:
        from mini_vllm.core_client import EngineDeadError, SyncMPClient
        assert isinstance(llm.llm_engine.engine_core, SyncMPClient)
        assert llm.llm_engine.engine_core.pid != os.getpid()
        # The core froze its start-up heap (gc_utils.py): torch, transformers and the model's
        # modules are out of the collector's walks in that process.
        assert llm.llm_engine.engine_core.proc.info["gc_frozen_objects"] > 50_000
        assert _summary(llm.generate(PROMPTS, _params(), use_tqdm=False)) == expected
        assert llm.reset_prefix_cache() is True
        # Abort mid-way: the core frees the request's blocks (checked in the core process).
        engine = llm.llm_engine
        engine.add_request("long", "Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        engine.abort_request("long")
        assert not engine.has_unfinished_requests()
        engine.engine_core.check_invariants()      # every KV block free, in the core process
        # A killed core: a blocking generate raises EngineDeadError within seconds, not a hang.
        os.kill(engine.engine_core.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(["Hello"], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        llm.shutdown()


def test_bad_multiprocessing_flag(monkeypatch):
    from mini_vllm.core_client import multiprocessing_enabled
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "yes please")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        multiprocessing_enabled()


def test_request_output_collector_merges_unread_deltas():
    """A reader that falls behind gets one merged DELTA output, never a growing queue."""
    from mini_vllm.async_llm import RequestOutputCollector
    from mini_vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def out(text, ids, finish=None):
        return RequestOutput("r", "p", [1], [CompletionOutput(0, text, ids, None, None, finish)],
                             finish is not None, RequestMetrics(0.0))

    async def run():
        c = RequestOutputCollector(RequestOutputKind.DELTA)
        for i in range(100):
            c.put(out(f"t{i} ", [i], "length" if i == 99 else None))
        merged = await c.get()
        assert merged.outputs[0].text == "".join(f"t{i} " for i in range(100))
        assert merged.outputs[0].token_ids == list(range(100)) and merged.finished
        assert c.output is None
    asyncio.run(run())


def test_async_llm_stream_abort_and_parity(tiny_llama, make_llm):
    """AsyncLLM: DELTA pieces concatenate to LLM.generate's text; leaving a stream early aborts it
    and frees its blocks; concurrent streams do not disturb each other."""
    from mini_vllm.async_llm import AsyncLLM
    from mini_vllm.engine_config import EngineConfig

    inproc = make_llm(tiny_llama)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].text for o in inproc.generate(PROMPTS, params, use_tqdm=False)]
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), max_model_len=512, num_gpu_blocks_override=256),
                      log_stats_interval=None)

    async def stream(i):
        text = ""
        p = SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True,
                           output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(PROMPTS[i], p, f"s{i}"):
            text += out.outputs[0].text
        return text

    async def leave_early():
        p = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        n = 0
        async for _ in engine.generate("Hello", p, "early"):
            n += 1
            if n == 2:
                break
        return n

    async def run():
        texts = await asyncio.gather(*(stream(i) for i in range(len(PROMPTS))), leave_early())
        await asyncio.sleep(0.2)                        # the abort message reaches the core
        await engine.check_invariants()
        assert not engine.output_processor.has_unfinished_requests() and not engine.collectors
        return texts

    try:
        texts = asyncio.run(run())
    finally:
        engine.shutdown()
    assert texts[:-1] == expected and texts[-1] == 2


def test_core_process_runs_on_this_process_torch_threads(tiny_llama, monkeypatch):
    """The core's process is forked from the forkserver, which never saw this process's
    torch.set_num_threads: the client hands its thread count over, so an engine told to use one
    thread (or a rank given its share of the cores) does not run its core on every core."""
    import torch

    default = torch.get_num_threads()
    wanted = 1 if default > 1 else 2          # anything but the forkserver's default, so the test can fail
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    torch.set_num_threads(wanted)
    try:
        llm = _mp_llm(tiny_llama)
    finally:
        torch.set_num_threads(default)
    try:
        assert llm.llm_engine.engine_core.call_utility("cpu_time")["torch_threads"] == wanted
    finally:
        llm.shutdown()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_core_process_exits_cleanly_on_interrupt(tiny_llama, monkeypatch, signum):
    """Ctrl-C on `serve` sends SIGINT to the whole process group, core included; `close()` sends
    SIGTERM. Either way the core leaves through SystemExit: exit code 0, no KeyboardInterrupt
    traceback (Python's default SIGINT handling would exit 1 and print one), and the front end
    then reports the engine dead instead of waiting on it."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = _mp_llm(tiny_llama)
    try:
        client = llm.llm_engine.engine_core
        os.kill(client.pid, signum)
        client.proc.proc.join(30)
        assert client.proc.proc.exitcode == 0
        assert client.is_dead
    finally:
        llm.shutdown()
