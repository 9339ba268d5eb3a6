"""Child processes started fast, with their parent's environment, never outliving the run (child_process.py)."""
from processes.child_process import (ChildProcess, die_with_parent, mp_context, preload_in_forkserver, serve_commands,
                                     start_process, stop_process)

__all__ = ["ChildProcess", "die_with_parent", "mp_context", "preload_in_forkserver", "serve_commands", "start_process",
           "stop_process"]
