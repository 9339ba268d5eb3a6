"""Beam search: the W most likely continuations, as a loop in the front end over one-token requests.

What it computes — Hugging Face's beam search (`GenerationMixin._beam_search`, transformers 5),
so the best beam equals `generate(num_beams=W, do_sample=False, length_penalty=..., early_stopping=...)`.
Per prompt, with K = max(2, 1 + #EOS ids) * W candidates per step:

1. every running beam b (cumulative log-probability s_b) proposes its K most likely tokens v with
   score s_b + log p(v | beam b); the K best over all beams are the step's candidates;
2. a candidate ending in EOS (or reaching max_tokens) among the best W is a finished hypothesis,
   scored s / (generated length ** length_penalty); the W best hypotheses so far are kept;
3. the W best candidates that did not finish are the next running beams;
4. stop when no running beam can beat the worst kept hypothesis (`early_stopping`: False — HF's
   default heuristic, judged at the current length; True — as soon as W hypotheses exist;
   "never" — judged at max_tokens when length_penalty > 0, the canonical search), or at max_tokens.
   Width 1 is greedy search (HF's generate runs greedy search for num_beams=1).

How, as vLLM v1 does it (`vllm/entrypoints/generate/beam_search/offline.py:
BeamSearchOfflineMixin.beam_search`, `online.py` for the server): the engine knows nothing of
beams. Each round, every running beam is an ordinary request — the prompt and the beam's tokens,
`max_tokens=1`, greedy, `logprobs=K` — and its K most likely next tokens come back as that token's
logprobs; `BeamSearchState.step` picks the next W beams. The beams of a search share the prompt
and most of their past: the prefix cache makes re-submitting them cheap (each round computes only
the tokens after the last full cached block of each beam). vLLM v0 kept the beams inside the
engine instead, forking block tables with copy-on-write (chapter 02's `BlockSpaceManager.fork`);
the front-end loop needs nothing from the scheduler or the model runner, so beam search composes
with every engine feature. vLLM scores with its own `get_beam_search_score`; the scores here
follow HF so that HF is the oracle. The API is vLLM's: `LLM.beam_search(prompts,
BeamSearchParams(...)) -> [BeamSearchOutput]`, and `AsyncLLM.beam_search` for the server.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_vllm.outputs import CompletionOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams, _is_int, _is_real

EARLY_STOPPING = (True, False, "never")


@dataclass
class BeamSearchParams:
    """vLLM's `vllm/sampling_params.py: BeamSearchParams`, plus HF's `early_stopping` (vLLM v0's
    SamplingParams had it too) to say which of HF's three stopping rules the search follows."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.length_penalty) or self.length_penalty != self.length_penalty \
                or abs(self.length_penalty) == float("inf"):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not any(self.early_stopping is e for e in EARLY_STOPPING[:2]) and self.early_stopping != "never":
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's BeamSearchSequence): the prompt AND the generated tokens."""
    tokens: list[int]
    logprobs: list[float]                 # the log-probability of each generated token
    cum_logprob: float
    score: float                          # cum_logprob / generated_len ** length_penalty (HF's sequences_scores)
    text: str | None = None
    finish_reason: str | None = None      # "stop" (an EOS id) or "length"
    stop_reason: int | None = None        # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the beam_width best sequences, best first."""
    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    """A running or finished beam: the generated tokens, their log-probabilities and ranks
    (1 = the most likely token at that step), and the sum of the log-probabilities."""
    tokens: list[int]
    logprobs: list[float]
    ranks: list[int]
    cum_logprob: float                    # a float32 value: HF sums in float32; so do we


def beam_score(cum_logprob: float, generated_len: int, length_penalty: float) -> float:
    """HF's score of a finished hypothesis: the sum of log-probabilities over the generated
    length (EOS included) ** length_penalty, in float32 as HF computes it."""
    return float(torch.tensor(cum_logprob, dtype=torch.float32) / (generated_len ** length_penalty))


@dataclass
class Selection:
    """One step's outcome for a search: `next_beams[i]` = (index of the running beam it continues,
    its token, its log-probability, its new cumulative log-probability), best first."""
    next_beams: list[tuple[int, int, float, float]]
    done: bool


@dataclass
class BeamSearchState:
    """One prompt's search, HF's rules step by step (independent of any engine: the engine feeds
    it each running beam's K candidates and applies the Selection to its blocks)."""
    params: BeamSearchParams
    prompt_len: int
    max_length: int                       # prompt_len + max_tokens (capped by the model's length)
    eos_token_ids: frozenset[int]
    running: list[Beam] = field(default_factory=list)
    finished: list[tuple[float, Beam]] = field(default_factory=list)   # (score, beam), best first, <= W

    def __post_init__(self):
        if not self.running:
            self.running = [Beam([], [], [], 0.0)]     # the prompt alone: HF's beams 1..W-1 start at -1e9

    @property
    def cur_len(self) -> int:
        return self.prompt_len + len(self.running[0].tokens)

    def step(self, candidates: list[tuple[list[int], list[float]]]) -> Selection:
        """candidates[b] = (token ids, log-probabilities) of running beam b's K most likely tokens."""
        W, K = self.params.beam_width, num_candidates(self.params.beam_width, self.eos_token_ids)
        # 1. the K best candidates over all beams
        ### BEGIN SOLUTION
        beam_of = torch.tensor([b for b, (ids, _) in enumerate(candidates) for _ in ids])          # [B*K]
        rank = [r for ids, _ in candidates for r in range(1, len(ids) + 1)]                      # [B*K]
        token = torch.tensor([t for ids, _ in candidates for t in ids])                          # [B*K]
        logprob = torch.tensor([x for _, lps in candidates for x in lps], dtype=torch.float32)   # [B*K]
        scores = torch.tensor([b.cum_logprob for b in self.running], dtype=torch.float32)         # [B]
        acc = scores[beam_of] + logprob                                                          # [B*K] fp32
        top_acc, top = torch.topk(acc, k=min(K, acc.numel()))                                    # [K], best first
        gen_len = self.cur_len + 1 - self.prompt_len
        hits = [int(token[j]) in self.eos_token_ids or self.cur_len + 1 >= self.max_length for j in top.tolist()]
        # 2. finished hypotheses: only among the best W (the rest are spares for step 3)
        for i, j in enumerate(top.tolist()[:W]):
            if hits[i]:
                beam = self._extend(int(beam_of[j]), int(token[j]), float(logprob[j]), rank[j], float(top_acc[i]))
                self._add_finished(beam_score(beam.cum_logprob, gen_len, self.params.length_penalty), beam)
        # 3. the W best that go on
        alive = [int(top[i]) for i in range(len(hits)) if not hits[i]][:W]
        next_beams = [(int(beam_of[j]), int(token[j]), float(logprob[j]), float(acc[j])) for j in alive]
        self.running = [self._extend(b, t, lp, rank[j], s) for (b, t, lp, s), j in zip(next_beams, alive)]
        # (Width 1 stops at its first hypothesis: HF's generate(num_beams=1) is greedy search.)
        done = not self.running or all(hits) or self._cannot_improve() or (
            (self.params.early_stopping is True or W == 1) and len(self.finished) == W)
        ### END SOLUTION
        return Selection(next_beams, done)

    def _extend(self, b: int, token: int, logprob: float, rank: int, cum_logprob: float) -> Beam:
        beam = self.running[b]
        return Beam(beam.tokens + [token], beam.logprobs + [logprob], beam.ranks + [rank], cum_logprob)

    def _add_finished(self, score: float, beam: Beam) -> None:
        self.finished.append((score, beam))
        self.finished.sort(key=lambda x: -x[0])     # stable: an earlier hypothesis wins a tie, as in HF
        del self.finished[self.params.beam_width:]

    def _cannot_improve(self) -> bool:
        """HF's `_check_early_stop_heuristic`: can the best running beam still beat the worst kept
        hypothesis? Judged at the current length, or at max_length for "never" with a positive
        length penalty (a longer beam then scores higher)."""
        if len(self.finished) < self.params.beam_width:
            return False
        p = self.params.length_penalty
        length = (self.max_length if self.params.early_stopping == "never" and p > 0 else self.cur_len) - self.prompt_len
        return not beam_score(self.running[0].cum_logprob, length, p) > self.finished[-1][0]

    def result(self) -> list[tuple[float, Beam]]:
        """The beam_width best hypotheses, best first (HF returns its kept hypotheses; if the
        search stopped with fewer — it cannot, max_length finishes every running beam — the
        running beams would fill up the list)."""
        return list(self.finished)


def num_candidates(beam_width: int, eos_token_ids: frozenset[int]) -> int:
    """K: the candidates each beam proposes per step (HF keeps enough that W survive even if the
    best W all end in EOS)."""
    return max(2, 1 + len(eos_token_ids)) * beam_width


class BeamSearch:
    """One prompt's search, driven by an engine a round at a time (LLM.beam_search, AsyncLLM.beam_search):

        search = BeamSearch(params, prompt_token_ids, max_model_len, eos_token_ids)
        while not search.done:
            outputs = [<run one request: token_ids, search.request_params> for token_ids in search.requests()]
            search.advance(outputs)          # each request's CompletionOutput (its one token's logprobs)
        search.output(tokenizer)

    A round whose request failed (finish_reason "error") ends the search with that error."""

    def __init__(self, params: BeamSearchParams, prompt_token_ids: list[int], max_model_len: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.state = BeamSearchState(params, len(prompt_token_ids),
                                     min(len(prompt_token_ids) + params.max_tokens, max_model_len), eos)
        self.k = num_candidates(params.beam_width, eos)
        # Each beam's request: its next token's K most likely tokens, nothing else (no text, no stop).
        self.request_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.k, ignore_eos=True,
                                             detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        self.done = False
        self.error: str | None = None

    def requests(self) -> list[list[int]]:
        """This round's requests: the prompt + each running beam's tokens."""
        return [self.prompt_token_ids + beam.tokens for beam in self.state.running]

    def advance(self, outputs: list[CompletionOutput]) -> None:
        """The round's outputs, one per request of `requests()`, in that order."""
        failed = next((o for o in outputs if o.finish_reason == "error"), None)
        if failed is not None:
            self.done, self.error = True, str(failed.stop_reason)
            return
        candidates = []
        for output in outputs:
            ranked = sorted(output.logprobs[0].items(), key=lambda item: item[1].rank)[:self.k]   # rank 1..K
            candidates.append(([token for token, _ in ranked], [lp.logprob for _, lp in ranked]))
        self.done = self.state.step(candidates).done

    def output(self, tokenizer) -> BeamSearchOutput:
        """The best hypotheses, best first (vLLM's BeamSearchOutput): the prompt and the generated
        tokens; "stop" for a beam that ended in an EOS id (its text without it, unless
        include_stop_str_in_output), else "length"."""
        if self.error is not None:
            return BeamSearchOutput([BeamSearchSequence(list(self.prompt_token_ids), [], 0.0, float("-inf"),
                                                        "", "error", self.error)])
        params, eos = self.state.params, self.state.eos_token_ids
        sequences = []
        for score, beam in self.state.result():
            ended = bool(beam.tokens) and beam.tokens[-1] in eos
            shown = beam.tokens[:-1] if ended and not params.include_stop_str_in_output else beam.tokens
            text = tokenizer.decode(shown, skip_special_tokens=not params.include_stop_str_in_output)
            sequences.append(BeamSearchSequence(self.prompt_token_ids + beam.tokens, list(beam.logprobs),
                                                beam.cum_logprob, score, text, "stop" if ended else "length",
                                                beam.tokens[-1] if ended else None))
        return BeamSearchOutput(sequences)
