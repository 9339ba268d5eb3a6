"""Beam search: the W most likely continuations, kept as W beams that fork and die on shared blocks.

Why here: beam search is where PagedAttention's block sharing pays most ([Kwon 2025, §3.4.4]):
the W beams of one prompt share the prompt and most of their past, and each step some beams
spawn several continuations while others are dropped. With a contiguous cache every fork is a
copy of the whole sequence; with blocks it is a reference count, plus at most one partly filled
block copied when two forks write different tokens into it.

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

vLLM v1 runs beam search in the front end (`vllm/entrypoints/llm.py: LLM.beam_search`: one
single-token request per beam per step, sharing through the prefix cache, scored by vLLM's own
`get_beam_search_score`, which normalises by the length *including* the prompt and has no early
stopping). This engine does it inside, as vLLM v0 did with `SequenceGroup.fork` and
`BeamSearchScorer`: the running beams are W requests ("slots") whose block tables are re-pointed
after every step (`beam_search_scheduler.py`), and the scores follow HF so that HF is the oracle.
The API is vLLM's: `LLM.beam_search(prompts, BeamSearchParams(...)) -> [BeamSearchOutput]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_vllm.sampling_params import SamplingParams, _is_int, _is_real

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
class BeamSearchSamplingParams(SamplingParams):
    """What each beam of a beam search runs with inside the engine: greedy (its sampled token is
    never used — the beam search picks the next tokens), EOS handled by the search, not by the
    scheduler's stop check, and the search's own parameters."""
    beam_search: BeamSearchParams | None = None

    @classmethod
    def from_beam_search(cls, params: BeamSearchParams) -> "BeamSearchSamplingParams":
        return cls(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, beam_search=params)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that finish a beam: the model's EOS ids (filled in by the engine's Processor);
        none with ignore_eos."""
        return frozenset() if self.beam_search.ignore_eos else self._all_stop_token_ids

    @property
    def num_beam_candidates(self) -> int:
        """K: the candidates each beam proposes per step (HF keeps enough that W survive even if
        the best W all end in EOS)."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_search.beam_width


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
        W, K = self.params.beam_width, max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width
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
