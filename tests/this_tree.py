"""A Python subprocess that imports the SAME code as the test that starts it.

A test's own imports may come from somewhere other than the installed project: a student
edition's conftest.py maps `kvcache` & co. to the student's folders, the course grader to a
grading workspace. A bare `python -c ...` would import whatever the environment says (an editable
install of the instructor's repository, say) and test that instead. `python_in_this_tree(code)` is
`[python, "-c", prelude + code]` where the prelude maps every chapter package this process has
imported to the folder it came from.
"""
import importlib.util
import json
import pathlib
import sys

PACKAGES = ("paged_attention", "kvcache", "scheduler", "spec_decode", "chunked_prefill", "global_prefix_cache",
            "mini_vllm", "kernels_cuda", "kernels_cpu", "processes", "model_executor")

_PRELUDE = '''import importlib.util as _u, json as _j, sys as _s
_where = _j.loads({where!r})


class _ThisTree:
    def find_spec(self, name, path=None, target=None):
        folder = _where.get(name)
        if folder is None:
            return None
        return _u.spec_from_file_location(name, folder + "/__init__.py", submodule_search_locations=[folder])


_s.meta_path.insert(0, _ThisTree())
'''


def folders() -> dict[str, str]:
    """{package: its folder} for the chapter packages this process has imported."""
    out = {}
    for name in PACKAGES:
        module = sys.modules.get(name)
        paths = list(getattr(module, "__path__", []) or [])
        if paths:
            out[name] = str(pathlib.Path(paths[0]).resolve())
    return out


def python_in_this_tree(code: str) -> list[str]:
    return [sys.executable, "-c", _PRELUDE.format(where=json.dumps(folders())) + code]
