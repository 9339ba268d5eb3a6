"""The scheduler's LoRA rule (lora_scheduler.py, vLLM's `scheduled_loras` check) on the engine's composed
scheduler with chapter 03's mock model: at most max_loras distinct adapters among the requests a step
runs; a request of one adapter too many is passed over, keeps its place, and goes once a slot frees;
the base model's requests never count."""
from __future__ import annotations

from kvcache import BlockSpaceManager
from scheduler import SchedulerConfig
from scheduler_workloads import req, step

from mini_vllm.engine_scheduler import make_scheduler
from mini_vllm.lora_request import LoRARequest


def adapter(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def scheduler(max_loras):
    kv = BlockSpaceManager(64, 4, enable_caching=True)
    return make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv,
                          max_loras=max_loras)


LORA_OF = {"a": 1, "b": 2, "c": 3, "d": 1, "e": None}


def adapters_of(out) -> set[int]:
    return {LORA_OF[r] for r in out.num_scheduled_tokens} - {None}


def test_one_adapter_too_many_waits_without_blocking_the_queue():
    s = scheduler(max_loras=2)
    max_tokens = {"a": 6, "b": 2, "c": 3, "d": 6, "e": 6}
    for rid, lora in LORA_OF.items():
        s.add_request(req(rid, 4, max_tokens=max_tokens[rid], lora_request=adapter(lora) if lora else None))
    out, _ = step(s)
    # c (a third adapter) is passed over; d (adapter 1, already running) and e (the base) go past it.
    assert set(out.num_scheduled_tokens) == {"a", "b", "d", "e"}
    assert [r.request_id for r in s.waiting] == ["c"]
    admitted_at, n = None, 1
    while s.has_unfinished_requests():
        out, _ = step(s)
        n += 1
        assert len(adapters_of(out)) <= 2, f"step {n} ran adapters {adapters_of(out)}"
        if admitted_at is None and "c" in out.num_scheduled_tokens:
            admitted_at = n
            assert "b" not in s.requests           # adapter 2's only request finished: its slot freed
    assert admitted_at is not None


def test_without_lora_there_is_no_rule():
    s = scheduler(max_loras=None)
    for i in range(1, 5):
        s.add_request(req(f"r{i}", 4, lora_request=adapter(i)))
    out, _ = step(s)
    assert len(out.num_scheduled_tokens) == 4


def test_one_adapter_a_step_runs_the_base_model_beside_it_and_every_request_finishes():
    """max_loras=1 over a queue that alternates two adapters and the base model: each step runs one
    adapter at most; the base model's requests run beside it from the first step; adapter 2's requests
    wait, keep their places, and run once adapter 1's are done; every request finishes."""
    s = scheduler(max_loras=1)
    lora_of = {f"r{i}": (1, 2, None)[i % 3] for i in range(6)}
    for rid, lora in lora_of.items():
        s.add_request(req(rid, 4, max_tokens=3, lora_request=adapter(lora) if lora else None))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r2", "r3", "r5"}
    assert [r.request_id for r in s.waiting] == ["r1", "r4"]
    for n in range(2, 40):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        adapters = {lora_of[r] for r in out.num_scheduled_tokens} - {None}
        assert len(adapters) <= 1, f"step {n} ran adapters {adapters} with max_loras=1"
        if 2 in adapters:
            assert "r0" not in s.requests and "r3" not in s.requests   # adapter 1 gave its slot up
    assert not s.has_unfinished_requests()
