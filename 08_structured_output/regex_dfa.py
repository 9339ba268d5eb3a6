"""Regex -> minimal byte-level DFA: the automaton behind every regex / JSON-schema / choice request.

A structured-output request is a language the output must belong to. To mask tokens step by step
we need a machine that reads the output one BYTE at a time and knows, after any prefix, whether the
prefix can still be completed. For a regular language that machine is a DFA, built in the three
textbook steps (outlines-core gets the same DFA from Rust's `regex-automata` in `src/index.rs`;
here every step is visible):

    pattern --regex_parser--> tree --Thompson--> NFA over bytes --subset construction--> DFA
            --minimisation (dead states removed, Hopcroft refinement)--> DFA

  * Thompson: every tree node becomes a fragment with one entry and one exit, glued with epsilon
    edges; a code point set becomes its UTF-8 byte-range chains (utf8_ranges.py).
  * Subset construction: a DFA state is the SET of NFA states the input could have reached (a
    frozenset, closed under epsilon edges). Bytes that every current edge treats alike are
    handled as one interval, so a state costs its edges, not 256 byte lookups each.
  * Minimisation: states from which no accepting state is reachable are DEAD; they are removed
    (their transitions become -1), so "the walk has not died" means "the prefix can still be
    completed" — exactly what a token mask needs. Then states no input can tell apart are merged
    (Hopcroft's partition refinement, over byte classes rather than 256 bytes) and renumbered in
    breadth-first order, so two patterns with the same language give the IDENTICAL DFA.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from structured_output.regex_parser import Alternation, CharSet, Concat, Repeat, parse
from structured_output.utf8_ranges import utf8_sequences

DEAD = -1


class NFA:
    """Thompson NFA over bytes. State s has byte edges `edges[s]` = [(lo_byte, hi_byte, target)]
    and epsilon edges `eps[s]` = [target]."""

    def __init__(self):
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []

    def new_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def closure(self, states) -> frozenset[int]:
        return epsilon_closure(self.eps, states)


def epsilon_closure(eps: list[list[int]], states) -> frozenset[int]:
    """`states` and everything reachable from them by epsilon edges (`eps[s]`: s's epsilon targets)."""
    seen, todo = set(states), list(states)
    while todo:
        for t in eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


def add_chars(nfa: NFA, chars: CharSet) -> tuple[int, int]:
    """One code point of `chars`: a chain of byte-range edges per UTF-8 sequence, entry to exit."""
    entry, exit_ = nfa.new_state(), nfa.new_state()
    for seq in utf8_sequences(chars.ranges):            # e.g. [(0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)]
        state = entry
        for i, (lo, hi) in enumerate(seq):
            target = exit_ if i == len(seq) - 1 else nfa.new_state()
            nfa.edges[state].append((lo, hi, target))
            state = target
    return entry, exit_


def add_fragment(nfa: NFA, node) -> tuple[int, int]:
    """Thompson's construction: add `node`'s fragment to `nfa`; return its (entry, exit) states.
    Each call builds fresh states, so a repeated item is simply added once per copy."""
    if isinstance(node, CharSet):
        return add_chars(nfa, node)
    ### BEGIN SOLUTION
    entry = exit_ = nfa.new_state()
    if isinstance(node, Concat):                         # chain the parts
        for item in node.items:
            s, e = add_fragment(nfa, item)
            nfa.eps[exit_].append(s)
            exit_ = e
    elif isinstance(node, Alternation):                  # fork into every option, join after
        exit_ = nfa.new_state()
        for option in node.options:
            s, e = add_fragment(nfa, option)
            nfa.eps[entry].append(s)
            nfa.eps[e].append(exit_)
    elif isinstance(node, Repeat):
        for _ in range(node.min):                        # the mandatory copies, chained
            s, e = add_fragment(nfa, node.item)
            nfa.eps[exit_].append(s)
            exit_ = e
        if node.max is None:                             # then a loop: hub -> item -> hub
            hub = nfa.new_state()
            s, e = add_fragment(nfa, node.item)
            nfa.eps[exit_].append(hub)
            nfa.eps[hub].append(s)
            nfa.eps[e].append(hub)
            exit_ = hub
        else:                                            # or nested optional copies: (x(x(x)?)?)?
            done = nfa.new_state()
            for _ in range(node.max - node.min):
                s, e = add_fragment(nfa, node.item)
                nfa.eps[exit_] += [s, done]
                exit_ = e
            nfa.eps[exit_].append(done)
            exit_ = done
    else:
        raise TypeError(f"unknown regex node {node!r}")
    return entry, exit_
    ### END SOLUTION


def determinize(nfa: NFA, start: int, accept: int) -> tuple[list[list[int]], int, set[int]]:
    """Subset construction. Returns (transitions [states][256] with -1 = no edge, start state 0,
    accepting states). DFA state i stands for the epsilon-closed NFA state set `sets[i]`."""
    ### BEGIN SOLUTION
    sets = [nfa.closure([start])]
    index = {sets[0]: 0}                                 # NFA state set -> DFA state id
    transitions: list[list[int]] = []
    for current in sets:                                 # `sets` grows while we iterate
        row = [DEAD] * 256
        edges = [edge for s in current for edge in nfa.edges[s]]
        # Cut the byte axis where any edge starts or ends: within a piece all bytes go alike.
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        for a, b in zip(cuts, cuts[1:]):                 # bytes a .. b-1
            targets = [t for lo, hi, t in edges if lo <= a <= hi]
            if not targets:
                continue
            nxt = nfa.closure(targets)
            if nxt not in index:
                index[nxt] = len(sets)
                sets.append(nxt)
            row[a:b] = [index[nxt]] * (b - a)
        transitions.append(row)
    accepting = {i for i, s in enumerate(sets) if accept in s}
    ### END SOLUTION
    return transitions, 0, accepting


def remove_dead_states(transitions, start, accepting) -> tuple[list[list[int]], int, set[int]]:
    """Keep only the states that can reach an accepting state; edges into the others become -1."""
    incoming: list[list[int]] = [[] for _ in transitions]
    for s, row in enumerate(transitions):
        for t in set(row) - {DEAD}:
            incoming[t].append(s)
    live, todo = set(accepting), list(accepting)         # backwards from the accepting states
    while todo:
        for s in incoming[todo.pop()]:
            if s not in live:
                live.add(s)
                todo.append(s)
    if start not in live:
        raise ValueError("the pattern matches no string at all (its automaton has no live start state)")
    keep = sorted(live)
    new_id = {s: i for i, s in enumerate(keep)}
    rows = [[new_id.get(t, DEAD) for t in transitions[s]] for s in keep]
    return rows, new_id[start], {new_id[s] for s in accepting}


def byte_classes(transitions) -> list[list[int]]:
    """Bytes that every state treats identically, grouped: the alphabet the refinement works on
    (a JSON pattern has ~30 classes, not 256)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(256):
        groups.setdefault(tuple(row[b] for row in transitions), []).append(b)
    return list(groups.values())


def equivalence_blocks(transitions, accepting) -> list[int]:
    """Hopcroft's partition refinement: block id per state, two states sharing a block iff no
    input tells them apart. Start from {accepting, non-accepting, dead}; a block A "splits" a
    block B on byte class c when some states of B go into A on c and others do not. After a
    split only the smaller half needs to be used as a splitter later (its complement's split is
    implied): that is what makes it O(n log n) where the simpler Moore refinement is O(n * depth)."""
    n = len(transitions)
    sink = n                                             # the dead state, made explicit here
    reps = [cls[0] for cls in byte_classes(transitions)]     # one byte stands for its class
    # pred[c][t]: the states that go to t on class c (missing edges go to the sink)
    pred = [[[] for _ in range(n + 1)] for _ in reps]
    for c, byte in enumerate(reps):
        for s in range(n):
            t = transitions[s][byte]
            pred[c][sink if t == DEAD else t].append(s)
        pred[c][sink].append(sink)
    blocks = [b for b in (set(accepting), set(range(n)) - set(accepting), {sink}) if b]
    block_of = [0] * (n + 1)
    for i, members in enumerate(blocks):
        for s in members:
            block_of[s] = i
    work = set(range(len(blocks)))                       # the splitters still to use
    while work:
        splitter = list(blocks[work.pop()])
        for c in range(len(reps)):
            hit: dict[int, set[int]] = {}                # block -> its states that go into splitter
            for t in splitter:
                for s in pred[c][t]:
                    hit.setdefault(block_of[s], set()).add(s)
            for b, inside in hit.items():
                if len(inside) == len(blocks[b]):
                    continue                             # the whole block goes in: no split
                outside = blocks[b] - inside
                blocks[b], new = inside, len(blocks)
                blocks.append(outside)
                for s in outside:
                    block_of[s] = new
                if b in work or len(outside) <= len(inside):
                    work.add(new)                        # b, if queued, now means `inside`
                else:
                    work.add(b)                          # queue the smaller half only
    return block_of[:n]


def minimize(transitions, start, accepting) -> tuple[list[list[int]], int, set[int]]:
    """The minimal DFA of the same language: dead states removed, equivalent states merged, and
    the merged states numbered breadth-first from the start (bytes in order): a canonical
    numbering, so equal languages give equal DFAs."""
    transitions, start, accepting = remove_dead_states(transitions, start, accepting)
    block = equivalence_blocks(transitions, accepting)
    member = {block[s]: s for s in range(len(transitions))}   # any one state of each block
    order, seen = [block[start]], {block[start]}
    for b in order:                                      # `order` grows while we iterate
        for t in transitions[member[b]]:
            if t != DEAD and block[t] not in seen:
                seen.add(block[t])
                order.append(block[t])
    new_id = {b: i for i, b in enumerate(order)}
    rows = [[new_id[block[t]] if t != DEAD else DEAD for t in transitions[member[b]]] for b in order]
    return rows, 0, {new_id[block[s]] for s in accepting}


@dataclass(frozen=True, eq=True)
class DFA:
    """A byte-level DFA in which every state is live (an accepting state is reachable from it)."""
    transitions: tuple[tuple[int, ...], ...]     # [num_states][256] next state, -1 = dead
    start: int
    accepting: frozenset[int]

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def step(self, state: int, byte: int) -> int:
        return self.transitions[state][byte] if state != DEAD else DEAD

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`; -1 as soon as it dies."""
        for byte in data:
            if state == DEAD:
                break
            state = self.transitions[state][byte]
        return state

    def accepts(self, data: bytes) -> bool:
        return self.walk(self.start, data) in self.accepting

    def live(self, state: int) -> bool:
        """Can an accepting state still be reached? Dead states were removed when the DFA was
        minimised, so this is simply "not -1"."""
        return 0 <= state < self.num_states

    @classmethod
    def from_rows(cls, transitions, start: int, accepting) -> DFA:
        return cls(tuple(tuple(row) for row in transitions), start, frozenset(accepting))


def build_dfa(pattern: str, minimal: bool = True) -> DFA:
    """`pattern` -> its DFA. minimal=False stops after the subset construction (dead states
    included): for tests, and to see what minimisation buys."""
    nfa = NFA()
    entry, exit_ = add_fragment(nfa, parse(pattern))
    dfa = determinize(nfa, entry, exit_)
    if minimal:
        dfa = minimize(*dfa)
    return DFA.from_rows(*dfa)


@lru_cache(maxsize=256)
def compile_regex(pattern: str) -> DFA:
    """The minimal DFA of `pattern`, cached: many requests share a schema. ValueError names the
    offending construct (and position) if the pattern cannot be compiled."""
    return build_dfa(pattern)


def distances_to_accept(dfa: DFA) -> list[int]:
    """Fewest bytes from each state to an accepting state (breadth-first, backwards)."""
    incoming: list[list[int]] = [[] for _ in range(dfa.num_states)]
    for s, row in enumerate(dfa.transitions):
        for t in set(row) - {DEAD}:
            incoming[t].append(s)
    dist = [-1] * dfa.num_states
    frontier = sorted(dfa.accepting)
    for s in frontier:
        dist[s] = 0
    for s in frontier:                                   # `frontier` grows while we iterate
        for p in incoming[s]:
            if dist[p] < 0:
                dist[p] = dist[s] + 1
                frontier.append(p)
    return dist


def sample_match(dfa: DFA, rng, max_len: int = 40, stop: float = 0.2) -> bytes:
    """A random member of the language: wander (a random next STATE, then a random byte leading
    there, so a rare closing quote is as likely as one of 100 letters), stopping in an accepting
    state with probability `stop`; after max_len bytes, finish along a shortest completion.
    How the tests draw documents from a schema."""
    dist = distances_to_accept(dfa)
    state, out = dfa.start, bytearray()
    while True:
        if state in dfa.accepting and (len(out) >= max_len or rng.random() < stop):
            return bytes(out)
        by_target: dict[int, list[int]] = {}
        for byte, t in enumerate(dfa.transitions[state]):
            if t != DEAD and (len(out) < max_len or dist[t] < dist[state]):
                by_target.setdefault(t, []).append(byte)
        if not by_target:                            # an accepting state with no way on
            return bytes(out)
        byte = rng.choice(by_target[rng.choice(sorted(by_target))])
        out.append(byte)
        state = dfa.transitions[state][byte]
