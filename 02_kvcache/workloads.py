"""Synthetic workloads with the sharing patterns of the hit-rate table in [v1 prefix caching].

Each workload is a list of conversations; a conversation is a list of turns that must
run in order (turn k+1's prompt contains turn k's prompt AND its output). Single-turn
workloads are conversations of one turn. Token ids are arbitrary integers: only which
requests share which prefixes matters to a prefix cache, not what the tokens say.

    chatbot         fixed system prompt + a fresh user message       (table: 92-97% hit)
    multi_turn      system prompt + the growing conversation history (table: 80-95%)
    rag             shared instructions + a document drawn (Zipf) from a
                    pool, so popular documents recur + a question     (table: 25-40%)
    summarization   a 64-token instruction + a distinct document      (table: 8-15%)
    random          nothing shared                                    (table: 0-2%)
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Turn:
    prompt: list[int]
    output: list[int]


@dataclass
class Workload:
    name: str
    conversations: list[list[Turn]]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.conversations)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t.prompt) for c in self.conversations for t in c)


class _Tokens:
    """Fresh token ids: every call returns ids never used before (so nothing is shared by accident)."""

    def __init__(self, rng: random.Random):
        self.rng, self.next = rng, 100_000

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out

    def between(self, lo_hi: tuple[int, int]) -> int:
        return self.rng.randint(*lo_hi)


def chatbot(num_requests=200, system_len=512, user_len=(8, 48), output_len=(16, 128), seed=0) -> Workload:
    tok = _Tokens(random.Random(seed))
    system = tok.fresh(system_len)
    convs = [[Turn(system + tok.fresh(tok.between(user_len)), tok.fresh(tok.between(output_len)))]
             for _ in range(num_requests)]
    return Workload("chatbot", convs, dict(num_requests=num_requests, system_len=system_len, user_len=user_len,
                                           output_len=output_len, seed=seed))


def multi_turn(num_conversations=40, turns=5, system_len=256, user_len=(32, 256), output_len=(32, 256), seed=0) -> Workload:
    tok = _Tokens(random.Random(seed))
    system = tok.fresh(system_len)
    convs = []
    for _ in range(num_conversations):
        history, conv = list(system), []
        for _ in range(turns):
            prompt = history + tok.fresh(tok.between(user_len))
            output = tok.fresh(tok.between(output_len))
            conv.append(Turn(prompt, output))
            history = prompt + output
        convs.append(conv)
    return Workload("multi_turn", convs, dict(num_conversations=num_conversations, turns=turns, system_len=system_len,
                                              user_len=user_len, output_len=output_len, seed=seed))


def rag(num_requests=200, instruction_len=256, num_docs=500, doc_len=(1024, 2048), zipf_s=0.5,
        question_len=(16, 64), output_len=(32, 128), seed=0) -> Workload:
    rng = random.Random(seed)
    tok = _Tokens(rng)
    instruction = tok.fresh(instruction_len)
    docs = [tok.fresh(tok.between(doc_len)) for _ in range(num_docs)]
    weights = [1 / (k + 1) ** zipf_s for k in range(num_docs)]          # Zipf: some documents are popular
    convs = []
    for _ in range(num_requests):
        doc = rng.choices(docs, weights)[0]
        convs.append([Turn(instruction + doc + tok.fresh(tok.between(question_len)), tok.fresh(tok.between(output_len)))])
    return Workload("rag", convs, dict(num_requests=num_requests, instruction_len=instruction_len, num_docs=num_docs,
                                       doc_len=doc_len, zipf_s=zipf_s, question_len=question_len,
                                       output_len=output_len, seed=seed))


def summarization(num_requests=200, instruction_len=64, doc_len=(256, 768), output_len=(32, 128), seed=0) -> Workload:
    tok = _Tokens(random.Random(seed))
    instruction = tok.fresh(instruction_len)
    convs = [[Turn(instruction + tok.fresh(tok.between(doc_len)), tok.fresh(tok.between(output_len)))]
             for _ in range(num_requests)]
    return Workload("summarization", convs, dict(num_requests=num_requests, instruction_len=instruction_len,
                                                 doc_len=doc_len, output_len=output_len, seed=seed))


def random_prompts(num_requests=200, prompt_len=(256, 1024), output_len=(32, 128), seed=0) -> Workload:
    tok = _Tokens(random.Random(seed))
    convs = [[Turn(tok.fresh(tok.between(prompt_len)), tok.fresh(tok.between(output_len)))] for _ in range(num_requests)]
    return Workload("random", convs, dict(num_requests=num_requests, prompt_len=prompt_len, output_len=output_len, seed=seed))


WORKLOADS = {"chatbot": chatbot, "multi_turn": multi_turn, "rag": rag, "summarization": summarization,
             "random": random_prompts}
