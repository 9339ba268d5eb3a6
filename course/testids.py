"""Test ids of course/tasks.toml and what they select (no imports: the grading process and the
student tree's conftest.py run a copy of this file).

    tests/02_kvcache/test_block_queue.py                          every test of the file
    tests/02_kvcache/test_block_queue.py::test_drain_and_refill   the function, every parametrization
    tests/04_spec_decode/test_rejection_exact.py::TestBadInput    a class (or ::TestBadInput::test_x)
    tests/01_paged_attention/test_cache_ops.py::test_writes_exact_rows_and_nothing_else[torch]
        the parametrizations whose id has every '-'-separated part of the selector among its own
        parts: [torch] selects [slot_dtype0-dtype1-torch] and the other five torch cases, so a
        parameter added or renamed elsewhere in the id does not break the manifest.
"""


def _parts(param_id):
    parts = {}
    for p in param_id.split("-"):
        parts[p] = parts.get(p, 0) + 1
    return parts


def matches(nodeid, test_id):
    """Does pytest node id `nodeid` belong to manifest test id `test_id`?"""
    if nodeid == test_id or nodeid.startswith(test_id + "::"):
        return True
    base, bracket, selector = test_id.partition("[")
    if not bracket:
        return nodeid.startswith(test_id + "[")
    node_base, node_bracket, param = nodeid.partition("[")
    if node_base != base or not node_bracket or not selector.endswith("]") or not param.endswith("]"):
        return False
    have = _parts(param[:-1])
    return all(have.get(p, 0) >= n for p, n in _parts(selector[:-1]).items())


def function_of(nodeid):
    """'path::func[params]' -> 'path::func' (a class method keeps its class)."""
    return nodeid.partition("[")[0]
