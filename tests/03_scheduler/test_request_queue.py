"""The waiting queue of each policy: exact service orders."""
import pytest

from scheduler import (FCFSRequestQueue, PriorityRequestQueue, Request, SRTFRequestQueue, TwoLevelRequestQueue,
                       create_request_queue)


def req(rid, prompt_len=4, arrival=0.0, priority=0):
    return Request(rid, list(range(prompt_len)), max_tokens=1, arrival_time=arrival, priority=priority)


def drain(queue):
    out = []
    while queue:
        assert queue.peek_request() is queue.peek_request()
        out.append(queue.pop_request().request_id)
    return out


def remaining(request):
    return request.num_tokens - request.num_computed_tokens


def test_fcfs_order_and_prepend():
    q = FCFSRequestQueue()
    for i in range(3):
        q.add_request(req(f"r{i}", arrival=i))
    back = req("back", arrival=9)
    q.prepend_request(back)                       # a preempted request goes to the front
    q.prepend_requests([req("x"), req("y")])      # several: they keep their order
    assert [r.request_id for r in q] == ["x", "y", "back", "r0", "r1", "r2"]
    q.remove_request(back)
    assert drain(q) == ["x", "y", "r0", "r1", "r2"]
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_lower_value_first_then_arrival():
    q = PriorityRequestQueue()
    for rid, prio, t in [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", 2, -1.0), ("e", 1, 0.0)]:
        q.add_request(req(rid, arrival=t, priority=prio))
    assert [r.request_id for r in q] == ["c", "b", "a", "e", "d"]
    q.remove_requests([r for r in q if r.request_id in ("b", "e")])
    assert drain(q) == ["c", "a", "d"]


def test_srtf_picks_fewest_remaining_tokens_ties_by_arrival():
    q = SRTFRequestQueue(remaining)
    q.add_request(req("long", 100, arrival=0))
    q.add_request(req("short-late", 5, arrival=2))
    q.add_request(req("short-early", 5, arrival=1))
    q.add_request(req("mid", 20, arrival=0))
    assert drain(q) == ["short-early", "short-late", "mid", "long"]


def test_srtf_reevaluates_at_every_peek():
    """Algorithm 2's refresh: remaining work can change between peeks (a new prefix hit)."""
    cached = {}
    q = SRTFRequestQueue(lambda r: r.num_tokens - cached.get(r.request_id, 0))
    a, b = req("a", 10), req("b", 30)
    q.add_request(a)
    q.add_request(b)
    assert q.peek_request() is a
    cached["b"] = 25                              # b now needs only 5 tokens
    assert q.peek_request() is b


def test_srtf_pop_returns_what_was_peeked():
    """Admitting the peeked request may make another look shorter; pop must not switch."""
    cached = {}
    q = SRTFRequestQueue(lambda r: r.num_tokens - cached.get(r.request_id, 0))
    a, b = req("a", 10), req("b", 30)
    q.add_request(a)
    q.add_request(b)
    assert q.peek_request() is a
    cached["b"] = 29
    assert q.pop_request() is a
    assert q.pop_request() is b


def test_two_level_refills_staging_only_when_empty():
    q = TwoLevelRequestQueue(remaining, staging_size=2)
    for rid, n in [("a", 50), ("b", 10), ("c", 1), ("d", 2)]:
        q.add_request(req(rid, n))
    # FIFO moves (a, b) into staging; SRTF inside: b before a. c and d, though shorter,
    # wait until the staging queue is empty: no starvation of a.
    assert q.peek_request().request_id == "b"
    assert [r.request_id for r in q.staged] == ["b", "a"]
    assert q.pop_request().request_id == "b"
    q.add_request(req("e", 1))
    assert q.pop_request().request_id == "a"
    assert drain(q) == ["c", "d", "e"]


def test_two_level_returning_requests_go_to_staging():
    q = TwoLevelRequestQueue(remaining, staging_size=1)
    q.add_request(req("a", 5))
    q.add_request(req("b", 1))
    assert q.pop_request().request_id == "a"
    back = req("back", 50)
    q.prepend_request(back)                       # staging is not empty now: b must wait
    assert q.peek_request() is back
    q.remove_request(back)
    assert drain(q) == ["b"]


def test_factory():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    assert isinstance(create_request_queue("srtf", remaining), SRTFRequestQueue)
    assert create_request_queue("two_level", remaining, staging_size=3).staging_size == 3
    with pytest.raises(ValueError, match="needs a remaining_tokens"):
        create_request_queue("srtf")
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        create_request_queue("lifo")
