"""Executor: the one seam between the engine core and however many model ranks there are.

Mirrors vLLM v1's `vllm/v1/executor/abstract.py: Executor` (`get_class`, `initialize_from_config`,
`execute_model`, `collective_rpc`, `check_health`, `shutdown`). The EngineCore schedules once per
step and hands the SchedulerOutput to its executor; the executor gets it to every rank and returns
the one ModelRunnerOutput the scheduler needs. Which executor runs is
`EngineConfig.distributed_executor_backend`:

    "uni"  UniProcExecutor     one Worker in the engine's process: a step is a function call
    "mp"   MultiprocExecutor   one Worker process per rank; torch.distributed between the ranks
    "ray"  RayDistributedExecutor  one Ray actor per rank (Ray places them; optional package)
"""
from __future__ import annotations

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig


class ExecutorError(RuntimeError):
    """The workers cannot run any more (a rank died, hung or raised): every request must fail."""


class FutureOutput:
    """A step in flight: `result()` waits for its ModelRunnerOutput (or raises ExecutorError), once."""

    def __init__(self, wait):
        self._wait, self._done, self._value = wait, False, None

    def result(self):
        if not self._done:
            self._value, self._done = self._wait(), True
        return self._value


def get_output(value):
    """A runner's output, waited for: async scheduling's AsyncModelRunnerOutput (model_runner.py)
    holds the sampled tokens' device-to-host copy in flight until `get_output()`."""
    return value.get_output() if hasattr(value, "get_output") else value


class Executor:
    """Subclasses implement collective_rpc (run a Worker method on every rank) and shutdown."""

    # The model runner in this process, if the executor has one (UniProcExecutor): what the
    # notebook and the tests inspect. The engine itself reaches the runners only through calls.
    model_runner = None

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel_config.executor_backend
        if backend == "uni":
            from mini_vllm.executor.uniproc_executor import UniProcExecutor
            return UniProcExecutor
        if backend == "ray":
            from mini_vllm.executor.ray_executor import RayDistributedExecutor
            return RayDistributedExecutor
        from mini_vllm.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config, self.model_config = config, model_config
        self.parallel_config = config.parallel_config
        self.parallel_config.verify_with_model_config(model_config)
        # What the engine sizes the KV pool by: the largest rank's cache (parallel_config.py).
        self.kv_cache_spec = self.parallel_config.kv_cache_spec(model_config, config.block_size)
        self._init_executor()

    def _init_executor(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        """Call Worker.`method`(*args) on every rank; the list of their results, or only
        `unique_reply_rank`'s result."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what the engine core calls
    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks, num_cpu_blocks))

    def profile_run(self) -> None:
        self.collective_rpc("profile_run")

    def capture_model(self) -> None:
        self.collective_rpc("capture_model")

    # ------------------------------------------------------------------ the KV connector (chapter 06)
    kv_output_aggregator = None

    def init_kv_connector(self, kv_transfer_config, spec, node_id: str) -> list[str | None]:
        """A worker-side connector in every rank, registered with that rank's K/V; returns each
        rank's handshake (side channel address), in rank order, for the scheduler half. From now on
        every rank's step report is gathered and joined (`KVOutputAggregator`)."""
        from global_prefix_cache.connector import KVOutputAggregator
        self.kv_output_aggregator = KVOutputAggregator(self.parallel_config.world_size)
        return self.collective_rpc("init_kv_connector", (kv_transfer_config, spec, node_id))

    @property
    def reply_rank(self) -> int | None:
        """Whose step output the engine reads: the output rank's alone, or — with a KV connector,
        whose every rank reports its own loads and saves — every rank's (None)."""
        return None if self.kv_output_aggregator is not None else self.output_rank

    def _step_output(self, outputs: list):
        """The step's one ModelRunnerOutput from the replies of `reply_rank`: the output rank's,
        with the ranks' KV connector reports joined into it."""
        if self.kv_output_aggregator is None:
            return outputs[0]
        output = outputs[self.output_rank]
        kv = self.kv_output_aggregator.aggregate([o.kv_connector_output for o in outputs])
        output.finished_recving, output.finished_sending = kv.finished_recving, kv.finished_sending
        output.invalid_block_ids, output.kv_connector_output = kv.invalid_block_ids, kv
        return output

    def execute_model(self, scheduler_output):
        """Every rank runs the step; the output comes from the rank that sampled last (the last
        pipeline stage's first TP rank; every TP rank sampled the same tokens)."""
        replies = self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=self.reply_rank)
        return self._step_output([get_output(r) for r in (replies if self.reply_rank is None else [replies])])

    def execute_model_async(self, scheduler_output) -> "FutureOutput":
        """Start the step and return at once; `.result()` waits for its output (vLLM:
        execute_model(non_block=True) -> Future). Here the base class runs it now: one rank has
        nothing to overlap. The multiprocess executor only sends it (the workers' pipes keep the
        order), so the engine can schedule the next micro-batch while the stages run this one."""
        try:
            value = self.execute_model(scheduler_output)
        except ExecutorError as error:
            def fail():
                raise error
            return FutureOutput(fail)
        return FutureOutput(lambda: value)

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine may have in flight (vLLM's property of the same name): two
        with async scheduling (step N runs while N+1 is planned and sent)."""
        if self.config.async_scheduling:
            return 2
        pc = self.parallel_config
        return pc.max_concurrent_batches if pc.executor_backend in ("mp", "ray") else 1

    @property
    def output_rank(self) -> int:
        pc = self.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def wait_in_flight(self) -> None:
        """Return once every step sent so far has run (their outputs are still the engine's to
        take). Steps run in the caller's thread here: nothing is ever in flight."""

    def check_health(self) -> None:
        """Raise ExecutorError if a rank is gone."""

    def shutdown(self) -> None:
        raise NotImplementedError
