"""Incremental detokenization and stop strings, on SmolLM2's real byte-level BPE tokenizer."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.detokenizer import IncrementalDetokenizer, check_stop_strings
from mini_vllm.sampling_params import SamplingParams

PROMPT = "Say something:"


def stream(tokenizer, text, params=SamplingParams(), prompt=PROMPT):
    """Feed `text`'s tokens one by one; returns (detokenizer, [delta text per step])."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt).input_ids, params)
    deltas = []
    for token_id in tokenizer(text, add_special_tokens=False).input_ids:
        before = len(detok.output_text)
        detok.update([token_id])
        deltas.append(detok.output_text[before:])
    before = len(detok.output_text)
    detok.flush()                                    # the request ends: emit what is held back
    deltas.append(detok.output_text[before:])
    return detok, deltas


def test_multibyte_characters_are_held_until_complete(smollm2_tokenizer):
    """'😀' is four UTF-8 bytes over several tokens, each decoding alone to U+FFFD: nothing is
    emitted until the character is complete, then the whole character at once."""
    text = " café 😀 你好"
    detok, deltas = stream(smollm2_tokenizer, text)
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas and " 😀" in deltas       # the emoji's first tokens emit nothing, its last emits it whole


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_incremental_text_equals_one_decode(smollm2_tokenizer, text):
    """Byte-level BPE: the concatenated deltas equal decoding all output tokens at once, and no
    delta ever contains a replacement character the full text does not."""
    ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
    detok, deltas = stream(smollm2_tokenizer, text)
    full = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    ids = smollm2_tokenizer(" Hi", add_special_tokens=False).input_ids + [eos]
    for skip, expected in [(True, " Hi"), (False, " Hi" + smollm2_tokenizer.eos_token)]:
        detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(skip_special_tokens=skip))
        detok.update(ids)
        assert detok.output_text == expected


def test_check_stop_strings_exact():
    # new text "c\nSTOP" completes "STOP"; truncation keeps what precedes it
    assert check_stop_strings("ab c\nSTOP and", 9, ["STOP"], False) == ("STOP", 5)
    assert check_stop_strings("ab c\nSTOP and", 9, ["STOP"], True) == ("STOP", 9)
    # a match entirely in old text was found earlier: not reported again
    assert check_stop_strings("STOP ab", 2, ["STOP"], False) is None
    # a stop string spanning the old/new boundary is found
    assert check_stop_strings("xxST" + "OP", 2, ["STOP"], False) == ("STOP", 2)
    assert check_stop_strings("abc", 0, ["a"], False) is None
    assert check_stop_strings("one two", 3, ["zzz", "two"], False) == ("two", 4)


def test_stop_string_across_tokens_truncates_and_is_withheld_from_streams(smollm2_tokenizer):
    params = SamplingParams(stop=["END OF"])
    detok = IncrementalDetokenizer(smollm2_tokenizer, smollm2_tokenizer(PROMPT).input_ids, params)
    assert detok.stop_buffer_length == len("END OF") - 1
    streamed, stop = "", None
    for token_id in smollm2_tokenizer(" alpha beta END OF story", add_special_tokens=False).input_ids:
        stop = detok.update([token_id])
        streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
        # While running, a stream never shows the start of the stop string.
        assert "END" not in streamed
        if stop:
            break
    assert stop == "END OF"
    assert detok.output_text == streamed == " alpha beta "


def test_include_stop_str_in_output(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(stop=["beta"], include_stop_str_in_output=True))
    assert detok.update(smollm2_tokenizer(" alpha beta gamma", add_special_tokens=False).input_ids) == "beta"
    assert detok.output_text == " alpha beta" and detok.stop_buffer_length == 0


def test_stop_token_text_left_out_unless_asked(smollm2_tokenizer):
    """A request ended by a stop token (or EOS): its last token's text is not part of the output,
    and no stop string is searched for in it (vLLM)."""
    ids = smollm2_tokenizer(" one two", add_special_tokens=False).input_ids
    for include, expected in [(False, " one"), (True, " one two")]:
        detok = IncrementalDetokenizer(smollm2_tokenizer, [1],
                                       SamplingParams(stop=["two"], include_stop_str_in_output=include))
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == expected


# ---------------------------------------------------------------- text released at the end
# Token 459 of SmolLM2's vocabulary is a space plus the first byte of a three-byte character:
# alone it decodes to " \ufffd", so the detokenizer holds it (and its space) back. A request
# that ends by length on it releases that text only in the final flush.
SPACE_AND_PARTIAL_CHAR = 459


def _tokens_ending_held_back(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids + [SPACE_AND_PARTIAL_CHAR]
    assert tokenizer.decode([SPACE_AND_PARTIAL_CHAR]) == " \ufffd"
    return ids


def test_the_final_flush_is_checked_for_stop_strings(smollm2_tokenizer):
    """The stop string 'END ' is completed only by the held-back space: flush() must find it,
    cut the text before it and report it (the old flush appended the text unchecked)."""
    detok = IncrementalDetokenizer(smollm2_tokenizer, smollm2_tokenizer(PROMPT).input_ids,
                                   SamplingParams(stop=["END "]))
    assert detok.update(_tokens_ending_held_back(smollm2_tokenizer, " alpha END")) is None
    assert detok.output_text == " alpha END"                 # the space is still held back
    assert detok.flush() == "END "
    assert detok.output_text == " alpha "
    assert detok.get_next_output_text(finished=True, delta=False) == " alpha "


def test_a_request_ending_by_length_on_a_stop_string_finishes_with_stop(smollm2_tokenizer):
    """Through the output processor: the engine finished the request by length, the flushed
    text completes a stop string, so the user sees finish_reason 'stop' and the cut text."""
    from mini_vllm.core import EngineCoreStep
    from mini_vllm.output_processor import OutputProcessor
    from scheduler import CachedRequestData, EngineCoreOutput, FinishReason, SchedulerOutput

    ids = _tokens_ending_held_back(smollm2_tokenizer, " alpha END")
    processor = OutputProcessor(smollm2_tokenizer)
    processor.add_request("r", PROMPT, smollm2_tokenizer(PROMPT).input_ids,
                          SamplingParams(stop=["END "], max_tokens=len(ids)), arrival_time=0.0)
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    step = EngineCoreStep(empty, [EngineCoreOutput("r", ids, FinishReason.LENGTH)])
    outputs, reqs_to_stop = processor.process_outputs(step, now=1.0)
    (out,) = outputs
    assert out.finished and reqs_to_stop == []               # the scheduler already finished it
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "END "
    assert out.outputs[0].text == " alpha "
    assert not processor.has_unfinished_requests()
