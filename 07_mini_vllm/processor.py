"""Processor: user input -> validated prompt token ids, before anything touches the engine.

Mirrors vLLM v1's `vllm/v1/engine/processor.py: Processor.process_inputs` (`_validate_params`,
`_validate_model_inputs`) and the chat path of `vllm/entrypoints/llm.py: LLM.chat`
(`apply_chat_template`, then tokenize without adding special tokens again).

Every check raises here, in `add_request`, so a bad request never reaches the scheduler: an
empty prompt, a prompt that leaves no room to generate within max_model_len, token ids outside
the vocabulary (in the prompt, stop_token_ids, logit_bias, allowed_token_ids, a bad word's
tokens), parameters that are not SamplingParams, or constraints that leave nothing to sample.

`prepare_params` gives the engine its own copy of the parameters, completed with what only the
engine knows (vLLM: Processor._validate_params + SamplingParams.update_from_generation_config /
update_from_tokenizer): EOS ids for min_tokens, the bad words' token ids.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

from mini_vllm.config import ModelConfig
from mini_vllm.sampling_params import MAX_LOGPROBS, SamplingParams

# A prompt: text, token ids, {"prompt": text} or {"prompt_token_ids": ids} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | Sequence[int] | Mapping


def _check_params(params) -> None:
    if not isinstance(params, SamplingParams):
        hint = (" (beam search runs in the front end, over ordinary requests: LLM.beam_search or "
                "AsyncLLM.beam_search)" if type(params).__name__ == "BeamSearchParams" else "")
        raise TypeError(f"sampling params must be a mini_vllm.SamplingParams, got {type(params).__name__}{hint}")


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer, max_logprobs: int = MAX_LOGPROBS,
                 chat_template: str | None = None, structured_outputs_backend: str | None = None):
        """max_logprobs: the engine's limit (-1: none). chat_template: a Jinja template that replaces
        the tokenizer's own (vLLM's --chat-template). structured_outputs_backend: the engine's (it
        checks a request's constraint before the request is queued)."""
        self.structured_outputs_backend = structured_outputs_backend
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template

    def process_inputs(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), validated."""
        _check_params(params)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer(text).input_ids
        elif _is_token_ids(prompt):
            text, token_ids = None, list(prompt)
        else:
            raise TypeError(f"a prompt is a str, a list of token ids, or a dict; got {type(prompt).__name__}")
        return text, self.validate(token_ids, params)

    def chat_to_token_ids(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                          chat_template_kwargs: Mapping | None = None) -> tuple[str, list[int]]:
        """Render a conversation with the model's chat template; returns (text, token ids)."""
        if not messages or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
            raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_config.model} has no chat template; use generate()")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, chat_template=self.chat_template,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
        # The template already wrote the special tokens (BOS, role markers): don't add them twice.
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Check prompt token ids (and the parameters) for one request; returns them as a list.
        Every path into the engine goes through here — a single out-of-vocabulary id would
        otherwise fail inside the embedding lookup at every step."""
        _check_params(params)
        for what, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            k = self.vocab_size if k == -1 else k
            if k is not None and self.max_logprobs != -1 and k > self.max_logprobs:     # vLLM's message
                raise ValueError(f"Requested {what} logprobs of {k}, which is greater than max allowed: "
                                 f"{self.max_logprobs}")
        if not _is_token_ids(token_ids):
            raise TypeError(f"prompt token ids must be a list of ints, got {type(token_ids).__name__}")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one prompt token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "it must be shorter, to leave room for at least one generated token")
        lo, hi = min(token_ids), max(token_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}) (the vocabulary); got {lo}..{hi}")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise ValueError(f"stop_token_ids must be < vocab_size {self.vocab_size}, got {params.stop_token_ids}")
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
        return token_ids

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """The engine's copy of `params`, completed (stop ids incl. EOS, bad words as token ids) and
        checked against the vocabulary. The caller's object is never changed: one SamplingParams
        is often shared by a whole batch of prompts."""
        params = copy.copy(params)
        if params.structured_outputs is not None:
            # vLLM: Processor._validate_structured_output — a schema / regex / grammar the backend
            # cannot compile is refused here (a 400 at the server), not failed inside the engine.
            from mini_vllm.structured_output_backend import DEFAULT_BACKEND, validate_structured_outputs
            validate_structured_outputs(self.structured_outputs_backend or DEFAULT_BACKEND, params.structured_outputs)
        if params.logprobs == -1:                   # the whole vocabulary
            params.logprobs = self.vocab_size
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = self.vocab_size
        params.update_from_model(self.model_config.eos_token_ids, self.tokenizer if params.bad_words else None)
        bad = [w for w in params._bad_words_token_ids if not all(0 <= t < self.vocab_size for t in w)]
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {self.vocab_size}): {bad[:4]}")
        if params.allowed_token_ids is not None:
            masked = {w[0] for w in params._bad_words_token_ids if len(w) == 1}
            if params.min_tokens > 0:
                masked |= params._all_stop_token_ids
            if set(params.allowed_token_ids) <= masked:
                raise ValueError("allowed_token_ids leaves nothing to sample: every allowed token is a bad word"
                                 + (" or a stop token that min_tokens masks" if params.min_tokens > 0 else ""))
        return params
