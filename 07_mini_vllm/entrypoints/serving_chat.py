"""POST /v1/chat/completions (vLLM: `vllm/entrypoints/openai/serving_chat.py: OpenAIServingChat` —
`create_chat_completion`, `chat_completion_stream_generator`, `chat_completion_full_generator`).

The conversation is rendered with the model's own chat template (the tokenizer's, through the
engine's Processor, exactly as `LLM.chat` does), then it is one engine request with n
completions. Streaming follows OpenAI's chunk order: per choice a first chunk with the role,
then content deltas, then a chunk with the finish reason; with stream_options.include_usage a
last chunk with the token counts and no choices.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from mini_vllm.entrypoints.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                            ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                            ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent,
                                            ChatResponseMessage, DeltaMessage, PromptTokenUsageInfo, UsageInfo,
                                            random_uuid)
from mini_vllm.entrypoints.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.serving_engine import OpenAIError, OpenAIServing, engine_error, sse, sse_error
from mini_vllm.outputs import CompletionOutput, RequestOutput


def _text_content(content) -> str:
    """OpenAI allows a message's content as a list of parts; text parts are joined, others refused."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(f"only text content parts are supported, got {part.get('type')!r}", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


class OpenAIServingChat(OpenAIServing):
    def prepare(self, req: ChatCompletionRequest):
        """Check everything, queue nothing -> (request id, prompt text, EngineCoreRequest, prompt length)."""
        self.check_model(req.model)
        self.check_alive()
        if req.tools:
            raise OpenAIError("tools are not supported by this server", param="tools")
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [{"role": m.role, "content": _text_content(m.content)} for m in req.messages]
        try:
            text, ids = self.engine.engine.apply_chat_template(messages, req.add_generation_prompt,
                                                               req.chat_template_kwargs)
        except Exception as e:                     # noqa: BLE001 - a template that rejects the conversation
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.max_tokens_for(requested, len(ids))
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        request_id = f"chatcmpl-{random_uuid()}"
        return request_id, self.process(request_id, text, ids, params, req), len(ids)

    async def chat_completion_full_generator(self, req: ChatCompletionRequest, request_id: str, job,
                                             prompt_len: int) -> dict:
        final = None
        try:
            async for output in self.generate(job):
                final = output
        except Exception as e:                     # noqa: BLE001 - a dead engine: 503
            raise engine_error(e) from None
        choices, completion_tokens = [], 0
        for c in final.outputs:
            OpenAIServingCompletion._raise_if_failed(c)
            completion_tokens += len(c.token_ids)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None))
        usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                          total_tokens=prompt_len + completion_tokens,
                          prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=final.num_cached_tokens))
        return ChatCompletionResponse(id=request_id, model=self.model_name(req), choices=choices, usage=usage,
                                      kv_transfer_params=final.kv_transfer_params).model_dump()

    async def chat_completion_stream_generator(self, req: ChatCompletionRequest, request_id: str, job,
                                               prompt_len: int) -> AsyncIterator[str]:
        model, created = self.model_name(req), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    usage=usage).model_dump(exclude_none=True))

        completion_tokens = 0
        try:
            for i in range(req.n):       # the role first, as OpenAI does
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                            content=""))])
            async for output in self.generate(job):
                for c in output.outputs:
                    OpenAIServingCompletion._raise_if_failed(c)
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text), logprobs=logprobs,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            if include_usage:
                yield chunk([], UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                                          total_tokens=prompt_len + completion_tokens))
        except Exception as e:                     # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(e)
        yield sse("[DONE]")

    @staticmethod
    def _logprobs(c: CompletionOutput, top_logprobs: int) -> ChatCompletionLogProbs:
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry.get(token_id)
            token = (chosen.decoded_token or "") if chosen is not None else ""
            top = sorted((lp for lp in entry.values() if lp.rank <= top_logprobs), key=lambda lp: lp.rank)
            content.append(ChatLogProbsContent(
                token=token, logprob=chosen.logprob if chosen is not None else -9999.0,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[ChatLogProb(token=lp.decoded_token or "", logprob=lp.logprob,
                                          bytes=list((lp.decoded_token or "").encode("utf-8"))) for lp in top]))
        return ChatCompletionLogProbs(content=content)
