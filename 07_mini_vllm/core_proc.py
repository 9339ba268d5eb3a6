"""EngineCoreProc: the engine core in its own OS process, stepping in a busy loop.

Mirrors vLLM v1's `vllm/v1/engine/core.py: EngineCoreProc` (`run_engine_core`,
`run_busy_loop`, `_process_input_queue`, `_process_engine_step`). Why a process of its own:
the front end (tokenizing, detokenizing, HTTP, streaming) is Python that holds the GIL; in the
same process it would steal the time between two forward passes. In its own process the core
goes from one step to the next without waiting for the front end, and the front end turns the
previous step's tokens into text meanwhile.

    front end (AsyncLLM / LLMEngine)                 core process (this file)
      Processor: text -> EngineCoreRequest  --ZMQ PUSH/PULL-->  EngineCore.add_request
      OutputProcessor: ids -> RequestOutput <--ZMQ PUSH/PULL--  EngineCore.step() -> EngineCoreOutputs

The loop: block on the input socket while the scheduler has nothing to do; otherwise take
every message that is already there (never wait) and run one step. A step's outputs go back
only when it has something to say (tokens, errors, newly scheduled requests, preemptions);
aborts and stop-string finishes answer with the scheduler's gauges alone, so the front end's
metrics never show a request that is gone.

The process is started through `processes.ChildProcess` (forkserver, bounded close): the
pipe carries the start-up handshake and the stop command, ZMQ carries requests and outputs.
A front end that dies closes the pipe: the core sees EOF and exits instead of running on.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from scheduler import RequestStatus

from mini_vllm.core import EngineCore, EngineCoreStep
from mini_vllm.engine_messages import (EngineCoreOutputs, EngineCoreRequestType, EngineDead, SchedulerStats,
                                       UtilityOutput, decode, encode)
from mini_vllm.gc_utils import freeze_gc_heap

logger = logging.getLogger(__name__)

# EngineCore methods the front end may call through EngineCoreRequestType.UTILITY (vLLM: call_utility).
UTILITY_METHODS = frozenset({"check_invariants", "reset_prefix_cache", "cpu_time", "kv_cache_stats", "sleep"})


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_address: str, output_address: str, conn) -> None:
        self.core = core
        self.conn = conn                                  # the parent's pipe: stop, or EOF when it died
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_address)
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        self.poller.register(conn.fileno(), zmq.POLLIN)
        self.stopped = False
        self.num_preemptions = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ the loop
    def run_busy_loop(self) -> None:
        while not self.stopped:
            self._process_input_queue()
            if not self.stopped and self.core.scheduler.has_unfinished_requests():
                self._process_engine_step()

    def _process_input_queue(self) -> None:
        """Handle every message waiting; block for the next one only while there is nothing to step."""
        while not self.stopped:
            idle = not self.core.scheduler.has_unfinished_requests()
            events = dict(self.poller.poll(None if idle else 0))
            if not events:
                return
            if self.conn.fileno() in events:
                self._on_parent_message()
                continue
            changed = False
            while True:
                try:
                    frames = self.input_socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                changed |= self._handle_request(EngineCoreRequestType(frames[0]), decode(frames[1]))
            if changed:               # an abort/finish changed the gauges without a step: say so
                self._send(EngineCoreOutputs([], scheduler_stats=self._scheduler_stats()))

    def _on_parent_message(self) -> None:
        try:
            cmd, _ = self.conn.recv()
        except (EOFError, OSError):       # the front end is gone: nobody will read our outputs
            self.stopped = True
            return
        if cmd == "stop":
            self.stopped = True

    def _handle_request(self, kind: EngineCoreRequestType, payload) -> bool:
        """-> whether the scheduler's gauges changed without a step (abort, finish)."""
        core = self.core
        if kind == EngineCoreRequestType.ADD:
            try:
                core.add_request(payload)
            except Exception as e:                   # noqa: BLE001 - one bad request, reported to it alone
                self._send(EngineCoreOutputs([], errors={payload.request_id: f"{type(e).__name__}: {e}"},
                                             scheduler_stats=self._scheduler_stats()))
            return False
        if kind in (EngineCoreRequestType.ABORT, EngineCoreRequestType.FINISH):
            status = RequestStatus.FINISHED_ABORTED if kind == EngineCoreRequestType.ABORT else RequestStatus.FINISHED_STOPPED
            core.finish_requests(payload, status)
            return True
        call_id, method, args = payload
        try:
            if method not in UTILITY_METHODS:
                raise ValueError(f"{method!r} is not an engine core utility ({sorted(UTILITY_METHODS)})")
            result = getattr(self, "_utility_" + method)(*args)
            self._send(UtilityOutput(call_id, True, result))
        except Exception as e:                       # noqa: BLE001 - raised again in the caller
            self._send(UtilityOutput(call_id, False, f"{type(e).__name__}: {e}"))
        return False

    def _process_engine_step(self) -> None:
        step = self.core.step()               # raises only for a fault of the engine itself
        self.num_steps += 1
        self.num_preemptions += len(step.scheduler_output.preempted_req_ids)
        if step.outputs or step.errors or step.scheduler_output.scheduled_new_reqs or \
                step.scheduler_output.preempted_req_ids:
            self._send(self._make_outputs(step))

    def _make_outputs(self, step: EngineCoreStep) -> EngineCoreOutputs:
        so = step.scheduler_output
        return EngineCoreOutputs(step.outputs, step.logprobs, step.errors, step.prompt_logprobs,
                                 [r.req_id for r in so.scheduled_new_reqs], dict(so.num_scheduled_tokens),
                                 step.start_time, step.spec_decode, step.kv_transfer_params, self._scheduler_stats())

    def _scheduler_stats(self) -> SchedulerStats:
        kv = self.core.kv_cache_manager
        num_running, num_waiting = self.core.scheduler.get_request_counts()
        return SchedulerStats(num_running, num_waiting, kv.usage, kv.stats.queries, kv.stats.hits, self.num_preemptions)

    def _send(self, message) -> None:
        self.output_socket.send(encode(message), copy=False)

    # ------------------------------------------------------------------ utilities
    def _utility_check_invariants(self) -> None:
        self.core.check_invariants()

    def _utility_reset_prefix_cache(self) -> bool:
        return self.core.kv_cache_manager.reset_prefix_cache()

    def _utility_cpu_time(self) -> dict:
        """This process's CPU seconds, every thread (torch's included), its steps so far and its
        torch thread count: the IPC benchmark's meter (benchmarks/bench_engine_core_ipc.py)."""
        import torch
        return {"cpu_s": time.process_time(), "steps": self.num_steps, "torch_threads": torch.get_num_threads()}

    def _utility_kv_cache_stats(self) -> dict:
        kv = self.core.kv_cache_manager
        return {"num_blocks": kv.num_blocks, "num_free_blocks": kv.num_free_blocks}

    def _utility_sleep(self, seconds: float) -> None:
        """Keep the core busy for `seconds` (tests: a core that is slow to answer)."""
        time.sleep(seconds)

    def close(self) -> None:
        self.core.shutdown()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()


def run_engine_core(conn, kwargs: dict) -> None:
    """The child's entry point (ChildProcess target): build the core, report ("ok", info) on the
    pipe, then loop. A fault in the loop is sent as EngineDead before the process exits, so the
    front end fails its requests at once instead of waiting for a timeout."""
    # Ctrl-C reaches the whole process group, and `close()` sends SIGTERM: either one ends the core
    # through SystemExit (vLLM's `signal_handler` in run_engine_core), so the sockets close in
    # `finally` and the process exits 0 without a KeyboardInterrupt traceback on the terminal.
    def _exit_quietly(signum, frame):
        raise SystemExit()

    signal.signal(signal.SIGINT, _exit_quietly)
    signal.signal(signal.SIGTERM, _exit_quietly)
    proc = None
    try:
        if kwargs.get("num_threads"):
            import torch
            torch.set_num_threads(kwargs["num_threads"])
        core = EngineCore(kwargs["config"], kwargs["model_config"])
        proc = EngineCoreProc(core, kwargs["input_address"], kwargs["output_address"], conn)
    except Exception as e:                            # noqa: BLE001 - raised in the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        conn.close()
        return
    frozen = freeze_gc_heap()        # the start-up heap, out of the collector's walks (gc_utils.py)
    conn.send(("ok", {"pid": os.getpid(), "kv_cache_report": core.kv_cache_report, "gc_frozen_objects": frozen}))
    try:
        proc.run_busy_loop()
    except Exception as e:                            # noqa: BLE001 - the engine is broken: tell the front end
        logger.exception("engine core died")
        proc._send(EngineDead(f"{type(e).__name__}: {e}"))
        raise
    finally:
        proc.close()
        conn.close()
