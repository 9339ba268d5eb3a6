"""course/testids.py and course/testgen.py: what a manifest test id selects, and how
`python -m course tests` turns a discovery run into each task's test lists."""
import pytest

from course.manifest import Manifest, Task, load
from course.testgen import assign, fast_subset, lists, rewrite, selectors
from course.testids import function_of, matches

F = "tests/t.py::test_f"


@pytest.mark.parametrize("nodeid,test_id,expected", [
    (F, F, True),
    (F + "[a-torch]", F, True),                       # a function covers its parametrizations
    (F + "[a-torch]", "tests/t.py", True),            # a file covers its tests
    ("tests/t.py::TestX::test_y", "tests/t.py::TestX", True),
    (F + "[a-torch]", F + "[torch]", True),           # a selector: its parts among the id's parts
    (F + "[b-triton]", F + "[torch]", False),
    (F + "[a-torch]", F + "[a-torch]", True),         # an exact parametrization is a selector too
    (F + "[a-torch]", F + "[torch-a]", True),
    (F + "[torch]", F + "[torch-torch]", False),      # parts count
    (F + "x[torch]", F + "[torch]", False),           # another function
    (F + "x", F, False),
    ("tests/t.py::test_g[top-k + top-p-fast-cpu]", "tests/t.py::test_g[fast]", True),
])
def test_what_a_test_id_selects(nodeid, test_id, expected):
    assert matches(nodeid, test_id) is expected


def test_function_of():
    assert function_of(F + "[a-b]") == F and function_of("tests/t.py::C::m[x]") == "tests/t.py::C::m"


def test_selectors_are_function_level_when_they_can_be():
    params = [F + "[d0-torch]", F + "[d1-torch]", F + "[d0-triton]", F + "[d1-triton]"]
    assert selectors(params, set(params)) == [F]
    assert selectors(params, {F + "[d0-torch]", F + "[d1-torch]"}) == [F + "[torch]"]
    assert selectors(params, {F + "[d0-torch]"}) == [F + "[d0-torch]"]
    odd = {F + "[d0-torch]", F + "[d1-triton]"}
    assert sorted(selectors(params, odd)) == sorted(odd)        # no selector: the parametrizations


def _task(tid, chapter, regions, needs=(), track="core"):
    return Task(id=tid, title=tid, chapter=chapter, regions=list(regions), public=[], hidden=[], fast=[],
                needs=list(needs), track=track)


def _manifest():
    return Manifest([
        _task("ch01_task1", "01_paged_attention", ["01/a.py::f"]),
        _task("ch02_task1", "02_kvcache", ["02/q.py::queue"]),
        _task("ch02_task2", "02_kvcache", ["02/p.py::pool"], needs=["ch02_task1"]),
        _task("ch02_task3", "02_kvcache", ["02/h.py::hash"]),
        _task("ch03_task1", "03_scheduler", ["03/s.py::schedule"]),
        _task("cuda_task1", "kernels_cuda", ["kernels_cuda/k.cuh::kernel"]),
    ])


def _r(hits, outcome="passed", duration=1.0):
    return {"outcome": outcome, "duration": duration, "hits": hits, "summary": ""}


def test_a_test_belongs_to_the_one_task_that_builds_on_all_the_others_it_runs():
    m = _manifest()
    data = {"python": {
        "tests/02/t.py::test_queue": _r(["02/q.py::queue"]),
        "tests/02/t.py::test_queue_and_chapter_01": _r(["02/q.py::queue", "01/a.py::f"]),   # earlier chapter
        "tests/02/t.py::test_pool": _r(["02/p.py::pool", "02/q.py::queue"]),                # needs
        "tests/02/t.py::test_pool_and_hash": _r(["02/p.py::pool", "02/h.py::hash"]),        # no task builds on both
        "tests/02/t.py::test_needs_the_scheduler": _r(["02/q.py::queue", "03/s.py::schedule"]),   # a later chapter's
        "tests/02/t.py::test_nothing": _r([]),
        "tests/02/t.py::test_broken": _r(["02/q.py::queue"], outcome="failed"),
        "tests/01/t.py::test_cuda": _r([], outcome="failed"),
        "tests/03_scheduler/t.py::test_validation_only": _r(["02/q.py::queue"]),   # a chapter-03 rule
        "tests/02_kvcache/t.py::test_in_its_folder": _r(["02/q.py::queue"]),
    }, "cpp": {"cuda_task1": {"tests/01/t.py::test_cuda": _r(["01/a.py::f"])}}}
    owner, why, uses = assign(m, data)
    assert owner == {"tests/02/t.py::test_queue": "ch02_task1",
                     "tests/02/t.py::test_queue_and_chapter_01": "ch02_task1",
                     "tests/02/t.py::test_pool": "ch02_task2",
                     "tests/02/t.py::test_needs_the_scheduler": "ch03_task1",
                     "tests/01/t.py::test_cuda": "cuda_task1",
                     "tests/02_kvcache/t.py::test_in_its_folder": "ch02_task1"}
    assert set(why) == {"tests/02/t.py::test_pool_and_hash", "tests/02/t.py::test_nothing", "tests/02/t.py::test_broken",
                        "tests/03_scheduler/t.py::test_validation_only"}
    assert uses["ch02_task1"] == {"ch01_task1"} and uses["ch02_task2"] == {"ch02_task1"}
    assert uses["ch03_task1"] == {"ch02_task1"} and uses["cuda_task1"] == {"ch01_task1"}


def test_generated_lists_split_hidden_and_public_and_pick_a_covering_fast_subset():
    m = _manifest()
    data = {"python": {
        F + "[a-torch]": _r(["02/q.py::queue"], duration=0.1),
        F + "[b-torch]": _r(["02/q.py::queue"], duration=5.0),
        F + "[a-triton]": _r(["03/s.py::schedule"]),
        "tests/course/tasks/test_x.py::test_hidden_edge": _r(["02/q.py::queue"], duration=0.2),
    }, "cpp": {}}
    gen, _ = lists(m, data)
    assert gen["ch02_task1"]["public"] == [F + "[torch]"]
    assert gen["ch02_task1"]["hidden"] == ["tests/course/tasks/test_x.py::test_hidden_edge"]
    assert gen["ch03_task1"]["public"] == [F + "[a-triton]"] or gen["ch03_task1"]["public"] == [F + "[triton]"]
    fast = gen["ch02_task1"]["fast"]
    assert F + "[a-torch]" in fast and "tests/course/tasks/test_x.py::test_hidden_edge" in fast
    assert F + "[b-torch]" not in fast                    # slower and covers nothing new
    assert fast_subset(m.by_id("ch01_task1"), [], {}) == []


TOML = '''# header kept
[[task]]
id = "ch02_task1"
title = "The queue"
regions = [
    "02/q.py::queue",
]
public = [
    "tests/old.py::test_x[torch]",   # a comment with ] in it
]
hidden = []
fast = ["tests/old.py::test_x[torch]"]
timeout_s = 300

[[task]]
id = "ch02_task2"
title = "Another"
regions = ["02/p.py::pool"]
notes = "kept"
'''


def test_rewrite_replaces_only_the_generated_arrays():
    gen = {"ch02_task1": {"public": ["tests/new.py::test_y"], "hidden": [], "fast": ["tests/new.py::test_y"],
                          "uses": ["ch01_task1"]},
           "ch02_task2": {"public": ["tests/p.py::test_p[a]"], "hidden": ["tests/course/tasks/t.py::test_h"],
                          "fast": [], "uses": []}}
    out = rewrite(TOML, gen)
    import tomllib
    data = tomllib.loads(out)
    t1, t2 = data["task"]
    assert t1["public"] == ["tests/new.py::test_y"] and t1["uses"] == ["ch01_task1"] and t1["timeout_s"] == 300
    assert t2["public"] == ["tests/p.py::test_p[a]"] and t2["hidden"] == ["tests/course/tasks/t.py::test_h"]
    assert t2["notes"] == "kept" and t2["regions"] == ["02/p.py::pool"]
    assert out.startswith("# header kept") and "tests/old.py" not in out
    assert rewrite(out, gen) == out                       # idempotent


def test_the_manifest_names_tests_by_function_and_every_task_has_public_tests():
    """What `python -m course tests` writes: a public test for every task, function-level ids —
    a selector only where a function's parametrizations split between tasks, the parametrizations
    themselves only where no selector can tell them apart (rare)."""
    import collections
    m = load()
    ids = [x for t in m.tasks for x in t.public + t.hidden]
    assert all(t.public for t in m.tasks), [t.id for t in m.tasks if not t.public]
    exact = sum(n for t in m.tasks for n in collections.Counter(function_of(x) for x in t.public + t.hidden).values()
                if n > 1)
    assert exact <= 0.05 * len(ids), f"{exact} of {len(ids)} ids name single parametrizations"
    assert all(t.fast for t in m.tasks) and all(t.uses is not None for t in m.tasks)


def test_selectors_reach_pytest_as_their_function_and_collection_is_narrowed_to_them():
    """A selector is no pytest node id (pytest would find nothing and collect nothing): the
    grading process gets the function and keeps only what the selector matches."""
    from course.runner import pytest_args
    assert pytest_args([F, "tests/t.py::test_g"]) == ([F, "tests/t.py::test_g"], None)      # ids: unchanged
    args, select = pytest_args([F + "[torch]", F + "[triton]", "tests/t.py::test_g"])
    assert args == [F, "tests/t.py::test_g"] and select == [F + "[torch]", F + "[triton]", "tests/t.py::test_g"]
    assert pytest_args(["-m", "not gpu", "tests/t.py"]) == (["-m", "not gpu", "tests/t.py"], None)
