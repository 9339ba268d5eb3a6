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
              "status": file, "sandbox": null | {...}}
    reply    {"pid": child pid}
The child starts a session of its own (the caller kills a hung one with os.killpg), sends its
output to `out`, and when it ends the zygote writes its exit code to `status` (negative: the
signal that killed it, as subprocess reports it). Every child closes the file descriptors it
inherited (the zygote's pipes among them: a child must not be able to ask for processes).

sandbox (the student's process, course/judge.py): before pytest starts the child enters a mount
namespace of its own where the folders in "hide" are empty (the reference solution, the
repository's history) and those in "binds" are mounted read-only where it may read them (the
converted model), then becomes the unprivileged user "uid"/"gid": it cannot read the judge's
files (0700, root's), its memory (/proc/<pid>/mem) or signal it, and writes only where that user
may. The zygote must run as root for this; course/judge.py says so in the report otherwise.

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


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
CLONE_NEWNS = 0x00020000


def enter_sandbox(spec: dict) -> None:
    """A mount namespace with `hide` emptied and `binds` read-only, then an unprivileged user."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")

    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    for path in spec.get("hide", []):
        if os.path.isdir(path):
            check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, b"size=16k,mode=755"),
                  f"hide {path}")
    def bind_ro(src, dst):
        check(libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None), f"bind {src}")
        check(libc.mount(None, dst.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None), f"read-only {dst}")

    # "reveal": paths the unprivileged user must read although an ancestor is closed to it (Python's
    # standard library under /root): the closed ancestor becomes an empty tmpfs holding only them.
    # "binds": [source, target] read-only. Every source is staged first (a covered ancestor hides it).
    staging = spec.get("staging")
    plan = [(p, p) for p in spec.get("reveal", [])] + [(src, dst) for src, dst in spec.get("binds", [])]
    staged = []
    for i, (src, dst) in enumerate(plan):
        if not os.path.exists(src) or not staging:
            continue
        stage = os.path.join(staging, str(i))
        os.makedirs(stage, exist_ok=True)
        check(libc.mount(src.encode(), stage.encode(), None, MS_BIND | MS_REC, None), f"stage {src}")
        staged.append((stage, dst))
    covered = set()
    for path in spec.get("reveal", []):
        parts = os.path.abspath(path).split("/")[1:]
        for k in range(1, len(parts)):
            anc = "/" + "/".join(parts[:k])
            if not os.stat(anc).st_mode & 0o001:
                if anc not in covered and not any(anc.startswith(c + "/") for c in covered):
                    check(libc.mount(b"tmpfs", anc.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=711"),
                          f"cover {anc}")
                    covered.add(anc)
                break
    for stage, dst in staged:
        os.makedirs(dst, exist_ok=True)
        bind_ro(stage, dst)
    if spec.get("uid") is None:           # the judge's process: the same user, the reference hidden
        return
    gid, uid = int(spec["gid"]), int(spec["uid"])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("sandbox: could not drop privileges")


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
        os.closerange(3, 65536)          # the zygote's pipes, the out file's own descriptor
        if request.get("sandbox"):
            enter_sandbox(request["sandbox"])
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
