"""StructuredOutputManager: the engine core's half of structured output (vLLM: `vllm/v1/structured_output/__init__.py`).

A constrained request's tokens must stay inside a language (a JSON schema's documents, a regex, a
grammar). The work splits the way vLLM splits it:
  * the CORE (this file, with the scheduler) owns one grammar per request: compiled off the step
    (a worker thread; the request waits until it is ready), advanced with every token the request
    keeps (`accept_tokens`), asked which tokens may come next (`grammar_bitmask`) and which drafts
    may stay (`validate_tokens`);
  * the RUNNER only applies the bitmask to the logits before sampling (model_runner.py).

Each step the scheduler hands its output to the core, and the core starts `grammar_bitmask` on the
manager's thread *before* the forward: the masks are computed while the model runs (the grammar
walk is Python, the forward releases the GIL in its kernels), and the runner waits for them only
when it samples (`GrammarOutput.bitmask`). vLLM 0.32 gets the same overlap by running the forward
non-blocking and calling `sample_tokens(grammar_output)` after. An executor that sends the step to
other processes serialises the GrammarOutput, which waits for the masks first.

With speculative decoding a request with k drafts gets k + 1 rows: row i is the mask after its
first i drafts (advanced tentatively, then rolled back), so the rejection sampler verifies every
draft position against the grammar; drafts the grammar rejects are cut before they are scheduled
(`validate_tokens`, in `update_draft_token_ids`).

The backend (who compiles grammars) is chapter 08's or real xgrammar, found by name through
structured_output_backend.py; an engine that never sees a constrained request never loads one.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from mini_vllm.structured_output_backend import (StructuredOutputBackend, StructuredOutputGrammar, load_backend,
                                                 structured_output_key)


class StructuredOutputRequest:
    """One request's grammar, compiled in the background (vLLM: `vllm/v1/structured_output/request.py`)."""

    def __init__(self, future: Future):
        self._future = future

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (once ready), else None."""
        e = self._future.exception() if self._future.done() else None
        return None if e is None else f"structured output: {e}"

    @property
    def grammar(self) -> StructuredOutputGrammar:
        return self._future.result()


class GrammarOutput:
    """The step's masks (vLLM's name): `request_rows` {req_id: first bitmask row} in the order the
    rows were filled, each request owning 1 + its scheduled drafts rows; `bitmask` [rows, words]
    int32 and `dead_ends` (requests whose grammar no token of the vocabulary can continue: their
    rows allow everything, and the runner fails them) wait for the manager's thread."""

    def __init__(self, request_rows: dict[str, int], future: Future | None, result=None):
        self.request_rows, self._future, self._result = request_rows, future, result

    def _get(self) -> tuple[torch.Tensor, set[str]]:
        if self._result is None:
            self._result = self._future.result()
        return self._result

    @property
    def bitmask(self) -> torch.Tensor:
        return self._get()[0]

    @property
    def dead_ends(self) -> set[str]:
        return self._get()[1]

    def __reduce__(self):             # to another process: the finished masks, not the future
        return GrammarOutput, (self.request_rows, None, self._get())


class StructuredOutputManager:
    def __init__(self, backend_name: str, tokenizer_loader, vocab_size: int, eos_token_ids):
        self.backend_name, self.vocab_size = backend_name, vocab_size
        self._tokenizer_loader, self._eos = tokenizer_loader, set(eos_token_ids)
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self.num_compiling = 0           # grammars submitted and not finished (ready or failed)
        # One thread: compiles and bitmask fills run in submission order, never two at once on one grammar.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="structured_output")

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = load_backend(self.backend_name, self._tokenizer_loader(), self.vocab_size, self._eos)
            return self._backend

    @property
    def in_use(self) -> bool:
        """Has any grammar been compiled? Until one has, no request can have one to advance or mask:
        the scheduler's per-step hooks skip their loops (host time of every unconstrained step)."""
        return self._backend is not None

    # ------------------------------------------------------------------ per request
    def grammar_init(self, request) -> None:
        """Start compiling `request`'s grammar (vLLM: grammar_init); the scheduler admits the
        request once it is ready, or fails it with the compile error."""
        params = request.sampling_params.structured_outputs
        kind, spec, any_whitespace = structured_output_key(params)
        with self._lock:
            self.num_compiling += 1
        future = self._thread.submit(lambda: self.backend.compile_grammar(kind, spec, any_whitespace))
        future.add_done_callback(self._compiled)
        request.structured_output_request = StructuredOutputRequest(future)

    def _compiled(self, _future: Future) -> None:
        with self._lock:
            self.num_compiling -= 1

    @staticmethod
    def should_advance(request) -> bool:
        so = getattr(request, "structured_output_request", None)
        return so is not None and so.ready and so.error is None

    def accept_tokens(self, request, token_ids: list[int]) -> bool:
        """Advance the request's grammar over tokens it kept; False if the grammar refuses one (a bug:
        the mask allowed only tokens it accepts)."""
        if not token_ids or not self.should_advance(request):
            return True
        return request.structured_output_request.grammar.accept_tokens(request.request_id, token_ids)

    def validate_tokens(self, request, draft_token_ids: list[int]) -> list[int]:
        """The drafts the grammar allows from here (a prefix), the grammar unchanged."""
        if not draft_token_ids or not self.should_advance(request):
            return draft_token_ids
        return request.structured_output_request.grammar.validate_tokens(draft_token_ids)

    # ------------------------------------------------------------------ per step
    def grammar_bitmask(self, requests: dict[str, Any], req_ids: list[str],
                        spec_tokens: dict[str, list[int]]) -> GrammarOutput | None:
        """Start filling the masks of `req_ids` (requests that sample this step) on the manager's
        thread; the runner waits for them when it samples."""
        if not req_ids:
            return None
        rows, n = {}, 0
        for req_id in req_ids:
            rows[req_id] = n
            n += 1 + len(spec_tokens.get(req_id, ()))
        grammars = [(requests[r].request_id, requests[r].structured_output_request.grammar, spec_tokens.get(r, []))
                    for r in req_ids]
        return GrammarOutput(rows, self._thread.submit(self._fill, grammars, n))

    def _fill(self, grammars: list[tuple[str, StructuredOutputGrammar, list[int]]],
              num_rows: int) -> tuple[torch.Tensor, set[str]]:
        bitmask = self.backend.allocate_token_bitmask(num_rows)          # [rows, words], all allowed
        row, dead_ends = 0, set()
        for req_id, grammar, drafts in grammars:
            self._fill_row(grammar, bitmask, row)
            if not bitmask[row].any():         # nothing can follow: sampling from it would be NaN
                dead_ends.add(req_id)
                bitmask[row].fill_(-1)
            advanced, ok = 0, True
            for token in drafts:               # row i + 1: the mask after the first i + 1 drafts
                row += 1
                ok = ok and grammar.accept_tokens(req_id, [token])
                if ok:
                    advanced += 1
                    self._fill_row(grammar, bitmask, row)
                else:                          # (validated drafts: only a bug gets here)
                    bitmask[row].copy_(bitmask[row - 1])
            if advanced:
                grammar.rollback(advanced)
            row += 1
        return bitmask, dead_ends

    @staticmethod
    def _fill_row(grammar: StructuredOutputGrammar, bitmask: torch.Tensor, row: int) -> None:
        """A finished grammar (it took EOS: ignore_eos, or a draft after EOS) constrains nothing more,
        as in vLLM: an all-zero row would leave the sampler nothing to draw."""
        if not grammar.is_terminated():
            grammar.fill_bitmask(bitmask, row)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the grammars being compiled (an idle engine waits here instead of
        spinning: its empty steps would hold the GIL the compiling thread needs)."""
        try:
            self._thread.submit(lambda: None).result(timeout=timeout_s)
        except TimeoutError:
            pass

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        if self._backend is not None:
            self._backend.destroy()
