"""schedule() must stay O(running requests): the thesis [Kwon 2025, §4.6] counts 1 ms of CPU per step as
a 10% loss on a 10 ms GPU step. Timing on a shared CPU is noisy, so this compares the
thread CPU time of the FASTEST of several steps at 128 and at 1024 running requests: linear
growth gives 8x, a quadratic loop 64x. (Numbers: `python -m benchmarks.bench_scheduler`.)"""
import time

from kvcache import KVCacheManager
from scheduler import MockModelRunner, Request, Scheduler, SchedulerConfig


def fastest_schedule_time(num_running: int, iters: int = 12) -> float:
    s = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=8192, max_model_len=8192),
                  KVCacheManager(num_running * 8, 16, enable_caching=False))
    runner = MockModelRunner()
    for i in range(num_running):
        s.add_request(Request(f"r{i}", list(range(i, i + 20)), max_tokens=10_000, ignore_eos=True))
    best = float("inf")
    for step in range(iters + 4):
        t0 = time.thread_time()
        out = s.schedule()
        elapsed = time.thread_time() - t0
        if step >= 4:                          # every request decoding by now
            assert len(out.num_scheduled_tokens) == num_running
            best = min(best, elapsed)
        s.update_from_output(out, runner.execute(s.requests, out))
    return best


def test_schedule_cpu_time_grows_linearly():
    small, large = fastest_schedule_time(128), fastest_schedule_time(1024)
    assert large / small < 24, f"128 -> 1024 running requests: {small * 1e3:.2f} -> {large * 1e3:.2f} ms per step"
