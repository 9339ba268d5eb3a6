"""Incremental detokenization and stop strings.

Mirrors vLLM's `vllm/v1/engine/detokenizer.py` (`IncrementalDetokenizer.update`,
`get_next_output_text`, `check_stop_strings`) and the windowed decode of
`vllm/transformers_utils/detokenizer_utils.py: detokenize_incrementally`.

Why not decode each new token on its own: a token is not a piece of text. Byte-level BPE
tokens can hold half of a UTF-8 character ("😀" is four bytes spread over several tokens,
each decoding alone to U+FFFD "�"), and SentencePiece tokenizers drop a token's leading space
when it is decoded first in a string. Why not decode the whole output every step: that is
O(n) per token, O(n²) per request.

The window: keep two offsets into the token list. `prefix_offset..read_offset` are tokens
whose text was already emitted (context that makes the next token render correctly);
`read_offset..` are tokens not emitted yet. Each step decode both windows; the new text is the
second minus the first, emitted only if it does not end in U+FFFD (an unfinished character:
wait for the next token). Then slide the window forward. The window starts 5 tokens back into
the prompt, so the first output token is decoded in context too.

When the request finishes, `flush()` emits what the window still holds, even text ending in
U+FFFD: no later token will complete that character, and the final text must equal decoding
all output tokens at once.

Stop strings are matched on the text, which can end a request in the middle of a token: the
text is cut at the stop string (kept only with include_stop_str_in_output), and while a stream
is running the last len(longest stop) - 1 characters are held back, so a stream never shows
the beginning of a stop string that is later cut off.
"""
from __future__ import annotations

from collections.abc import Sequence

from mini_vllm.sampling_params import SamplingParams

INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5     # prompt tokens decoded as context (vLLM's constant)
REPLACEMENT_CHAR = "\ufffd"                          # what a partial UTF-8 sequence decodes to


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Did the last `new_char_count` characters complete one of `stop`?

    Returns (the stop string, the length to truncate the text to), or None. Only the new text
    and the len(stop) - 1 characters before it are searched: an earlier match would have been
    found on an earlier step.
    """
    if not new_char_count or not stop:
        return None
    ### BEGIN SOLUTION
    for stop_str in stop:
        # A match may start up to len(stop_str) - 1 characters before the new text.
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        return stop_str, index + len(stop_str) if include_in_output else index
    ### END SOLUTION
    return None


class IncrementalDetokenizer:
    """The output text of one request, extended token by token.

    `update(new_token_ids)` appends tokens, extends `output_text`, and returns the stop string
    that ended the request (text already truncated), or None.
    `get_next_output_text(finished, delta)` is what a RequestOutput shows this step.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back from a stream while a stop string might still be completing.
        self.stop_buffer_length = 0 if not self.stop or self.include_stop_str_in_output else \
            max(len(s) for s in self.stop) - 1
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output: the decode windows span both
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.output_text = ""
        self._excluded_tail = 0                              # 1: the last token ended the request unseen
        self._last_output_text_offset = 0                    # for DELTA outputs: what was already sent

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, end: int) -> tuple[str, str]:
        """(text of the already-emitted context, text of the context plus tokens up to `end`)."""
        return (self._decode(self.token_ids[self.prefix_offset:self.read_offset]),
                self._decode(self.token_ids[self.prefix_offset:end]))

    def decode_next(self) -> str:
        """The text the tokens after read_offset add, or "" if it is not ready yet."""
        ### BEGIN SOLUTION
        prefix_text, new_text = self._decode_window(len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a special token that is skipped), or a character still
            # incomplete: keep the window where it is and try again with the next token.
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]
        ### END SOLUTION

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string that ended the request, or None.

        stop_terminated: the last token is EOS or a stop token. It ends the request anyway (the
        scheduler finished it), so no stop string is searched for, and its text is left out
        unless include_stop_str_in_output (as in vLLM).
        """
        stop_check_offset = len(self.output_text)
        skip_last = stop_terminated and not self.include_stop_str_in_output
        self._excluded_tail = int(skip_last)
        for n, token_id in enumerate(new_token_ids, 1):
            self.token_ids.append(token_id)
            if not (skip_last and n == len(new_token_ids)):
                self.output_text += self.decode_next()
        if not self.stop or stop_terminated:
            return None
        match = check_stop_strings(self.output_text, len(self.output_text) - stop_check_offset,
                                   self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def flush(self) -> str | None:
        """The request finished (not by a stop string): emit the text of the tokens still held
        back — an incomplete character will never be completed now. That text is searched for
        stop strings like any other (it may complete one): returns the stop string, with the
        text truncated at it, or None."""
        end = len(self.token_ids) - self._excluded_tail
        if end <= self.read_offset:
            return None
        prefix_text, new_text = self._decode_window(end)
        flushed = new_text[len(prefix_text):]
        self.output_text += flushed
        self.prefix_offset = self.read_offset = end
        match = check_stop_strings(self.output_text, len(flushed), self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text a RequestOutput carries now: everything (delta=False) or only what is new.
        While running, the last stop_buffer_length characters are withheld."""
        length = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        if not delta:
            return self.output_text[:length]
        start = self._last_output_text_offset
        if length <= start:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]
