"""Worker: one rank — its place in the process groups, its shard of the model, its KV cache, its steps.

Mirrors vLLM v1's `vllm/v1/worker/gpu_worker.py: Worker` (`init_device` -> `init_worker_distributed_environment`,
`load_model`, `get_kv_cache_spec`, `initialize_from_config`, `execute_model`). An executor owns the
workers: UniProcExecutor one, in the engine's process; MultiprocExecutor one per process.

Every rank runs the WHOLE model runner each step — the same scheduler output, the same persistent
batch, the same sampler seeded the same way — and differs only in which slice of each weight and
which heads' K/V it holds (tensor parallel) or which layers (pipeline parallel). The collectives
inside the model (all-reduce after each row-parallel linear, the logits' all-gather, the stage
hand-offs) keep the ranks' activations identical where they must be, so every rank samples the
same token and the ranks' block tables, counters and batches never drift apart: the scheduler's
one decision per step is all the coordination needed ([Kwon 2025, §3.4.6]: one scheduler, block tables
broadcast, each worker holding its heads' K/V).
"""
from __future__ import annotations

import dataclasses

import logging
import os
import time

import torch

from model_executor import parallel_state

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.models.llama import get_pp_indices

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0,
                 distributed_init_method: str | None = None):
        self.config, self.model_config = config, model_config
        self.parallel_config = config.parallel_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.model_runner = None
        # Time inside execute_model (the pipeline bubble is what is NOT spent computing: bench_parallel).
        self.execute_calls, self.execute_seconds = 0, 0.0

    # ------------------------------------------------------------------ set-up
    def init_device(self) -> None:
        """Join the process groups (more than one rank only). On a CPU the cores are shared out:
        N ranks each running all cores would fight over them, so each gets cores / N threads
        (vLLM's CPU worker binds each rank to its own cores for the same reason)."""
        pc = self.parallel_config
        if pc.world_size == 1:
            return                                   # the single-rank groups of parallel_state: nothing to join
        device = self.config.resolved_device
        if device.type == "cuda":
            if torch.cuda.device_count() < pc.world_size:
                raise ValueError(f"{pc.world_size} ranks need {pc.world_size} GPUs, this machine has "
                                 f"{torch.cuda.device_count()}")
            torch.cuda.set_device(self.rank)
            self.config.device = f"cuda:{self.rank}"
            backend = "nccl"
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.world_size))
            backend = "gloo"
        # The collectives' own timeout is only a backstop (the engine gives up on a step after
        # execute_model_timeout_s and stops every worker); it also bounds the rendezvous, where ranks
        # spawned seconds apart meet — hence never below two minutes.
        parallel_state.init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method, backend,
                                                    timeout_s=max(self.config.execute_model_timeout_s, 120.0))
        parallel_state.initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def load_model(self) -> None:
        """Build the model runner: the model's layers read the groups above and build this rank's
        shard; the loader cuts this rank's slices out of the checkpoint."""
        from mini_vllm.model_runner import ModelRunner
        self.model_runner = ModelRunner(self.config, self.model_config)
        # This rank's KV cache: its heads and its stage's layers (the runner's default is the whole model's).
        self.model_runner.kv_cache_spec = self.get_kv_cache_spec()

    def get_kv_cache_spec(self):
        """[num_blocks, block_size, KVH / tp (or 1), head_dim (+ an 8-bit row's scale)] per layer, for
        this stage's layers."""
        pp = parallel_state.get_pp_group()
        spec = self.parallel_config.kv_cache_spec(self.model_config, self.config.block_size)
        start, end = get_pp_indices(self.model_config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        return dataclasses.replace(spec, num_layers=end - start)

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The same number of blocks on every rank: the scheduler's block ids mean the same slot everywhere."""
        self.model_runner.initialize_kv_cache(num_blocks, num_cpu_blocks)

    def profile_run(self) -> None:
        self.model_runner.profile_run()

    def capture_model(self) -> None:
        self.model_runner.capture_model()

    # ------------------------------------------------------------------ each step
    def execute_model(self, scheduler_output):
        t0 = time.perf_counter()
        try:
            output = self.model_runner.execute_model(scheduler_output)
        finally:
            self.execute_calls += 1
            self.execute_seconds += time.perf_counter() - t0
        # The runner turns an exception in the forward into per-request failures (one bad request must
        # not take the batch down); a failed collective is not that — a peer rank is gone. Raise, so
        # the executor fails the engine instead of this rank's requests one by one.
        failure = parallel_state.communication_failure()
        if failure is not None:
            raise RuntimeError(f"rank {self.rank}: {failure}")
        return output

    # ------------------------------------------------------------------ the KV connector (chapter 06)
    def init_kv_connector(self, kv_transfer_config, spec, node_id: str) -> str | None:
        """This rank's worker half of the connector, over this rank's K/V (its heads, its layers)."""
        return self.model_runner.init_kv_connector(kv_transfer_config, spec, self.rank, node_id)

    def has_pending_kv_loads(self) -> bool:
        return self.model_runner.has_pending_kv_loads()

    def get_kv_connector_stats(self) -> dict:
        return self.model_runner.get_kv_connector_stats()

    def kv_cache_shapes(self) -> list[tuple[int, ...]]:
        """Each local layer's K cache shape: what this rank actually holds (tests, the notebook)."""
        return [tuple(k.shape) for k, _ in self.model_runner.kv_caches]

    def comm_stats(self, reset: bool = False) -> dict:
        """This rank's collectives since the last reset: {group: {op: (calls, bytes, seconds)}}."""
        out = {}
        for name, group in (("tp", parallel_state.get_tp_group()), ("pp", parallel_state.get_pp_group())):
            st = group.stats
            out[name] = {op: (st.calls[op], st.bytes[op], st.seconds[op]) for op in st.calls}
            if reset:
                group.stats = parallel_state.CommStats()
        return out

    def busy_stats(self, reset: bool = False) -> dict:
        """This rank's steps since the last reset: execute_model calls and seconds, and the seconds of
        those spent blocked in pipeline hand-offs (recv, send, the logits' broadcast) — waiting for
        another stage, not computing."""
        pp = parallel_state.get_pp_group().stats
        out = {"execute_calls": self.execute_calls, "execute_s": self.execute_seconds,
               "pp_wait_s": sum(pp.seconds[op] for op in ("recv", "send", "broadcast") if op in pp.seconds)}
        if reset:
            self.execute_calls, self.execute_seconds = 0, 0.0
            self.comm_stats(reset=True)
        return out

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown_kv_connector()      # its servers and threads, and it leaves the pool
        if self.parallel_config.world_size > 1:
            parallel_state.destroy_model_parallel()
