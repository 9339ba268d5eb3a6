"""Stop conditions. Mirrors vLLM's `vllm/v1/core/sched/utils.py: check_stop`."""
from __future__ import annotations

from scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Did the token just appended end the request? Sets the finished status. (vLLM:
    `vllm/v1/core/sched/utils.py:check_stop`.) EOS and stop tokens are reported as "stop",
    max_tokens / max_model_len as "length"."""
    last_token_id = request.output_token_ids[-1]
    if not request.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
