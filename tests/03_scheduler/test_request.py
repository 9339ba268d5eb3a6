"""Request: the two counters, stop conditions and input validation (exact tests)."""
import pytest

from scheduler import FinishReason, Request, RequestStatus, check_stop


def test_two_counters_start_and_grow():
    r = Request("a", [5, 6, 7], max_tokens=4)
    assert (r.num_computed_tokens, r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (0, 3, 3, 0)
    r.append_output_token_ids(9)
    r.append_output_token_ids([10, 11])
    assert list(r.all_token_ids) == [5, 6, 7, 9, 10, 11]
    assert list(r.output_token_ids) == [9, 10, 11]
    assert r.num_tokens == 6 and r.num_output_tokens == 3 and r.num_prompt_tokens == 3


def test_drafts_count_in_num_tokens_with_spec_only():
    r = Request("a", [1, 2], max_tokens=8)
    r.spec_token_ids = [3, 4, 5]
    assert r.num_tokens == 2 and r.num_tokens_with_spec == 5
    assert list(r.all_token_ids) == [1, 2]       # the KV manager never sees unverified drafts


@pytest.mark.parametrize("kwargs, message", [
    (dict(request_id="", prompt_token_ids=[1], max_tokens=1), "non-empty string"),
    (dict(request_id="a", prompt_token_ids=[], max_tokens=1), "prompt is empty"),
    (dict(request_id="a", prompt_token_ids=[1], max_tokens=0), "max_tokens must be >= 1"),
])
def test_bad_requests_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Request(**kwargs)


def test_finished_statuses_and_reasons():
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert not RequestStatus.is_finished(RequestStatus.WAITING_FOR_REMOTE_KVS)
    reasons = {s: RequestStatus.get_finished_reason(s) for s in RequestStatus if RequestStatus.is_finished(s)}
    assert reasons == {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                       RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
                       RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
                       RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
                       RequestStatus.FINISHED_ERROR: FinishReason.ERROR}
    assert str(FinishReason.STOP) == "stop"


def _stop_after(request, token, max_model_len=100):
    request.append_output_token_ids(token)
    return check_stop(request, max_model_len)


def test_eos_stops_unless_ignored():
    r = Request("a", [1], max_tokens=10, eos_token_id=2)
    assert not _stop_after(r, 3)
    assert _stop_after(r, 2) and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r = Request("b", [1], max_tokens=10, eos_token_id=2, ignore_eos=True)
    assert not _stop_after(r, 2) and r.status == RequestStatus.WAITING


def test_stop_token_ids_report_the_token():
    r = Request("a", [1], max_tokens=10, stop_token_ids=[7, 8])
    assert _stop_after(r, 8)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 8


def test_max_tokens_and_max_model_len_cap_the_length():
    r = Request("a", [1], max_tokens=2)
    assert not _stop_after(r, 5)
    assert _stop_after(r, 5) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    r = Request("b", [1, 2, 3], max_tokens=100)
    assert not _stop_after(r, 5, max_model_len=5)
    assert _stop_after(r, 5, max_model_len=5) and r.get_finished_reason() == FinishReason.LENGTH


def test_eos_wins_over_length_on_the_same_token():
    r = Request("a", [1], max_tokens=1, eos_token_id=4)
    assert _stop_after(r, 4) and r.status == RequestStatus.FINISHED_STOPPED


def test_streaming_prompt_grows_num_tokens_only():
    r = Request("a", [1, 2], max_tokens=3, streaming_input=True)
    r.num_computed_tokens = 2
    r.append_prompt_tokens([3, 4], final=False)
    assert (r.num_computed_tokens, r.num_tokens, r.num_prompt_tokens) == (2, 4, 4) and r.streaming_input
    r.num_computed_tokens = 4
    with pytest.raises(ValueError, match="final input chunk must be non-empty"):
        r.append_prompt_tokens([], final=True)
    r.append_prompt_tokens([5], final=True)
    assert not r.streaming_input and r.num_tokens == 5
    with pytest.raises(ValueError, match="does not take streaming input"):
        r.append_prompt_tokens([6], final=True)
