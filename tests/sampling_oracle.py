"""An independent NumPy version of vLLM's logits processors and penalties, the oracle of
chapter 07's logits_processors.py (unit tests) and of the engine (as an HF LogitsProcessor); and
the bound the distributional tests hold samples to."""
from __future__ import annotations

import math

import numpy as np


def numpy_vllm_row(logits: np.ndarray, p, prompt: list[int], output: list[int]) -> np.ndarray:
    """vLLM's sampler steps 3-6 for one row (allowed_token_ids, bad words over the output,
    min_tokens, logit_bias, then the repetition / frequency / presence penalties), written out
    token by token in NumPy from vLLM's definitions. logits [V]; p a prepared SamplingParams
    (its stop ids and bad words' token ids filled in)."""
    V = logits.shape[-1]
    x = logits.astype(np.float64).copy()
    if p.allowed_token_ids is not None:
        keep = np.zeros(V, dtype=bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -np.inf
    for word in p._bad_words_token_ids:
        prefix = list(word[:-1])
        if len(output) >= len(prefix) and (not prefix or output[len(output) - len(prefix):] == prefix):
            x[word[-1]] = -np.inf
    if len(output) < p.min_tokens:
        for t in p._all_stop_token_ids:
            x[t] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):           # every other token is left as it is
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def bhc_eps(num_outcomes: int, num_draws: int, delta: float = 1e-6) -> float:
    """Bretagnolle–Huber–Carol: P(‖p̂ − p‖₁ ≥ ε) ≤ 2^V·exp(−Nε²/2) — the ε at which a correct
    sampler fails with probability at most `delta` (V outcomes, N draws)."""
    return math.sqrt(2 * (num_outcomes * math.log(2) + math.log(1 / delta)) / num_draws)
