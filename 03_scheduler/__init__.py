"""Chapter 03: the continuous-batching scheduler — requests as two counters, FCFS / priority /
SRTF / two-level policies, recompute and swap preemption, a static-batching and Orca-style
reservation baselines, and a simulator that runs scheduling experiments without a model."""
from scheduler.config import POLICIES, SchedulerConfig
from scheduler.output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                              SchedulerOutput)
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.request_queue import (FCFSRequestQueue, PriorityRequestQueue, RequestQueue, SRTFRequestQueue,
                                     TwoLevelRequestQueue, create_request_queue)
from scheduler.mock_runner import MockModelRunner
from scheduler.shadow_kv import ShadowKVRunner, kv_value
from scheduler.scheduled_step import ScheduledStep, SchedulingBudget
from scheduler.scheduler import Scheduler
from scheduler.utils import check_stop

__all__ = [
    "SchedulerConfig", "POLICIES",
    "SchedulerOutput", "NewRequestData", "CachedRequestData", "ModelRunnerOutput", "EngineCoreOutput",
    "Request", "RequestStatus", "FinishReason",
    "RequestQueue", "FCFSRequestQueue", "PriorityRequestQueue", "SRTFRequestQueue", "TwoLevelRequestQueue",
    "create_request_queue", "Scheduler", "ScheduledStep", "SchedulingBudget", "check_stop", "MockModelRunner",
    "ShadowKVRunner", "kv_value",
]
