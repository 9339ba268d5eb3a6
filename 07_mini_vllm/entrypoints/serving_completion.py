"""POST /v1/completions (vLLM: `vllm/entrypoints/openai/serving_completion.py:
OpenAIServingCompletion` — `create_completion`, `completion_stream_generator`,
`request_output_to_completion_response`).

A request may carry several prompts (text or token ids) and ask n completions of each: every
prompt is one engine request ("cmpl-<id>-<i>"), all validated before any is queued, and choice
`i * n + j` is completion j of prompt i — OpenAI's order. Streaming sends each step's new text
as it comes (SSE, one chunk per choice per step), then a chunk with the finish reason, then —
with stream_options.include_usage — one chunk with the token counts and no choices.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from mini_vllm.entrypoints.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                            CompletionResponseChoice, PromptTokenUsageInfo, UsageInfo, random_uuid)
from mini_vllm.entrypoints.serving_engine import (OpenAIError, OpenAIServing, engine_error, merge_async_iterators, sse,
                                                  sse_error)
from mini_vllm.outputs import CompletionOutput, RequestOutput


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, req: CompletionRequest) -> tuple[str, list, list[int]]:
        """Check everything, queue nothing -> (request id, [(engine request id, prompt text, EngineCoreRequest)],
        prompt lengths). Raises OpenAIError."""
        self.check_model(req.model)
        self.check_alive()
        if req.echo:
            raise OpenAIError("echo is not supported by this server", param="echo")
        if req.suffix:
            raise OpenAIError("suffix is not supported by this server", param="suffix")
        prompts = req.prompt
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        request_id = f"cmpl-{random_uuid()}"
        prepared, lengths = [], []
        for i, prompt in enumerate(prompts):
            text, ids = (prompt, self.tokenizer(prompt).input_ids) if isinstance(prompt, str) else (None, list(prompt))
            if not ids:
                raise OpenAIError("the prompt is empty: a request needs at least one prompt token", param="prompt")
            max_tokens = self.max_tokens_for(req.max_tokens, len(ids))
            params = self.sampling_params(req, max_tokens, req.logprobs)
            prepared.append(self.process(f"{request_id}-{i}", text, ids, params, req))
            lengths.append(len(ids))
        return request_id, prepared, lengths

    def generators(self, prepared) -> list[AsyncIterator[RequestOutput]]:
        return [self.generate(job) for job in prepared]

    # ------------------------------------------------------------------ whole response
    async def create_completion(self, req: CompletionRequest, request_id: str, prepared, lengths) -> dict:
        n = req.n
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, output in merge_async_iterators(*self.generators(prepared)):
                finals[i] = output
        except OpenAIError:
            raise
        except Exception as e:                     # noqa: BLE001 - a dead engine: 503
            raise engine_error(e) from None
        choices, completion_tokens = [], 0
        for i in range(len(prepared)):
            for c in finals[i].outputs:
                self._raise_if_failed(c)
                completion_tokens += len(c.token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=self._logprobs(c, 0) if req.logprobs is not None else None,
                    token_ids=list(c.token_ids) if req.return_token_ids else None))
        choices.sort(key=lambda c: c.index)
        usage = UsageInfo(prompt_tokens=sum(lengths), completion_tokens=completion_tokens,
                          total_tokens=sum(lengths) + completion_tokens,
                          prompt_tokens_details=PromptTokenUsageInfo(
                              cached_tokens=sum(f.num_cached_tokens for f in finals.values())))
        return CompletionResponse(id=request_id, model=self.model_name(req), choices=choices, usage=usage,
                                  kv_transfer_params=finals[0].kv_transfer_params).model_dump()

    # ------------------------------------------------------------------ streamed
    async def completion_stream_generator(self, req: CompletionRequest, request_id: str, prepared,
                                          lengths) -> AsyncIterator[str]:
        n, model, created = req.n, self.model_name(req), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        text_offsets: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, output in merge_async_iterators(*self.generators(prepared)):
                for c in output.outputs:
                    self._raise_if_failed(c)
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self._logprobs(c, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(c.text)
                    yield sse(CompletionResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionResponseChoice(index=index, text=c.text, logprobs=logprobs,
                                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                          token_ids=list(c.token_ids) if req.return_token_ids else None)]
                    ).model_dump(exclude_none=True))
            if include_usage:
                usage = UsageInfo(prompt_tokens=sum(lengths), completion_tokens=completion_tokens,
                                  total_tokens=sum(lengths) + completion_tokens)
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=usage).model_dump(exclude_none=True))
        except Exception as e:                     # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(e)
        yield sse("[DONE]")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _raise_if_failed(c: CompletionOutput) -> None:
        """The engine core failed this request alone (it can never fit, non-finite logits): the
        request is what cannot be served, so 400 with the engine's reason."""
        if c.finish_reason == "error":
            raise OpenAIError(f"the engine could not complete this request: {c.stop_reason}")

    @staticmethod
    def _logprobs(c: CompletionOutput, text_offset: int) -> CompletionLogProbs:
        """OpenAI's legacy completion logprobs: per token its text, logprob, the top-k as {text: logprob}."""
        out = CompletionLogProbs()
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry.get(token_id)
            token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else ""
            out.tokens.append(token)
            out.token_logprobs.append(chosen.logprob if chosen is not None else None)
            out.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out
