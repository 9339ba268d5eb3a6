"""A zygote for grading processes: one Python that has imported the heavy third-party libraries
(torch, numpy, transformers, hypothesis, pytest) and forks a fresh pytest process per
request.

Why: the proof grades ~55 tree configurations, each in its own pytest process, and a process
spends ~4 s importing torch & co. before its first test (much more than most `fast` tests take).
A fork of a process that has imported them starts in milliseconds. Nothing of the course's
chapters is imported here — only libraries every tree shares — so a child still imports the
student's code, and only the student's, exactly as a fresh `python -m pytest` would (the grader
plugin checks that, as always). No torch op runs in the zygote either: its OpenMP pool is never
started, so forking it is safe.

Protocol (one JSON object per line; `course.runner.ZygoteClient` speaks it):
    request  {"argv": [pytest args], "cwd": ws, "env": {...}, "sys_path": [...], "out": file,
              "status": file}
    reply    {"pid": child pid}
The child starts a session of its own (the caller kills a hung one with os.killpg), sends its
output to `out`, and when it ends the zygote writes its exit code to `status` (negative: the
signal that killed it, as subprocess reports it).

    python course/zygote.py        # started by ZygoteClient, not by hand
"""
import json
import os
import sys
import threading

# Not triton: it fixes interpreter-or-compiler when first configured, and each grading process
# chooses that itself (tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA).
# transformers loads its classes lazily, on first attribute access: its Auto* classes (which
# our tests and engine use) are imported here by module (~3 s a process otherwise). Not
# transformers.models.llama.modeling_llama: it imports triton.
# The pytest plugins that installed packages register (entry points, loaded by every pytest start):
# anyio's looks for its async backends on import (~0.7 s in a grading process).
PRELOAD = ("numpy", "torch", "hypothesis", "pytest", "tokenizers", "safetensors", "transformers",
           "transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.modeling_rope_utils",
           "anyio.pytest_plugin", "_hypothesis_pytestplugin", "platformdirs.pytest_plugin")


def preload() -> None:
    """Import PRELOAD, then freeze what is alive out of the cyclic garbage collector's walks: the
    ~220,000 objects of torch & co. would otherwise be walked by every full collection in every
    child (pytest itself runs two as it ends: ~0.5 s a grading process). A child still collects
    everything it creates; frozen objects are only never freed, and the zygote's are never freed
    anyway."""
    import gc
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:                # noqa: BLE001 — a library this machine lacks is imported by nobody
            pass
    gc.collect()
    gc.freeze()


def run_child(request: dict) -> None:
    """In the forked child: become `python -m pytest ARGV` run in request["cwd"]."""
    code = 1
    try:
        os.setsid()
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
        sys.path[:] = request["sys_path"] + [p for p in sys.path[1:] if p not in request["sys_path"]]
        sys.argv = ["pytest", *request["argv"]]
        import pytest
        code = int(pytest.main(request["argv"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:                # noqa: BLE001 — report it in the output, exit non-zero
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    preload()
    lock = threading.Lock()
    status_files: dict[int, str] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                threading.Event().wait(0.05)
                continue
            with lock:
                path = status_files.pop(pid, None)
            if path:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)

    threading.Thread(target=reap, daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        with lock:               # the reaper looks the pid up only after it is recorded
            pid = os.fork()
            if pid == 0:
                run_child(request)
            status_files[pid] = request["status"]
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
