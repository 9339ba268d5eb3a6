"""Questions about a whole grammar that no single rule can answer, each a fixpoint over the rules.

  * nullable: may a rule match the empty string? (needed to see through `x? y` to what y calls first)
  * productive: does a rule match any finite string at all? `a ::= "x" a` does not: refused, because
    the matcher would accept its prefixes forever with no way to finish.
  * left recursion: does a rule call itself before reading a character (`e ::= e "+" t`)? A pushdown
    automaton that expands calls eagerly would push forever: pda.py refuses such grammars.
  * `check_grammar`: what parse_grammar demands once every rule is read (root present, every
    referenced rule defined, every rule productive).
"""
from __future__ import annotations

from structured_output.grammar_tree import CharClass, Choice, Expr, Grammar, Literal, Repeat, RuleRef, Sequence


def _fixpoint(g: Grammar, holds) -> set[str]:
    """The rules for which `holds(body, known)` becomes true, iterating until nothing changes."""
    known: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in g.rules.items():
            if name not in known and holds(body, known):
                known.add(name)
                changed = True
    return known


def nullable(e: Expr, nullable_rules: set[str]) -> bool:
    """Can `e` match the empty string?"""
    if isinstance(e, Literal):
        return e.text == ""
    if isinstance(e, CharClass):
        return False
    if isinstance(e, RuleRef):
        return e.name in nullable_rules
    if isinstance(e, Sequence):
        return all(nullable(i, nullable_rules) for i in e.items)
    if isinstance(e, Choice):
        return any(nullable(a, nullable_rules) for a in e.alternatives)
    return e.min == 0 or nullable(e.item, nullable_rules)


def productive(e: Expr, productive_rules: set[str]) -> bool:
    """Does `e` match at least one finite string? (A rule that only recurses into itself does not.)"""
    if isinstance(e, (Literal,)):
        return True
    if isinstance(e, CharClass):
        return bool(e.codepoint_ranges())
    if isinstance(e, RuleRef):
        return e.name in productive_rules
    if isinstance(e, Sequence):
        return all(productive(i, productive_rules) for i in e.items)
    if isinstance(e, Choice):
        return any(productive(a, productive_rules) for a in e.alternatives)
    return e.min == 0 or productive(e.item, productive_rules)


def nullable_rules(g: Grammar) -> set[str]:
    return _fixpoint(g, nullable)


def left_calls(e: Expr, nullable_rules: set[str]) -> set[str]:
    """Rules `e` may call before it has consumed a single character."""
    if isinstance(e, RuleRef):
        return {e.name}
    if isinstance(e, Sequence):
        out: set[str] = set()
        for item in e.items:
            out |= left_calls(item, nullable_rules)
            if not nullable(item, nullable_rules):
                break
        return out
    if isinstance(e, Choice):
        return set().union(*(left_calls(a, nullable_rules) for a in e.alternatives))
    if isinstance(e, Repeat):
        return left_calls(e.item, nullable_rules)
    return set()


def find_left_recursion(g: Grammar) -> list[str] | None:
    """A cycle of rules each calling the next before consuming anything (`expr ::= expr "+" term`),
    as [a, b, ..., a]; None if there is none. A pushdown automaton that expands calls eagerly would
    push forever on such a cycle."""
    nul = nullable_rules(g)
    calls = {name: sorted(left_calls(body, nul)) for name, body in g.rules.items()}
    state: dict[str, int] = {}                  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for callee in calls[name]:
            if state.get(callee) == 1:
                return path[path.index(callee):] + [callee]
            if callee not in state and (cycle := visit(callee, path + [callee])):
                return cycle
        state[name] = 2
        return None

    for name in g.rules:
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def _references(e: Expr):
    if isinstance(e, RuleRef):
        yield e
    elif isinstance(e, (Sequence, Choice)):
        for child in (e.items if isinstance(e, Sequence) else e.alternatives):
            yield from _references(child)
    elif isinstance(e, Repeat):
        yield from _references(e.item)


def check_grammar(g: Grammar, where: dict[str, str]) -> None:
    """What a whole grammar must satisfy once every rule is read; `where` gives each rule's "line:col"."""
    if g.root not in g.rules:
        raise ValueError(f"grammar error: no {g.root!r} rule (the rule every output starts from)")
    for name, body in g.rules.items():
        for ref in _references(body):
            if ref.name not in g.rules:
                raise ValueError(f"grammar error in rule {name!r} at line:col {ref.where}: "
                                 f"reference to undefined rule {ref.name!r}")
    finishing = _fixpoint(g, productive)
    stuck = [name for name in g.rules if name not in finishing]
    if stuck:
        raise ValueError(f"grammar error in rule {stuck[0]!r} at line:col {where[stuck[0]]}: rules {stuck} can "
                         "never finish (every alternative recurses without end)")
