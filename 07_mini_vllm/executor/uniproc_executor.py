"""UniProcExecutor: one Worker, in the engine's own process (vLLM: vllm/v1/executor/uniproc_executor.py).

The single-device engine as it always was: the Worker's model runner is an attribute of this
process, a step is a method call, and nothing touches torch.distributed (the parallel layers see
parallel_state's single-rank groups and are chapter 01's plain layers).

With async scheduling the step runs in one worker thread (vLLM's UniProcExecutor does the same
with max_concurrent_batches > 1): `execute_model_async` returns at once and the engine core
schedules the next step while this one runs. On a GPU the forward is queued on the device
anyway; on a CPU the thread IS the overlap — torch's kernels and this project's C++ ones release
the GIL while they compute. One thread: the steps run in the order they were sent, which is what
lets the scheduler free or reuse blocks a step in flight still writes.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from mini_vllm.executor.abstract import Executor, FutureOutput, get_output
from mini_vllm.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, self.model_config, rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.model_runner = self.driver_worker.model_runner
        self.attn_backend = self.model_runner.attn_backend
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="execute_model")
                        if self.config.async_scheduling else None)

    def execute_model_async(self, scheduler_output) -> FutureOutput:
        """Async scheduling: the step goes to the worker thread; `.result()` waits for it, then for
        its sampled tokens' host copy (`get_output`), and nothing before."""
        if self._thread is None:
            return super().execute_model_async(scheduler_output)
        future = self._thread.submit(self.driver_worker.execute_model, scheduler_output)

        def wait():
            return self._step_output([get_output(future.result())])
        return FutureOutput(wait)

    def wait_in_flight(self) -> None:
        """One worker thread runs the steps in order: once a no-op sent after them has run, they
        have all run (without taking their outputs)."""
        if self._thread is not None:
            self._thread.submit(lambda: None).result()

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        result = getattr(self.driver_worker, method)(*args)
        return result if unique_reply_rank is not None else [result]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.driver_worker.shutdown()
