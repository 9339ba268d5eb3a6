"""LLM: the offline API — a batch of prompts in, a list of RequestOutputs out.

Mirrors vLLM's `vllm/entrypoints/llm.py: LLM` (`generate`, `chat`, `_validate_and_add_requests`,
`_run_engine` with its progress bar):

    from mini_vllm import LLM, SamplingParams
    llm = LLM()                                   # the default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is", "def fibonacci(n):"],
                           SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text, outputs[0].metrics.time_to_first_token)
    best = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=16))
    print(best[0].sequences[0].text)
    llm = LLM(enable_lora=True, max_loras=2)      # chapter 09: adapters per request
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

All prompts are validated and tokenized before the first one is queued: a bad prompt in a
batch raises without starting any of it. Outputs come back in the order of the prompts.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from mini_vllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from mini_vllm.engine_config import EngineConfig
from mini_vllm.llm_engine import LLMEngine
from mini_vllm.lora_request import LoRARequest
from mini_vllm.outputs import RequestOutput
from mini_vllm.processor import PromptType
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts) -> list[PromptType]:
    """One prompt (text, token ids, a dict) or a list of them -> a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("no prompts given")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]              # one prompt as token ids
        return list(prompts)
    raise TypeError(f"prompts must be a str, token ids, a dict, or a list of them; got {type(prompts).__name__}")


class LLM:
    def __init__(self, model: str | None = None, *, multiprocess_mode: bool | None = None, **kwargs):
        """kwargs: any EngineConfig field (dtype, max_model_len, max_num_seqs, enable_prefix_caching, ...).
        multiprocess_mode: the engine core in its own process; None reads VLLM_ENABLE_V1_MULTIPROCESSING."""
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs), multiprocess_mode=multiprocess_mode)
        self._request_counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no SamplingParams: the model's generation_config.json
        recommendations over SamplingParams' defaults (EngineConfig.generation_config)."""
        return self.llm_engine.get_default_sampling_params()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks: each timed run starts cold). False, changing
        nothing, while a request holds blocks."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 kv_transfer_params: Mapping | Sequence[Mapping | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """kv_transfer_params (needs kv_transfer_config): one dict for every prompt, or one per
        prompt — {"do_remote_decode": True} on a prefill engine; on a decode engine the
        `kv_transfer_params` of the prefill engine's RequestOutput.
        lora_request (needs enable_lora): the adapter for every prompt, or one per prompt (None: the
        base model)."""
        prompt_list = _as_prompt_list(prompts)
        return self._run(prompt_list, [None] * len(prompt_list), sampling_params, use_tqdm, priority,
                         kv_transfer_params, lora_request)

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """The beam_width most likely continuations of each prompt (vLLM's LLM.beam_search; the
        search itself is HF's, see beam_search.py): a loop of rounds, each one request of one token
        per running beam of every search, through `generate`. Sequences hold the prompt and the
        generated tokens, best first. A search the engine failed comes back with one sequence whose
        finish_reason is "error" and whose stop_reason says why; the others are unaffected."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        probe = SamplingParams(max_tokens=1)
        prompt_ids = [engine.processor.process_inputs(p, probe)[1] for p in _as_prompt_list(prompts)]   # all first
        loras = self._per_prompt(lora_request, len(prompt_ids), "lora_request")
        eos = frozenset(engine.model_config.eos_token_ids)
        searches = [(BeamSearch(params, ids, engine.model_config.max_model_len, eos), lora)
                    for ids, lora in zip(prompt_ids, loras)]
        while running := [(s, lora) for s, lora in searches if not s.done]:
            rounds = [(s, lora, s.requests()) for s, lora in running]
            outputs = iter(self._run([None] * sum(len(r) for _, _, r in rounds),
                                     [ids for _, _, r in rounds for ids in r],
                                     [s.request_params for s, _, r in rounds for _ in r], use_tqdm=False, priority=None,
                                     lora_request=[lora for _, lora, r in rounds for _ in r]))
            for search, _, requests in rounds:
                search.advance([next(outputs).outputs[0] for _ in requests])
        return [s.output(engine.tokenizer) for s, _ in searches]

    def shutdown(self) -> None:
        """Stop the engine's KV connector (servers, threads) and its executor's worker processes."""
        self.llm_engine.shutdown()

    def chat(self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: Mapping | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        rendered = [self.llm_engine.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)
                    for c in conversations]
        return self._run([text for text, _ in rendered], [ids for _, ids in rendered], sampling_params,
                         use_tqdm, None, lora_request=lora_request)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _per_prompt(value, n: int, what: str) -> list:
        """One value for every prompt (a single value, or None) or a list of one per prompt."""
        if value is None or not isinstance(value, (list, tuple)):
            return [value] * n
        if len(value) != n:
            raise ValueError(f"{len(value)} {what} for {n} prompts")
        return list(value)

    def _run(self, prompts: list, token_ids: list, sampling_params, use_tqdm: bool, priority,
             kv_transfer_params=None, lora_request=None) -> list[RequestOutput]:
        n = len(prompts)
        if kv_transfer_params is None or isinstance(kv_transfer_params, Mapping):
            kv_params_list = [dict(kv_transfer_params) if kv_transfer_params else None] * n
        else:
            kv_params_list = list(kv_transfer_params)
            if len(kv_params_list) != n:
                raise ValueError(f"{len(kv_params_list)} kv_transfer_params for {n} prompts")
        lora_list = self._per_prompt(lora_request, n, "lora_request")
        if isinstance(sampling_params, BeamSearchParams):
            raise TypeError("BeamSearchParams go to LLM.beam_search(prompts, params), not generate()")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"{len(params_list)} SamplingParams for {n} prompts")
        if priority is not None and len(priority) != n:
            raise ValueError(f"{len(priority)} priorities for {n} prompts")
        engine = self.llm_engine
        for lora in dict.fromkeys(lora_list):                # bad adapters are refused before anything runs
            engine.loras.check(lora)
        # Validate and tokenize everything first: a bad prompt changes nothing.
        requests = []
        for i, (prompt, ids, params) in enumerate(zip(prompts, token_ids, params_list)):
            if ids is None:
                text, ids = engine.processor.process_inputs(prompt, params)
            else:
                text = prompt
            # One output per request, when it finishes (vLLM's LLM does the same).
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            requests.append((f"{next(self._request_counter)}", text, ids, params, priority[i] if priority else 0,
                             kv_params_list[i], lora_list[i]))
        added: list[str] = []
        try:
            for request_id, text, ids, params, prio, kv_params, lora in requests:
                engine.add_request(request_id, text, params, priority=prio, prompt_token_ids=ids,
                                   kv_transfer_params=kv_params, lora_request=lora)
                added.append(request_id)
        except BaseException:
            engine.abort_request(added)
            raise
        return self._run_engine(added, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(request_ids)) if use_tqdm and len(request_ids) > 1 else None
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(output)
        except BaseException:
            # Leave the engine serviceable: drop what this call queued (frees their KV blocks).
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[r] for r in request_ids]


class _Progress:
    """A rich progress bar over finished requests, with generation speed (vLLM shows tqdm's)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]Processed prompts"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[speed]}"), transient=False)
        self.task = self.progress.add_task("generate", total=total, speed="")
        self.output_tokens = 0
        self.progress.start()

    def update(self, output: RequestOutput) -> None:
        self.output_tokens += sum(len(o.token_ids) for o in output.outputs)      # n > 1: every child
        elapsed = self.progress.tasks[0].elapsed or 1e-9
        self.progress.update(self.task, advance=1, speed=f"output {self.output_tokens / elapsed:,.1f} tok/s")

    def close(self) -> None:
        self.progress.stop()
