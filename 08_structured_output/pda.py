"""A pushdown automaton over bytes: the matcher that knows, after any prefix, what the grammar allows next.

State = a SET of stacks. A stack is the list of places we are in the rules' automata (rule_automata.py):
the top frame is the node we stand on; each frame below it is the node its rule returns to when the
rule above finishes. The set is needed because a grammar is nondeterministic at a byte's distance:
after `{"a": ` the next byte may start a string, a number or an object, each a different stack. This
is llama.cpp's grammar sampler (a vector of stacks) and xgrammar's matcher before its Earley parser
(`persistent_stack.h`: a tree of frames, so that stacks share their lower frames).

Sharing: a stack is an interned pair (top node, stack below), numbered once (`PDA.push`). Pushing is
one dict look-up, two stacks with the same tail share it, and a stack is compared or hashed as an int.
A state (a frozenset of stack ids) is interned too, so the step function can be memoised per
(state, byte): a grammar that loops (a JSON string) reaches the same few states again and again.
These tables only grow; one PDA per grammar serves all its requests (as xgrammar caches a compiled
grammar), so what one request learned speeds up the next.

Moves:
  * a byte moves each stack's top along its DFA edge, stacks without that edge die;
  * then `expand` takes the moves that read nothing: entering a called rule (push its start over the
    return node) and finishing a rule (pop to the return node), until no new stack appears. A state
    is kept in this expanded form, holding only stacks whose top can read a byte — plus, when the
    root may end, the root-level stack that says so.

Left recursion (`expr ::= expr "+" term`) would make `expand` push forever; `compile_grammar` refuses
it with a ValueError naming the cycle (rewrite as `expr ::= term ("+" term)*`). xgrammar 0.2 accepts
it because its matcher is an Earley parser; this is the classic LL-style limit of a stack machine.
"""
from __future__ import annotations

from structured_output.grammar import Grammar, find_left_recursion, parse_grammar
from structured_output.rule_automata import RuleAutomata, build_rule_automata

ROOT = -1        # what lies below the root frame: nothing. A final root frame means "the output may end".
PROBE = -2       # what lies below a probe's frame (token_mask.py): the unknown rest of some stack.
DEAD = 0         # the state with no stacks: the prefix can never be completed


def compile_grammar(grammar: Grammar | str) -> "PDA":
    """GBNF text or a parsed Grammar -> a PDA; ValueError for a bad or left-recursive grammar."""
    if isinstance(grammar, str):
        grammar = parse_grammar(grammar)
    cycle = find_left_recursion(grammar)
    if cycle:
        raise ValueError(f"grammar error in rule {cycle[0]!r}: left recursion {' -> '.join(cycle)} "
                         "(a rule reaches itself before reading a character; write `a ::= b (op b)*` "
                         "instead of `a ::= a op b | b`)")
    return PDA(build_rule_automata(grammar))


class PDA:
    """A compiled grammar plus the memo tables every matcher of that grammar shares (like xgrammar's
    CompiledGrammar, shared across requests). States are ints; `DEAD` is the empty one."""

    def __init__(self, automata: RuleAutomata):
        self.automata = automata
        self.nodes = automata.nodes
        self.top: list[int] = []                  # stack id -> node of its top frame
        self.below: list[int] = []                # stack id -> stack id under it (or ROOT / PROBE)
        self._stack_ids: dict[tuple[int, int], int] = {}
        self._states: list[frozenset[int]] = []
        self._state_ids: dict[frozenset[int], int] = {}
        self._next: list[dict[int, int]] = []     # state -> {byte: state}, filled on demand
        self.intern(frozenset())                  # = DEAD
        root_start = automata.rule_start[automata.root]
        self.start = self.intern(self.expand([self.push(root_start, ROOT)]))

    # -- stacks and states as ints --
    def push(self, node: int, below: int) -> int:
        key = (node, below)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._stack_ids[key] = len(self.top)
            self.top.append(node)
            self.below.append(below)
        return sid

    def intern(self, stacks: frozenset[int]) -> int:
        sid = self._state_ids.get(stacks)
        if sid is None:
            sid = self._state_ids[stacks] = len(self._states)
            self._states.append(stacks)
            self._next.append({})
        return sid

    def stacks(self, state: int) -> frozenset[int]:
        return self._states[state]

    # -- the moves --
    def expand(self, stacks) -> frozenset[int]:
        """Close a set of stacks under the moves that read no byte: calls push, finished rules pop."""
        ### BEGIN SOLUTION
        out: set[int] = set()
        seen: set[int] = set()
        todo = list(stacks)
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            node = self.nodes[self.top[s]]
            if node.edges:                        # it can read a byte: keep it
                out.add(s)
            for callee, ret in node.calls:        # enter the callee; come back to `ret` afterwards
                callee_start = self.automata.rule_start[callee]
                todo.append(self.push(callee_start, self.push(ret, self.below[s])))
            if node.final:                        # this rule may end here: return to the frame below
                below = self.below[s]
                if below == ROOT:
                    out.add(s)                    # the root is complete: remember that it may end
                elif below == PROBE:
                    out.add(PROBE)                # a probe's rule ended: its caller is unknown
                else:
                    todo.append(below)
        return frozenset(out)
        ### END SOLUTION

    def step(self, state: int, byte: int) -> int:
        """The state after one more byte (DEAD if no stack can read it); memoised."""
        nxt = self._next[state].get(byte)
        if nxt is None:
            nxt = self._next[state][byte] = self._step_uncached(state, byte)
        return nxt

    def _step_uncached(self, state: int, byte: int) -> int:
        ### BEGIN SOLUTION
        moved = []
        for s in self._states[state]:
            if s < 0:                             # the PROBE marker reads nothing
                continue
            target = self.nodes[self.top[s]].edges.get(byte)
            if target is not None:                # move the top frame; the frames below stay shared
                moved.append(self.push(target, self.below[s]))
        # Each moved stack may now stand where a rule is called or ends: expand before interning, so
        # a state is always in the same (expanded) form and equal states get equal ids.
        return self.intern(self.expand(moved))
        ### END SOLUTION

    def advance(self, state: int, data: bytes) -> int:
        for byte in data:
            state = self.step(state, byte)
            if state == DEAD:
                return DEAD
        return state

    # -- questions about a state --
    def can_end(self, state: int) -> bool:
        """Is the root rule complete here (may the output stop)?"""
        return any(s >= 0 and self.below[s] == ROOT and self.nodes[self.top[s]].final for s in self._states[state])

    def next_bytes(self, state: int) -> set[int]:
        """Every byte some stack can read (each one leads to a live state)."""
        return {b for s in self._states[state] if s >= 0 for b in self.nodes[self.top[s]].edges}

    def probe_state(self, node: int) -> int:
        """The state of a single frame standing on `node` with unknown frames below (PROBE), expanded
        but without the PROBE marker that `node` being final would add: token_mask.py asks what a
        token does INSIDE the rule; the rule ending right away is covered by the real state."""
        return self.intern(self.expand([self.push(node, PROBE)]) - {PROBE})

    def single_stack_state(self, stack: int) -> int:
        return self.intern(frozenset([stack]))

    def describe(self, state: int) -> list[str]:
        """Each stack as 'root@1 > object@3 > string@1' (bottom first), for debugging and teaching."""
        out = []
        for s in sorted(self._states[state]):
            frames = []
            while s >= 0:
                frames.append(self.automata.describe(self.top[s]))
                s = self.below[s]
            out.append(" > ".join(reversed(frames)) + (" > (probe)" if s == PROBE and frames else ""))
        return out


class PDAMatcher:
    """One output's position in the grammar: a state id, and the states before each accepted chunk so
    `rollback` restores them exactly (speculative decoding rejects drafted tokens)."""

    def __init__(self, pda: PDA):
        self.pda = pda
        self.state = pda.start
        self._history: list[int] = []

    def accept_bytes(self, data: bytes) -> bool:
        """Advance over all of `data`, or (False) not at all."""
        nxt = self.pda.advance(self.state, data)
        if nxt == DEAD:
            return False
        self._history.append(self.state)
        self.state = nxt
        return True

    def can_end(self) -> bool:
        return self.pda.can_end(self.state)

    def rollback(self, num_chunks: int) -> None:
        """Undo the last `num_chunks` successful `accept_bytes` calls."""
        if not 0 <= num_chunks <= len(self._history):
            raise ValueError(f"cannot roll back {num_chunks} chunks: only {len(self._history)} accepted")
        if num_chunks:
            self.state = self._history[-num_chunks]
            del self._history[-num_chunks:]

    @property
    def num_accepted(self) -> int:
        return len(self._history)

    def reset(self) -> None:
        self.state = self.pda.start
        self._history.clear()
