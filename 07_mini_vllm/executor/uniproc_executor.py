"""UniProcExecutor: one Worker, in the engine's own process (vLLM: vllm/v1/executor/uniproc_executor.py).

The single-device engine as it always was: the Worker's model runner is an attribute of this
process, a step is a method call, and nothing touches torch.distributed (the parallel layers see
parallel_state's single-rank groups and are chapter 01's plain layers).
"""
from __future__ import annotations

from mini_vllm.executor.abstract import Executor
from mini_vllm.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, self.model_config, rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.model_runner = self.driver_worker.model_runner
        self.attn_backend = self.model_runner.attn_backend

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        result = getattr(self.driver_worker, method)(*args)
        return result if unique_reply_rank is not None else [result]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
