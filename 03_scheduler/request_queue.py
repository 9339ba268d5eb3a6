"""The waiting queue, one class per scheduling policy.

Mirrors vLLM's `vllm/v1/core/sched/request_queue.py` (`RequestQueue`, `FCFSRequestQueue`,
`PriorityRequestQueue`, `create_request_queue`) and adds the two policies of the thesis
[Kwon 2025, §4.5.2-4.5.3]: `SRTFRequestQueue` (Algorithm 2) and `TwoLevelRequestQueue`.

The scheduler's loop is the same for every policy — it asks the queue for the next
candidate (`peek_request`), tries to give it KV blocks and budget, and `pop_request`s it if
that worked. So a policy is nothing but the order in which `peek_request` hands out requests:

  fcfs       arrival order (a deque): predictable, fair, but head-of-line blocking
  priority   (priority, arrival) min-heap: lower value first
  srtf       fewest remaining tokens first, re-evaluated at every peek because admitting
             one request can create prefix-cache hits for others (the inner loop of [Kwon 2025, Algorithm 2]);
             optimal mean TTFT, but long prompts can starve and every peek costs O(waiting)
  two_level  FIFO moves a batch of `staging_size` requests into a staging queue only when it
             is empty; SRTF orders the staging queue. Starvation-free (a staged request is
             served before anything new is staged) and each peek costs O(staging_size).

`prepend_request` is for requests coming BACK (preempted, or skipped this step): under FCFS
they go to the front so that the earliest arrivals are served first.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Iterable, Iterator

from scheduler.request import Request

RemainingTokensFn = Callable[[Request], int]


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def peek_request(self) -> Request:
        """The request the policy wants next (raises IndexError when empty)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return `peek_request()`."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """All queued requests, in the order the policy would serve them now."""

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put several back so that they come out in the given order."""
        for request in reversed(list(requests)):
            self.prepend_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque (O(1) at both ends)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Min-heap on (priority, arrival_time): lower priority value first, FCFS among equals.
    A returning request simply re-enters the heap: its key already puts it where it belongs."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()    # tie-break so Requests are never compared

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


class SRTFRequestQueue(RequestQueue):
    """Shortest Remaining Token First [Kwon 2025, Algorithm 2] over the waiting requests.

    `remaining_tokens(request)` is asked afresh at every peek — the refresh loop of
    [Kwon 2025, Algorithm 2] (lines 4-7): a prefix-cache hit created by an admission a moment ago can
    shrink another waiting request's remaining work. Ties go to the earlier arrival.
    """

    def __init__(self, remaining_tokens: RemainingTokensFn) -> None:
        self._remaining_tokens = remaining_tokens
        self._requests: dict[int, tuple[int, Request]] = {}   # id(request) -> (insertion seq, request)
        self._seq = itertools.count()
        # pop_request() removes what the last peek returned: admitting that request may have
        # changed the others' remaining tokens (new prefix-cache entries) in between.
        self._peeked: Request | None = None

    def _key(self, entry: tuple[int, Request]) -> tuple[int, float, int]:
        seq, request = entry
        return (self._remaining_tokens(request), request.arrival_time, seq)

    def add_request(self, request: Request) -> None:
        self._requests[id(request)] = (next(self._seq), request)
        self._peeked = None

    def peek_request(self) -> Request:
        if not self._requests:
            raise IndexError("peek from an empty queue")
        ### BEGIN SOLUTION
        self._peeked = min(self._requests.values(), key=self._key)[1]
        ### END SOLUTION
        return self._peeked

    def pop_request(self) -> Request:
        request = self._peeked if self._peeked is not None else self.peek_request()
        self.remove_request(request)
        return request

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        del self._requests[id(request)]
        self._peeked = None

    def __contains__(self, request: object) -> bool:
        return id(request) in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._requests.values(), key=self._key))


class TwoLevelRequestQueue(RequestQueue):
    """Two-level scheduling [Kwon 2025, §4.5.3]: FIFO waiting queue -> staging queue -> SRTF.

    The FIFO level refills the staging queue with up to `staging_size` requests ONLY when the
    staging queue is empty. That is what prevents starvation: once staged, a request is served
    before any later arrival is even considered. Inside the staging queue, SRTF decides.
    Requests coming back (preempted / skipped) go to the staging queue: they were already
    admitted past the FIFO level once.
    """

    def __init__(self, remaining_tokens: RemainingTokensFn, staging_size: int = 8) -> None:
        if staging_size < 1:
            raise ValueError(f"staging_size must be >= 1, got {staging_size}")
        self.staging_size = staging_size
        self._fifo: deque[Request] = deque()
        self._staging = SRTFRequestQueue(remaining_tokens)

    def _refill(self) -> None:
        ### BEGIN SOLUTION
        if not self._staging:
            for _ in range(min(self.staging_size, len(self._fifo))):
                self._staging.add_request(self._fifo.popleft())
        ### END SOLUTION

    def add_request(self, request: Request) -> None:
        self._fifo.append(request)

    def peek_request(self) -> Request:
        self._refill()
        return self._staging.peek_request()

    def pop_request(self) -> Request:
        self._refill()
        return self._staging.pop_request()

    def prepend_request(self, request: Request) -> None:
        self._staging.add_request(request)

    def remove_request(self, request: Request) -> None:
        if request in self._staging:
            self._staging.remove_request(request)
        else:
            self._fifo.remove(request)

    @property
    def staged(self) -> list[Request]:
        return list(self._staging)

    def __len__(self) -> int:
        return len(self._fifo) + len(self._staging)

    def __iter__(self) -> Iterator[Request]:
        yield from self._staging
        yield from self._fifo


def create_request_queue(policy: str, remaining_tokens: RemainingTokensFn | None = None,
                         staging_size: int = 8) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    if policy in ("srtf", "two_level"):
        if remaining_tokens is None:
            raise ValueError(f"policy {policy!r} needs a remaining_tokens(request) function")
        if policy == "srtf":
            return SRTFRequestQueue(remaining_tokens)
        return TwoLevelRequestQueue(remaining_tokens, staging_size)
    raise ValueError(f"unknown scheduling policy {policy!r}")
