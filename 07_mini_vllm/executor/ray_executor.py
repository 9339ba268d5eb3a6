"""RayDistributedExecutor: one Ray actor per rank — the multiprocess executor's job, with Ray placing the processes.

Mirrors vLLM's `vllm/v1/executor/ray_distributed_executor.py` (`RayDistributedExecutor`,
`RayWorkerWrapper`, `_run_workers`): the engine calls a Worker method on every rank by calling
that method on every actor and `ray.get`-ting the replies. What Ray adds over `mp` is WHERE the
workers run: a Ray cluster places each actor on a node with room for it, so the ranks may span
machines (vLLM's multi-node tensor / pipeline parallelism). Here, on one machine, the local Ray
instance is started by the executor if none is running (and stopped by it); the ranks still talk
to each other with torch.distributed (gloo on CPU, NCCL on GPU), rank 0 serving the rendezvous.

Ordering is what makes pipeline micro-batches work unchanged: a Ray actor runs the calls of one
caller in the order they were made, like the worker's pipe under `mp`, so `execute_model_async`
just returns the output rank's ObjectRef.

Failure: a reply that does not come within `execute_model_timeout_s`, an actor that died, or a
Worker method that raised, fails the executor (ExecutorError): every actor is killed, and the
engine fails every request with the message.
"""
from __future__ import annotations

import logging
import os

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.executor.abstract import Executor, ExecutorError, FutureOutput
from mini_vllm.executor.multiproc_executor import STARTUP_TIMEOUT_S, _free_port

logger = logging.getLogger(__name__)


def _import_ray():
    """`import ray`, leaving this process's environment as it was: ray sets RAY_CLIENT_MODE when it is
    imported, and every process started later would inherit it."""
    saved = dict(os.environ)
    try:
        import ray
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ray


def ray_available() -> str | None:
    """None if `ray` imports, else why not (the message a refused config carries)."""
    try:
        _import_ray()
    except ImportError as e:
        return f"distributed_executor_backend='ray' needs the ray package (pip install ray): {e}"
    return None


class RayWorkerWrapper:
    """The actor: a Worker built inside the actor's process (vLLM: RayWorkerWrapper.execute_method)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int, init_method: str):
        from mini_vllm.worker import Worker
        self.worker = Worker(config, model_config, rank, init_method)

    def execute_method(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def pid(self) -> int:
        return os.getpid()


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        ray = _import_ray()
        from mini_vllm.model_runner import ModelRunner
        self.attn_backend = ModelRunner._attention_backend(self.config, self.model_config)
        self.world_size = self.parallel_config.world_size
        self.timeout_s = float(self.config.execute_model_timeout_s)
        self.failure: str | None = None
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # A local instance for this engine: no dashboard, and no auth token written to the home
            # directory. RAY_AUTH_MODE is read by the processes ray.init starts, and ray.init itself sets
            # variables of its own (PYTHONBREAKPOINT, RAY_USAGE_STATS_ENABLED, ...): this process's
            # environment is put back as it was, so nothing started later inherits them.
            saved = dict(os.environ)
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            try:
                ray.init(include_dashboard=False, log_to_driver=False,
                         num_cpus=max(os.cpu_count() or 1, self.world_size))
            finally:
                os.environ.clear()
                os.environ.update(saved)
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        actor_cls = ray.remote(num_cpus=0)(RayWorkerWrapper)
        self.actors = [actor_cls.remote(self.config, self.model_config, rank, self.init_method)
                       for rank in range(self.world_size)]
        try:
            self.pids = self._get([a.pid.remote() for a in self.actors], "start-up", STARTUP_TIMEOUT_S)
            self._get([a.execute_method.remote("init_device") for a in self.actors], "init_device", STARTUP_TIMEOUT_S)
            self._get([a.execute_method.remote("load_model") for a in self.actors], "load_model", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("RayDistributedExecutor: %d actors (tp=%d, pp=%d), pids %s", self.world_size,
                    self.parallel_config.tensor_parallel_size, self.parallel_config.pipeline_parallel_size, self.pids)

    def _get(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        """ray.get with the step timeout; any failure fails the executor (every actor killed)."""
        import ray
        try:
            return ray.get(refs, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"no reply to {what} within {self.timeout_s if timeout_s is None else timeout_s:g} s: "
                       "the workers are hung")
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            self._fail(f"a worker failed in {what}: {e}")

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        if self.failure is not None:
            raise ExecutorError(self.failure)
        refs = [a.execute_method.remote(method, *args) for a in self.actors]
        if unique_reply_rank is not None:
            return self._get([refs[unique_reply_rank]], method)[0]
        return self._get(refs, method)

    def execute_model_async(self, scheduler_output) -> FutureOutput:
        """Every actor gets the call now; the reply rank's reply (every rank's, with a KV connector) is
        awaited later (actors keep call order)."""
        if self.failure is not None:
            raise ExecutorError(self.failure)
        refs = [a.execute_method.remote("execute_model", scheduler_output) for a in self.actors]
        if self.reply_rank is not None:
            refs = [refs[self.reply_rank]]
        return FutureOutput(lambda: self._step_output(self._get(refs, "execute_model")))

    def _fail(self, message: str):
        self.failure = f"the ray executor failed: {message}"
        logger.error("%s", self.failure)
        self._kill_actors()
        raise ExecutorError(self.failure)

    def check_health(self) -> None:
        if self.failure is not None:
            raise ExecutorError(self.failure)

    @property
    def worker_pids(self) -> list[int]:
        return list(getattr(self, "pids", []))

    def _kill_actors(self) -> None:
        import ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:            # noqa: BLE001 - already dead
                pass
        self.actors = []

    def shutdown(self) -> None:
        """Leave the process groups (asked, bounded), kill the actors, and stop Ray if this executor started it."""
        import ray
        if getattr(self, "actors", None) and self.failure is None:
            try:
                ray.get([a.execute_method.remote("shutdown") for a in self.actors], timeout=10)
            except Exception:            # noqa: BLE001 - they are killed next either way
                pass
        self._kill_actors()
        if getattr(self, "started_ray", False) and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False
