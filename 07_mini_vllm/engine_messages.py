"""What crosses the line between the front end and the engine core: EngineCoreRequest in,
EngineCoreOutputs out, plus the scheduler's gauges (SchedulerStats).

Mirrors vLLM v1's `vllm/v1/engine/__init__.py` (`EngineCoreRequest`, `EngineCoreOutputs`,
`EngineCoreRequestType`, `UtilityOutput`) and `vllm/v1/metrics/stats.py: SchedulerStats`.

Why a message type of its own rather than the scheduler's `Request`: the front end must not
need the scheduler's bookkeeping (block lists, statuses) to describe a request, and a message
should carry only what the other side reads. The core builds the `Request` from it
(`EngineCoreRequest.to_request`), in whichever process the core lives.

Encoding: pickle (protocol 5). vLLM uses msgspec with a custom tensor codec; here every field is
plain Python (ids, floats, a SamplingParams dataclass), and benchmarks/bench_engine_core_ipc.py
measures what pickle + ZMQ cost per step (results/engine_core_ipc.json).
"""
from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

from scheduler import EngineCoreOutput, Request

from mini_vllm.lora_request import LoRARequest
from mini_vllm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """The first element of every message to the core (vLLM: the first ZMQ frame)."""
    ADD = b"\x00"
    ABORT = b"\x01"
    FINISH = b"\x02"         # finished by the front end (a stop string): the scheduler frees it as "stop"
    UTILITY = b"\x03"        # call an EngineCore method and send back its result (tests, reset_prefix_cache)


@dataclass
class EngineCoreRequest:
    """One validated, tokenized request (the Processor ran in the front end)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams          # already completed by Processor.prepare_params
    arrival_time: float                      # time.monotonic(): one clock for every process of this machine
    priority: int = 0
    eos_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict | None = None
    lora_request: LoRARequest | None = None   # the adapter (chapter 09), or None: the base model

    def to_request(self) -> Request:
        """The scheduler's Request (chapter 03), built where the scheduler lives."""
        params = self.sampling_params
        return Request(self.request_id, self.prompt_token_ids, params.max_tokens, arrival_time=self.arrival_time,
                       priority=self.priority, eos_token_id=self.eos_token_id, ignore_eos=params.ignore_eos,
                       stop_token_ids=list(self.stop_token_ids), sampling_params=params,
                       kv_transfer_params=self.kv_transfer_params, lora_request=self.lora_request,
                       # prompt logprobs need the logits of every prompt token: no cached prefix may skip them
                       skip_reading_prefix_cache=params.prompt_logprobs is not None)


@dataclass
class SchedulerStats:
    """The core's gauges after a step (vLLM: SchedulerStats), and its cumulative counters:
    the front end's stat loggers turn those into Prometheus counters by difference."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0              # fraction of KV blocks held by requests
    prefix_cache_queries: int = 0            # tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0               # of which found cached, since start
    num_preemptions: int = 0                 # since start


@dataclass
class EngineCoreOutputs:
    """One core step as the front end needs it: exactly the fields of EngineCoreStep that the
    OutputProcessor reads (not the SchedulerOutput, whose block tables the front end never uses)."""
    outputs: list[EngineCoreOutput]
    logprobs: dict = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)
    scheduled_new_req_ids: list[str] = field(default_factory=list)   # first scheduled this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    start_time: float = 0.0
    spec_decode: Any = None
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)   # of requests finished this step
    scheduler_stats: SchedulerStats | None = None
    step_cpu_time: float = 0.0               # the core process's CPU seconds for this step (the IPC benchmark)


@dataclass
class UtilityOutput:
    call_id: int
    ok: bool
    result: Any                              # the return value, or the error message when not ok


@dataclass
class EngineDead:
    """The core's last message: step() raised, so no request can make progress."""
    message: str


def encode(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def decode(data: bytes):
    return pickle.loads(data)
