"""The output processor's fast path for plain requests gives exactly the general path's outputs."""
from __future__ import annotations

from mini_vllm.core import EngineCoreStep
from mini_vllm.output_processor import OutputProcessor
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from scheduler import CachedRequestData, EngineCoreOutput, FinishReason, SchedulerOutput


def _steps():
    """Three steps of two requests: tokens, two tokens at once, a finish by length, a stop token."""
    return [[EngineCoreOutput("a", [7], num_cached_tokens=16), EngineCoreOutput("b", [8])],
            [EngineCoreOutput("a", [9, 10]), EngineCoreOutput("b", [11], stop_reason=None)],
            [EngineCoreOutput("a", [12], FinishReason.LENGTH), EngineCoreOutput("b", [2], FinishReason.STOP, 2)]]


def _run(plain: bool) -> list:
    processor = OutputProcessor(tokenizer=None)
    for rid in ("a", "b"):
        processor.add_request(rid, None, [1, 2, 3], SamplingParams(detokenize=False, max_tokens=8), arrival_time=0.0)
        assert processor.request_states[rid].plain            # the fast path is what this test runs
        processor.request_states[rid].plain = plain
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    seen = []
    for now, outputs in enumerate(_steps(), 1):
        request_outputs, reqs_to_stop = processor.process_outputs(EngineCoreStep(empty, outputs), now=float(now))
        assert reqs_to_stop == []
        seen.append(request_outputs)
    assert not processor.has_unfinished_requests()
    return seen


def test_plain_fast_path_gives_the_general_paths_request_outputs():
    fast, general = _run(plain=True), _run(plain=False)
    assert fast == general                                    # every field, metrics and token times included
    assert [o.outputs[0].token_ids for o in fast[1]] == [[7, 9, 10], [8, 11]]
    assert fast[0][0].outputs[0].token_ids is not fast[1][0].outputs[0].token_ids   # each output its own list
    assert [o.outputs[0].finish_reason for o in fast[2]] == ["length", "stop"]


def test_only_token_id_cumulative_single_completions_are_plain():
    plain = OutputProcessor._is_plain
    assert plain(SamplingParams(detokenize=False), None, None)
    assert not plain(SamplingParams(detokenize=False, logprobs=2), None, None)
    assert not plain(SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA), None, None)
    assert not plain(SamplingParams(detokenize=False), object(), None)       # a detokenizer: text, stop strings
    assert not plain(SamplingParams(detokenize=False, n=2), None, object())   # a child of an n > 1 request
