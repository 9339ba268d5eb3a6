"""EngineCoreClient: how the front end talks to the engine core — a method call, or ZMQ.

Mirrors vLLM v1's `vllm/v1/engine/core_client.py` (`EngineCoreClient.make_client`,
`InprocClient`, `MPClient`, `SyncMPClient`, `AsyncMPClient`, `call_utility`):

    InprocClient   the EngineCore itself, in this process (the default: VLLM_ENABLE_V1_MULTIPROCESSING=0)
    SyncMPClient   the core in a child process (core_proc.py); blocking calls (LLMEngine, LLM)
    AsyncMPClient  the same over zmq.asyncio (AsyncLLM, the OpenAI server)

All three take EngineCoreRequests and hand back EngineCoreSteps that the OutputProcessor
reads, so LLMEngine does not know which it has. The in-process client is an EngineCore (a
subclass), so everything that inspects the core of an in-process engine (tests, notebooks:
`engine.engine_core.kv_cache_manager`) keeps working; a multiprocess core is reached only
through messages, and the few inspections tests need are utility calls.

A dead core (killed, or its step raised) is noticed within `DEAD_CHECK_S` by every waiting
call, which raises EngineDeadError instead of hanging.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from processes import ChildProcess
from scheduler import RequestStatus

from mini_vllm.core import EngineCore, EngineCoreStep
from mini_vllm.engine_messages import (EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, EngineDead,
                                       UtilityOutput, decode, encode)

ENV_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"   # vLLM's name; its default is 1, ours 0
SEND_TIMEOUT_S = 10.0      # a send the core does not take within this long: dead, or hopelessly behind
DEAD_CHECK_S = 0.5          # how often a waiting call checks that the core process is alive


def multiprocessing_enabled() -> bool:
    value = os.environ.get(ENV_MULTIPROCESSING, "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ValueError(f"{ENV_MULTIPROCESSING} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


def core_num_threads() -> int:
    """The torch thread count the core process should run with: this process's own. The core's
    process is forked from the forkserver, which never saw this process's torch.set_num_threads:
    without this, an engine asked to run on 1 thread (a benchmark on a shared machine, a rank
    given its share of the cores) would run its core on torch's default, every core. vLLM's CPU
    platform does the same through OMP_NUM_THREADS (`vllm/platforms/cpu.py: check_and_update_config`)."""
    import torch
    return torch.get_num_threads()


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can make progress (vLLM's EngineDeadError)."""


# ==================================================================== in process
class InprocClient(EngineCore):
    """The core in this process: a call is a call. `get_output()` is one step."""

    def get_output(self) -> EngineCoreStep:
        return self.step()

    def call_utility(self, method: str, *args):
        if method == "reset_prefix_cache":
            return self.kv_cache_manager.reset_prefix_cache()
        return getattr(self, method)(*args)


# ==================================================================== the front end's view of a remote step
@dataclass
class _NewRequestView:
    req_id: str


@dataclass
class SchedulerOutputView:
    """What the front end knows of the core's SchedulerOutput: which requests started and how
    many tokens each computed (the OutputProcessor stamps first-scheduled times from it)."""
    scheduled_new_reqs: list[_NewRequestView] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


def step_from_outputs(outputs: EngineCoreOutputs) -> EngineCoreStep:
    view = SchedulerOutputView([_NewRequestView(r) for r in outputs.scheduled_new_req_ids],
                               outputs.num_scheduled_tokens)
    return EngineCoreStep(view, outputs.outputs, outputs.logprobs, outputs.errors, outputs.prompt_logprobs,
                          outputs.start_time, outputs.spec_decode, outputs.kv_transfer_params)


class EngineCoreProcHandle(ChildProcess):
    """The core's process (processes.ChildProcess: forkserver start, bounded close)."""

    preload = ("mini_vllm.core_proc",)     # the forkserver imports torch and the model code once

    def __init__(self, kwargs: dict, start_timeout: float = 300.0) -> None:
        from mini_vllm.core_proc import run_engine_core
        super().__init__(run_engine_core, kwargs, start_timeout)


# ==================================================================== over ZMQ
class MPClient:
    """Starts the core process and owns the two sockets (the front end binds; the core connects)."""

    def __init__(self, config, model_config, asyncio_mode: bool, num_threads: int | None = None) -> None:
        self.kv_transfer_config = config.kv_transfer_config
        import zmq            # here, not at the top: the in-process engine runs where pyzmq is absent
        import zmq.asyncio

        self._ipc_dir = tempfile.mkdtemp(prefix="mini_vllm_core_")
        input_address, output_address = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        # A PUSH socket whose reader died blocks on send: bound it, then ask whether the core is alive.
        self.input_socket.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self.input_socket.bind(input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        self.proc: EngineCoreProcHandle | None = None
        self.dead_message: str | None = None
        self._call_ids = itertools.count()
        try:
            self.proc = EngineCoreProcHandle(dict(config=config, model_config=model_config,
                                                  input_address=input_address, output_address=output_address,
                                                  num_threads=num_threads or core_num_threads()))
        except BaseException:
            self._close_sockets()
            raise
        self.kv_cache_report = self.proc.info["kv_cache_report"]
        self.pid = self.proc.info["pid"]

    @property
    def is_dead(self) -> bool:
        return self.dead_message is not None or (self.proc is not None and not self.proc.proc.is_alive())

    def _dead_error(self) -> EngineDeadError:
        if self.dead_message is None:
            self.dead_message = f"the engine core process exited (exit code {self.proc.proc.exitcode})"
        return EngineDeadError(self.dead_message)

    def _encode_request(self, kind: EngineCoreRequestType, payload) -> list[bytes]:
        return [kind.value, encode(payload)]

    def _close_sockets(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def shutdown(self) -> None:
        """Stop the core process (bounded: stop -> terminate -> kill) and close the sockets."""
        if self.proc is not None:
            self.proc.close()
            self.proc = None
            self._close_sockets()

    def validate_kv_transfer_params(self, params):
        """What the front end can check of a request's kv_transfer_params: their form and the node's
        role. Whether a prefill node's K/V fits is checked where the connector is, in the core
        process (a request that does not fit finishes there with the reason)."""
        if params is None:
            return None
        if self.kv_transfer_config is None:
            raise ValueError("kv_transfer_params given, but this engine has no kv_transfer_config")
        from global_prefix_cache.transfer_params import check_kv_transfer_params
        return check_kv_transfer_params(params, self.kv_transfer_config)


class SyncMPClient(MPClient):
    def __init__(self, config, model_config, num_threads: int | None = None) -> None:
        super().__init__(config, model_config, asyncio_mode=False, num_threads=num_threads)
        self._utility_results: dict[int, UtilityOutput] = {}
        self._pending: list[EngineCoreOutputs] = []       # outputs read while waiting for a utility answer

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids) -> list[str]:
        request_ids = list(request_ids)
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)
        return request_ids

    def finish_requests(self, request_ids, status: RequestStatus) -> list[str]:
        kind = EngineCoreRequestType.ABORT if status == RequestStatus.FINISHED_ABORTED else EngineCoreRequestType.FINISH
        self._send(kind, list(request_ids))
        return list(request_ids)

    def get_output(self) -> EngineCoreStep:
        return step_from_outputs(self._pending.pop(0) if self._pending else self._recv_outputs())

    def call_utility(self, method: str, *args, timeout: float = 60.0):
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, args))
        while call_id not in self._utility_results:
            self._pending.append(self._recv_outputs(until_utility=call_id, timeout=timeout))
            if self._pending[-1] is None:
                self._pending.pop()
        result = self._utility_results.pop(call_id)
        if not result.ok:
            raise RuntimeError(f"engine core {method}: {result.result}")
        return result.result

    def check_invariants(self) -> None:
        self.call_utility("check_invariants")

    def _send(self, kind: EngineCoreRequestType, payload) -> None:
        if self.is_dead:
            raise self._dead_error()
        import zmq

        try:
            self.input_socket.send_multipart(self._encode_request(kind, payload))
        except zmq.Again:            # SNDTIMEO: nobody reads the input socket
            raise self._dead_error() if self.is_dead else TimeoutError("the engine core takes no requests") from None

    def _recv_outputs(self, until_utility: int | None = None, timeout: float | None = None):
        """The next EngineCoreOutputs (or None once the awaited utility answer came)."""
        waited = 0.0
        while True:
            if self.output_socket.poll(int(DEAD_CHECK_S * 1000)):
                message = decode(self.output_socket.recv())
                if isinstance(message, EngineCoreOutputs):
                    return message
                if isinstance(message, UtilityOutput):
                    self._utility_results[message.call_id] = message
                    if message.call_id == until_utility:
                        return None
                    continue
                if isinstance(message, EngineDead):
                    self.dead_message = f"the engine core died: {message.message}"
                    raise self._dead_error()
            elif self.is_dead:
                raise self._dead_error()
            waited += DEAD_CHECK_S
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"the engine core did not answer within {timeout} s")


class AsyncMPClient(MPClient):
    """For AsyncLLM: one reader (AsyncLLM's output handler) awaits `get_output_async`; utility
    answers it meets on the way resolve their futures."""

    def __init__(self, config, model_config, num_threads: int | None = None) -> None:
        super().__init__(config, model_config, asyncio_mode=True, num_threads=num_threads)
        self._utility_futures: dict[int, asyncio.Future] = {}

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def finish_requests_async(self, request_ids) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.FINISH, list(request_ids))

    async def call_utility_async(self, method: str, *args, timeout: float = 60.0):
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            await self._send(EngineCoreRequestType.UTILITY, (call_id, method, args))
            result = await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)
        if not result.ok:
            raise RuntimeError(f"engine core {method}: {result.result}")
        return result.result

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            if await self.output_socket.poll(int(DEAD_CHECK_S * 1000)):
                message = decode(await self.output_socket.recv())
                if isinstance(message, EngineCoreOutputs):
                    return message
                if isinstance(message, UtilityOutput):
                    future = self._utility_futures.get(message.call_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                if isinstance(message, EngineDead):
                    self.dead_message = f"the engine core died: {message.message}"
                    raise self._dead_error()
            elif self.is_dead:
                raise self._dead_error()

    def fail_pending_utilities(self, error: BaseException) -> None:
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)

    async def _send(self, kind: EngineCoreRequestType, payload) -> None:
        if self.is_dead:
            raise self._dead_error()
        try:
            await asyncio.wait_for(self.input_socket.send_multipart(self._encode_request(kind, payload)), SEND_TIMEOUT_S)
        except asyncio.TimeoutError:     # nobody reads the input socket
            raise self._dead_error() if self.is_dead else TimeoutError("the engine core takes no requests") from None


def make_client(config, model_config, multiprocess_mode: bool, asyncio_mode: bool = False):
    """vLLM's EngineCoreClient.make_client."""
    if asyncio_mode:
        if not multiprocess_mode:
            raise ValueError("the asyncio client needs the core in its own process (vLLM's AsyncLLM likewise)")
        return AsyncMPClient(config, model_config)
    if multiprocess_mode:
        return SyncMPClient(config, model_config)
    return InprocClient(config, model_config)
