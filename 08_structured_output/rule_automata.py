"""A grammar compiled to one small byte automaton per rule: the pieces a pushdown automaton runs.

A context-free grammar is a set of regular expressions (each rule's right-hand side) that may CALL each
other. So each rule becomes a finite automaton whose edges are either a byte or a call to a rule; the
pushdown automaton (pda.py) keeps a stack of "where to return to" when it follows a call. This is how
xgrammar stores a grammar too (one FSM per rule, with rule-reference edges, in `grammar_functor` /
`fsm_builder`), and llama.cpp's grammar sampler walks the same kind of structure.

Why bytes, not characters: tokens are byte strings and a byte-level BPE token may end inside a
multi-byte character, so "[^\\"]" must accept the first byte of "é" on its own. A character class
becomes the UTF-8 byte-range sequences of its code points (utf8_ranges.py).

Two steps per rule, the textbook ones:
  1. Thompson's construction: the rule's tree -> an NFA with empty (epsilon) edges;
  2. subset construction (then Moore's minimisation): -> a DFA over the alphabet {bytes} + {calls}.
     A rule call is just another letter here; substituting the callee's language for that letter
     afterwards gives the same language, so determinising is safe. The DFA has at most one edge per byte and per callee: the
     only nondeterminism left for the PDA is "enter this rule or read this byte" and "return or
     go on" — the part no finite automaton can resolve.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from structured_output.grammar_tree import CharClass, Choice, Expr, Grammar, Literal, Repeat, RuleRef, Sequence
from structured_output.utf8_ranges import utf8_sequences
from structured_output.regex_dfa import epsilon_closure


@dataclass
class Node:
    """One state of one rule's DFA."""
    rule: int                                               # index into RuleAutomata.rule_names
    edges: dict[int, int] = field(default_factory=dict)     # byte -> next node (same rule)
    calls: list[tuple[int, int]] = field(default_factory=list)   # (callee rule, node to return to)
    final: bool = False                                     # the rule may end here


@dataclass
class RuleAutomata:
    rule_names: list[str]
    rule_start: list[int]                                   # rule index -> its start node
    nodes: list[Node]                                       # every rule's nodes, one global numbering
    root: int                                               # index of the root rule

    def describe(self, node: int) -> str:
        """'rule@k': node k of that rule's DFA (k counted from the rule's start), for debugging."""
        rule = self.nodes[node].rule
        return f"{self.rule_names[rule]}@{node - self.rule_start[rule]}"


def build_rule_automata(grammar: Grammar) -> RuleAutomata:
    names = list(grammar.rules)
    index = {name: i for i, name in enumerate(names)}
    nodes: list[Node] = []
    starts = []
    for i, name in enumerate(names):
        nfa = _NFA(index)
        start, end = nfa.new(), nfa.new()
        nfa.add(grammar.rules[name], start, end)
        starts.append(len(nodes))
        nodes.extend(_minimize(_determinize(nfa, start, end, rule=i, first_id=len(nodes)), first_id=len(nodes)))
    return RuleAutomata(names, starts, nodes, index[grammar.root])


class _NFA:
    """Thompson's construction: `add(e, src, dst)` wires edges so that the paths src -> dst spell e."""

    def __init__(self, rule_index: dict[str, int]):
        self.rule_index = rule_index
        self.eps: list[list[int]] = []
        self.bytes: list[list[tuple[int, int, int]]] = []   # (lo, hi, target): one byte in lo..hi
        self.calls: list[list[tuple[int, int]]] = []        # (callee rule, target)

    def new(self) -> int:
        self.eps.append([])
        self.bytes.append([])
        self.calls.append([])
        return len(self.eps) - 1

    def chain(self, byte_ranges: list[tuple[int, int]], src: int, dst: int) -> None:
        """src -> dst through one byte range per step (a literal's bytes, one UTF-8 sequence)."""
        if not byte_ranges:
            self.eps[src].append(dst)
        for k, (lo, hi) in enumerate(byte_ranges):
            nxt = dst if k == len(byte_ranges) - 1 else self.new()
            self.bytes[src].append((lo, hi, nxt))
            src = nxt

    def add(self, e: Expr, src: int, dst: int) -> None:
        if isinstance(e, Literal):
            self.chain([(b, b) for b in e.text.encode("utf-8")], src, dst)
        elif isinstance(e, CharClass):
            for seq in utf8_sequences(e.codepoint_ranges()):
                self.chain(seq, src, dst)
        elif isinstance(e, RuleRef):
            self.calls[src].append((self.rule_index[e.name], dst))
        elif isinstance(e, Sequence):
            for k, item in enumerate(e.items):
                nxt = dst if k == len(e.items) - 1 else self.new()
                self.add(item, src, nxt)
                src = nxt
        elif isinstance(e, Choice):
            for alt in e.alternatives:
                self.add(alt, src, dst)
        else:
            self.add_repeat(e, src, dst)

    def add_repeat(self, e: Repeat, src: int, dst: int) -> None:
        for _ in range(e.min):                              # the copies that must be there
            nxt = self.new()
            self.add(e.item, src, nxt)
            src = nxt
        if e.max is None:                                   # then a loop, on a fresh state: a loop
            loop = self.new()                               # on `src` would also loop whatever else
            self.eps[src].append(loop)                      # starts at src (another alternative)
            self.add(e.item, loop, loop)
            src = loop
        else:                                               # ... or (max - min) optional copies
            for _ in range(e.max - e.min):
                self.eps[src].append(dst)
                nxt = self.new()
                self.add(e.item, src, nxt)
                src = nxt
        self.eps[src].append(dst)

    def closure(self, states) -> frozenset[int]:
        return epsilon_closure(self.eps, states)


def _determinize(nfa: _NFA, start: int, end: int, rule: int, first_id: int) -> list[Node]:
    """Subset construction over bytes and calls; DFA node ids start at `first_id`."""
    ids: dict[frozenset[int], int] = {}
    subsets: list[frozenset[int]] = []

    def node_of(subset: frozenset[int]) -> int:
        if subset not in ids:
            ids[subset] = first_id + len(subsets)
            subsets.append(subset)
        return ids[subset]

    node_of(nfa.closure([start]))
    out: list[Node] = []
    while len(out) < len(subsets):                          # subsets grows while we walk it
        subset = subsets[len(out)]
        by_byte: dict[int, set[int]] = {}
        by_rule: dict[int, set[int]] = {}
        for s in subset:
            for lo, hi, t in nfa.bytes[s]:
                for b in range(lo, hi + 1):
                    by_byte.setdefault(b, set()).add(t)
            for callee, t in nfa.calls[s]:
                by_rule.setdefault(callee, set()).add(t)
        closed: dict[frozenset[int], int] = {}              # many bytes share one target set
        edges = {}
        for b, ts in sorted(by_byte.items()):
            key = frozenset(ts)
            if key not in closed:
                closed[key] = node_of(nfa.closure(ts))
            edges[b] = closed[key]
        calls = [(callee, node_of(nfa.closure(ts))) for callee, ts in sorted(by_rule.items())]
        out.append(Node(rule, edges, calls, end in subset))
    return out


def _minimize(dfa: list[Node], first_id: int) -> list[Node]:
    """Moore's algorithm: merge nodes no input can tell apart. Start from "final or not", split a block
    whenever two of its nodes lead, on some byte or call, to different blocks; stop when stable.
    Fewer nodes means fewer positions whose token classes token_mask.py must precompute."""
    block = [int(n.final) for n in dfa]
    while True:
        signatures: dict[tuple, int] = {}
        new_block = []
        for n, b in zip(dfa, block):
            sig = (b, tuple((byte, block[t - first_id]) for byte, t in n.edges.items()),
                   tuple((callee, block[t - first_id]) for callee, t in n.calls))
            new_block.append(signatures.setdefault(sig, len(signatures)))
        if len(signatures) == len(set(block)):
            break
        block = new_block
    # renumber so that the start node (dfa[0]) stays first
    order: dict[int, int] = {}
    for b in new_block:
        order.setdefault(b, len(order))
    out: list[Node | None] = [None] * len(order)
    for n, b in zip(dfa, new_block):
        if out[order[b]] is None:
            remap = lambda t: first_id + order[new_block[t - first_id]]  # noqa: E731
            out[order[b]] = Node(n.rule, {byte: remap(t) for byte, t in n.edges.items()},
                                 [(callee, remap(t)) for callee, t in n.calls], n.final)
    return out
