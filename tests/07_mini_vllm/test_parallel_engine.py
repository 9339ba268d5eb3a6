"""Tensor and pipeline parallelism through the multiprocess executor, on CPU processes (gloo).

Parity: the same requests, same config, give the same greedy tokens at TP=2 / PP=2 as the
in-process single-rank engine (and SmolLM2 at TP=3 as HF transformers) — with prefix caching,
chunked prefill and preemption all happening in the run (asserted, not hoped for). Robustness:
impossible splits fail at start-up before any process exists; a worker killed mid-run fails every
request with the reason within seconds; after shutdown no worker process or rendezvous port is left.

Each multiprocess engine costs a few seconds to start (workers forked from a forkserver join
the process groups and load the checkpoint): the tests share what they can and use the tiny checkpoints.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time

import pytest

from mini_vllm import LLM, SamplingParams
from mini_vllm.executor import MultiprocExecutor, UniProcExecutor
from processes import stop_process

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SMALL = dict(max_model_len=512, cpu_kernels="off", enforce_eager=True)


def assert_workers_gone(executor: MultiprocExecutor) -> None:
    """No worker process, and the rendezvous port can be bound again."""
    for pid in executor.worker_pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker pid {pid} outlived shutdown"
    port = int(executor.init_method.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: the closed store's connections may linger in TIME_WAIT (harmless); a socket
        # still LISTENING on the port makes the bind fail all the same.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    assert not multiprocessing.active_children()


@pytest.fixture
def parallel_llm(engine_registry):
    """parallel_llm(model_dir, **EngineConfig fields) -> LLM, registered for the end-of-test KV check;
    every one is shut down at the end of the test and checked to leave nothing behind."""
    made = []

    def make(model_dir, **kwargs):
        llm = LLM(str(model_dir), **{**SMALL, **kwargs})
        made.append(llm)
        engine_registry.append(llm)
        return llm
    yield make
    for llm in made:                       # every engine first: the check below looks at all processes
        llm.shutdown()
        engine_registry.remove(llm)
    for llm in made:
        executor = llm.llm_engine.engine_core.model_executor
        if isinstance(executor, MultiprocExecutor):
            assert_workers_gone(executor)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_engine_checkpoint, tiny_engine_models):
    """Llama with GQA (4 heads, 2 KV heads, 2 layers: the session's), and Qwen2 (q/k/v biases) with
    ONE KV head, so TP=2 must replicate it."""
    root = tmp_path_factory.mktemp("tiny-parallel")
    (root / "llama").symlink_to(tiny_engine_models["llama"][0])
    tiny_engine_checkpoint(root / "qwen2_mqa", "qwen2", seed=1, num_key_value_heads=1)
    return root


def shared_prefix_prompts(n: int = 6) -> list[list[int]]:
    """Token prompts of 40..90 tokens sharing a 48-token prefix (3 full blocks: prefix-cache hits)."""
    prefix = [(7 * i) % 4000 + 100 for i in range(48)]
    return [prefix + [(31 * i + 17 * j) % 4000 + 200 for j in range(5 * i)] for i in range(n)]


def trace(llm, prompts, params):
    """(token ids per prompt, [EngineCoreStep]), stepping by hand to see what the scheduler did."""
    engine, steps, finals = llm.llm_engine, [], {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps.append(engine.last_step)
    return [finals[f"r{i}"] for i in range(len(prompts))], steps


# Chunked prefill (a 64-token budget), a pool too small for everyone (preemption), shared prefixes.
STRESS = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=16, block_size=16,
              enable_prefix_caching=True)


def test_tp2_matches_one_rank_with_prefix_caching_chunked_prefill_and_preemption(parallel_llm, tiny_models):
    prompts = shared_prefix_prompts()
    ref_outs, ref_steps = trace(parallel_llm(tiny_models / "llama", **STRESS), prompts, GREEDY)
    llm = parallel_llm(tiny_models / "llama", tensor_parallel_size=2, **STRESS)
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, MultiprocExecutor) and len(executor.worker_pids) == 2
    outs, steps = trace(llm, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref_outs]
    # The run exercised what it claims to: chunks, preemptions, prefix-cache hits.
    assert any(s.scheduler_output.preempted_req_ids for s in steps), "no preemption happened"
    assert any(0 < n < len(p) for s in steps for n in s.scheduler_output.num_scheduled_tokens.values()
               for p in prompts[:1]), "no prompt was chunked"
    assert sum(o.num_cached_tokens for o in outs) > 0, "no prefix-cache hit"
    # Each rank holds half of the 2 KV heads, in the same number of blocks (the scheduler's block ids).
    per_layer = executor.collective_rpc("kv_cache_shapes")
    assert per_layer == [[(16, 16, 1, 16)] * 2] * 2


def test_tp2_replicates_a_single_kv_head_then_survives_a_dead_worker(parallel_llm, tiny_models):
    """Qwen2 with 4 query heads and 1 KV head at TP=2: each rank keeps a copy of the KV head and the
    tokens are the single rank's. Then rank 1 is killed mid-run: every request fails with the reason,
    within seconds, the engine refuses new ones, and shutdown leaves no process or port behind."""
    prompts = shared_prefix_prompts(3)
    ref = parallel_llm(tiny_models / "qwen2_mqa").generate(prompts, GREEDY, use_tqdm=False)
    llm = parallel_llm(tiny_models / "qwen2_mqa", tensor_parallel_size=2, execute_model_timeout_s=30)
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    executor = llm.llm_engine.engine_core.model_executor
    assert [s[0][2] for s in executor.collective_rpc("kv_cache_shapes")] == [1, 1]

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    engine.step()
    os.kill(executor.worker_pids[1], signal.SIGKILL)
    t0, finished = time.monotonic(), {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0]
        assert time.monotonic() - t0 < 20, "the engine did not give up on a dead worker"
    print(f"dead worker noticed in {time.monotonic() - t0:.2f} s")
    assert sorted(finished) == ["d0", "d1", "d2"]
    assert {o.finish_reason for o in finished.values()} == {"error"}
    assert all("rank 1" in str(o.stop_reason) for o in finished.values()), finished["d0"].stop_reason
    with pytest.raises(RuntimeError, match="cannot run requests any more"):
        engine.add_request("late", "hello", params)
    llm.shutdown()
    assert_workers_gone(executor)


def test_pp2_matches_one_rank_then_gives_up_on_a_hung_stage(parallel_llm, tiny_models):
    prompts = shared_prefix_prompts(4)
    ref = parallel_llm(tiny_models / "llama", **STRESS).generate(prompts, GREEDY, use_tqdm=False)
    llm = parallel_llm(tiny_models / "llama", pipeline_parallel_size=2, execute_model_timeout_s=3, **STRESS)
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    executor = llm.llm_engine.engine_core.model_executor
    shapes = executor.collective_rpc("kv_cache_shapes")
    assert shapes == [[(16, 16, 2, 16)], [(16, 16, 2, 16)]]               # one layer (all its KV heads) per stage

    # Stage 1 stops answering (SIGSTOP: alive, silent): the step is given up after the 3 s timeout.
    stop_process(executor.worker_pids[1])
    t0 = time.monotonic()
    out = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in out} == {"error"}
    assert "within 3 s: the workers are hung" in str(out[0].outputs[0].stop_reason) and time.monotonic() - t0 < 10


def test_pp2_micro_batches_overlap_never_share_a_request_and_match_lockstep(parallel_llm, tiny_models):
    """Pipeline micro-batches (max_concurrent_batches = 2 by default at PP=2): batches really are in
    flight two at a time, a request in both only to continue its prompt (a chunk whose predecessor
    every stage runs first), and the greedy tokens are the single rank's and the lockstep pipeline's
    (max_concurrent_batches=1) — with chunks, preemptions and prefix-cache hits in the run. n > 1
    (children from the front end) gives the lockstep pipeline's seeded samples."""
    prompts = shared_prefix_prompts(8)
    ref, _ = trace(parallel_llm(tiny_models / "llama", **STRESS), prompts, GREEDY)
    lockstep_llm = parallel_llm(tiny_models / "llama", pipeline_parallel_size=2, max_concurrent_batches=1, **STRESS)
    lockstep, _ = trace(lockstep_llm, prompts, GREEDY)
    llm = parallel_llm(tiny_models / "llama", pipeline_parallel_size=2, **STRESS)
    core = llm.llm_engine.engine_core
    assert core.batch_queue_size == 2
    executor, launches = core.model_executor, []
    send = executor.execute_model_async

    def spy(so):
        in_flight = {r for queued, _, _ in core.batch_queue for r in queued.num_scheduled_tokens}
        # Requests scheduled again while in flight: only ones still in their prompt (Δ ends before it).
        prefill = {r.req_id for r in so.scheduled_new_reqs} | {
            r for r, n in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens)
            if n < len(core.scheduler.requests[r].prompt_token_ids)}
        launches.append((in_flight, set(so.num_scheduled_tokens) - prefill))
        return send(so)
    executor.execute_model_async = spy
    outs, steps = trace(llm, prompts, GREEDY)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in lockstep]
    overlapped = [(a, b) for a, b in launches if a and b]
    assert overlapped and core.num_batches_overlapped >= len(overlapped), "no two batches were ever in flight"
    assert all(not a & b for a, b in launches), "a request was scheduled while in flight"
    assert len(overlapped) > len(launches) // 3, f"only {len(overlapped)} of {len(launches)} batches overlapped"
    assert any(s.scheduler_output.preempted_req_ids for s in steps), "no preemption happened"
    assert sum(o.num_cached_tokens for o in outs) > 0, "no prefix-cache hit"
    assert any(0 < n < len(p) for s in steps for n in s.scheduler_output.num_scheduled_tokens.values()
               for p in prompts[:1]), "no prompt was chunked"
    assert not core.batch_queue and executor.collective_rpc("kv_cache_shapes")
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    children = [[c.token_ids for c in llm_.generate(prompts[:2], sampled, use_tqdm=False)[1].outputs]
                for llm_ in (llm, lockstep_llm)]
    assert children[0] == children[1] and len({tuple(t) for t in children[0]}) > 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "use 'mp'"),
    (dict(pipeline_parallel_size=2, max_concurrent_batches=3), "in 1..pipeline_parallel_size"),
    (dict(tensor_parallel_size=0), "positive integer"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2}),
     "which live on pipeline stage 0"),
])
def test_impossible_splits_fail_at_start_up_without_a_process(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_models / "llama"), **{**SMALL, **kwargs})
    assert not multiprocessing.active_children()


def test_ray_backend_without_ray_is_refused_naming_the_package(tiny_models, monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match="needs the ray package"):
        LLM(str(tiny_models / "llama"), distributed_executor_backend="ray", **SMALL)


def _descendants() -> set[int]:
    """Every live process below this one (read from /proc: Ray starts a tree of them)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def test_ray_executor_pp2_micro_batches_match_one_rank_and_leave_nothing(parallel_llm, tiny_models):
    """distributed_executor_backend="ray": one actor per stage on a local Ray instance the executor
    starts; the pipeline's micro-batches work through it (actors keep call order), the greedy tokens
    are the single rank's, and shutdown stops the actors and the Ray instance (no process left)."""
    from mini_vllm.executor.ray_executor import RayDistributedExecutor, _import_ray, ray_available
    if ray_available():
        pytest.skip(ray_available())
    ray = _import_ray()                  # (a plain `import ray` would change os.environ)
    prompts = shared_prefix_prompts(6)
    ref = parallel_llm(tiny_models / "llama", **STRESS).generate(prompts, GREEDY, use_tqdm=False)
    before = _descendants()
    llm = parallel_llm(tiny_models / "llama", pipeline_parallel_size=2, distributed_executor_backend="ray", **STRESS)
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, RayDistributedExecutor) and ray.is_initialized()
    pids = executor.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.llm_engine.engine_core.num_batches_overlapped > 0
    assert executor.collective_rpc("kv_cache_shapes") == [[(16, 16, 2, 16)], [(16, 16, 2, 16)]]
    llm.shutdown()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 20
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _descendants() - before, f"processes left behind: {sorted(_descendants() - before)}"


def test_smollm2_tp2_is_refused_9_heads(smollm2_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 9 attention heads"):
        LLM(str(smollm2_dir), tensor_parallel_size=2, **SMALL)
    assert not multiprocessing.active_children()


def test_one_rank_is_the_in_process_executor(tiny_models, make_llm):
    llm = make_llm(tiny_models / "llama", cpu_kernels="off")
    core = llm.llm_engine.engine_core
    assert isinstance(core.model_executor, UniProcExecutor) and core.model_runner is core.model_executor.model_runner


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_tp3_matches_hf(parallel_llm, smollm2_dir, smollm2_hf, smollm2_tokenizer, hf_oracle):
    """SmolLM2 (9 heads, 3 KV heads) split over 3 ranks: 3 query heads and 1 KV head each."""
    hf_greedy, assert_same_greedy = hf_oracle
    prompts = [smollm2_tokenizer(p).input_ids for p in ("The capital of France is",)]
    llm = parallel_llm(smollm2_dir, tensor_parallel_size=3, max_model_len=256, num_gpu_blocks_override=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    eos = llm.llm_engine.model_config.eos_token_ids
    for prompt, out in zip(prompts, outs):
        assert_same_greedy(out.outputs[0].token_ids, hf_greedy(smollm2_hf, prompt, 10), 10, eos, "tp=3")
    shapes = llm.llm_engine.engine_core.model_executor.collective_rpc("kv_cache_shapes")
    assert {s[0][2] for s in shapes} == {1} and all(len(s) == 30 for s in shapes)
