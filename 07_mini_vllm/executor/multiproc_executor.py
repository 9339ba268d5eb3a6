"""MultiprocExecutor: one worker process per rank, torch.distributed between them, one scheduler above.

Mirrors vLLM v1's `vllm/v1/executor/multiproc_executor.py` (`MultiprocExecutor`, `WorkerProc`,
`WorkerProc.worker_busy_loop`, `collective_rpc` with `unique_reply_rank`, the death monitor that
fails the engine when a worker exits). Two kinds of traffic, as there:

    control  engine -> every worker: (method, args), pickled ONCE and written to each worker's pipe
             (vLLM: a shared-memory MessageQueue broadcast); worker -> engine: the reply of the rank
             asked for (execute_model: the output rank's ModelRunnerOutput)
    data     worker <-> worker: torch.distributed collectives inside the forward (gloo on CPU,
             NCCL on GPU): all-reduce after row-parallel layers, the logits' all-gather, the
             pipeline stages' send/recv

Why the control messages do not go over torch.distributed too: a worker waiting for the next step
would sit inside a collective, and collectives time out (`execute_model_timeout_s`) — an engine
idle for five minutes would kill its workers. A pipe waits forever at no cost and says EOF when
the engine is gone, so a worker never outlives its engine.

Failure is bounded: the engine waits for a reply on the pipes AND on every worker's process
sentinel (`multiprocessing.connection.wait`), with `execute_model_timeout_s`. A worker that dies
wakes the engine at once; one that raises sends its traceback and exits; one that hangs is given
up on at the timeout. Each of these raises ExecutorError, the engine fails every request with the
message, and the surviving workers (stuck in a collective with the dead one) are terminated.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait

from processes import preload_in_forkserver, start_process

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.executor.abstract import Executor, ExecutorError, FutureOutput, get_output

logger = logging.getLogger(__name__)
preload_in_forkserver("mini_vllm.worker", "mini_vllm.model_runner")      # what every worker imports

SHUTDOWN_GRACE_S = 5.0          # how long a worker may take to leave its process groups before it is killed
# Start-up (fork from the forkserver, join the process groups, load the checkpoint) is given at least this long, whatever
# execute_model_timeout_s says: a short step timeout must not fail a slow but healthy start.
# A worker that dies while starting is still noticed at once.
STARTUP_TIMEOUT_S = 600.0


def _free_port() -> int:
    """A TCP port for rank 0's rendezvous store (torch.distributed's tcp:// init): ask the OS."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    """What runs inside a worker process: start a Worker, then serve the engine's calls until shutdown."""

    @staticmethod
    def worker_main(config: EngineConfig, model_config: ModelConfig, rank: int, init_method: str,
                    conn: Connection) -> None:
        # Ctrl-C goes to the whole process group: the engine decides when workers stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        worker = None
        try:
            from mini_vllm.worker import Worker
            worker = Worker(config, model_config, rank, init_method)
            worker.init_device()
            worker.load_model()
            conn.send(("ready", os.getpid()))
        except BaseException:
            conn.send(("error", f"worker rank {rank} failed to start:\n{traceback.format_exc()}"))
            conn.close()
            os._exit(1)
        WorkerProc.worker_busy_loop(worker, rank, conn)

    @staticmethod
    def worker_busy_loop(worker, rank: int, conn: Connection) -> None:
        while True:
            try:
                method, args, reply_rank = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):          # the engine is gone: so are we
                break
            if method == "shutdown":
                break
            try:
                # Async scheduling: the step's sampled tokens are waited for here, in the worker (its reply
                # crosses a pipe), while the engine core already schedules the next step.
                result = get_output(getattr(worker, method)(*args))
            except BaseException:
                # Fatal: the other ranks may be waiting in a collective this rank will never join.
                conn.send(("error", f"worker rank {rank} raised in {method}:\n{traceback.format_exc()}"))
                conn.close()
                os._exit(1)
            if reply_rank is None or reply_rank == rank:
                conn.send(("ok", result))
        try:
            worker.shutdown()
        finally:
            conn.close()


def _stop_workers(procs: list, conns: list[Connection], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Ask, then insist: shutdown message, join (up to grace_s), terminate, kill. Safe to call twice."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", (), None)))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive() and grace_s > 0:
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()
    for proc in procs:
        try:
            proc.close()
        except ValueError:                           # still running after SIGKILL: nothing more we can do
            pass


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        from mini_vllm.model_runner import ModelRunner
        self.attn_backend = ModelRunner._attention_backend(self.config, self.model_config)
        self.world_size = self.parallel_config.world_size
        self.timeout_s = float(self.config.execute_model_timeout_s)
        self.failure: str | None = None
        self._in_flight = 0                      # execute_model_async steps whose reply is not read yet
        # Forked from the forkserver (processes.start_process), which imported torch and the model code
        # once: not a plain fork of the engine's process, whose torch (OpenMP) thread pools a child
        # would inherit broken; not spawn, which imports torch again in every worker (vLLM spawns).
        self.init_method = init_method = f"tcp://127.0.0.1:{_free_port()}"      # rank 0 serves the rendezvous
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent, child = multiprocessing.Pipe()
            proc = start_process(WorkerProc.worker_main, self.config, self.model_config, rank, init_method, child,
                                 name=f"mini_vllm-worker-{rank}")
            child.close()                        # the child's end lives in the child: EOF here when it exits
            self.procs.append(proc)
            self.conns.append(parent)
        self.pids = [proc.pid for proc in self.procs]
        # If the executor is dropped without shutdown(), its workers still go (and with the engine's process: daemon).
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            pids = self._wait_replies(list(range(self.world_size)), "start-up",
                                      max(self.timeout_s, STARTUP_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise
        logger.info("MultiprocExecutor: %d workers (tp=%d, pp=%d), pids %s", self.world_size,
                    self.parallel_config.tensor_parallel_size, self.parallel_config.pipeline_parallel_size, pids)

    # ------------------------------------------------------------------ calls
    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        if self._in_flight:
            raise RuntimeError(f"collective_rpc({method!r}) with {self._in_flight} step(s) in flight: their replies "
                               "come first; wait for them (FutureOutput.result) before calling")
        self._send(method, args, unique_reply_rank)
        ranks = list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank]
        results = self._wait_replies(ranks, method)
        return results if unique_reply_rank is None else results[0]

    def execute_model_async(self, scheduler_output) -> FutureOutput:
        """Send the step to every worker and return: each worker runs its messages in order, so
        stage 0 starts this step while the later stages still run the previous one, and the
        output rank's replies arrive in the order the steps were sent (the engine waits for them
        oldest first)."""
        reply_rank = self.reply_rank
        self._send("execute_model", (scheduler_output,), reply_rank)
        self._in_flight += 1

        def wait():
            try:
                ranks = list(range(self.world_size)) if reply_rank is None else [reply_rank]
                return self._step_output(self._wait_replies(ranks, "execute_model"))
            finally:
                self._in_flight -= 1
        return FutureOutput(wait)

    def _send(self, method: str, args: tuple, unique_reply_rank: int | None) -> None:
        """Pickle (method, args) once and write it to every worker's pipe."""
        if self.failure is not None:
            raise ExecutorError(self.failure)
        try:
            message = pickle.dumps((method, args, unique_reply_rank))      # pickled once for every rank
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"{method}: its arguments cannot be sent to the worker processes ({e}); e.g. a "
                             "logits processor must be a module-level function, not a lambda") from None
        self.last_message_bytes = len(message)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except (OSError, ValueError) as e:
            self._fail(f"could not send {method} to the workers ({e}): {self._dead_workers() or 'a pipe is closed'}")

    def _wait_replies(self, ranks: list[int], what: str, timeout_s: float | None = None) -> list:
        """One reply from each of `ranks`, waiting at most timeout_s (default: execute_model_timeout_s);
        a dead worker ends the wait at once."""
        replies: dict[int, object] = {}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while len(replies) < len(ranks):
            pending = {self.conns[r]: r for r in ranks if r not in replies}
            left = deadline - time.monotonic()
            ready = wait(list(pending) + list(sentinels), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                self._fail(f"no reply to {what} from worker rank(s) {sorted(pending.values())} within "
                           f"{timeout_s:g} s: the workers are hung")
            for conn in (c for c in ready if c in pending):     # a reply first: it may carry the traceback
                rank = pending[conn]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    continue                                    # its sentinel tells how it died
                if status == "error":                          # a dead peer explains a failed collective
                    dead = self._dead_workers()
                    self._fail(f"{dead}; then {value}" if dead else value)
                replies[rank] = value
            dead = self._dead_workers()
            if dead and len(replies) < len(ranks):
                self._fail(self._last_words() or f"{dead} during {what}")
        return [replies[r] for r in ranks]

    def _last_words(self) -> str | None:
        """The traceback a dead worker sent before exiting, if it had time to (it explains the death)."""
        for proc, conn in zip(self.procs, self.conns):
            try:
                if proc.exitcode is not None and conn.poll():
                    status, value = conn.recv()
                    if status == "error":
                        return value
            except (EOFError, OSError):
                continue
        return None

    def _dead_workers(self) -> str:
        dead = [f"rank {rank} (pid {proc.pid}, exit code {proc.exitcode})"
                for rank, proc in enumerate(self.procs) if proc.exitcode is not None]
        return ("worker " + ", ".join(dead) + " died") if dead else ""

    def _fail(self, message: str):
        """The ranks can no longer step together: remember why, stop every worker, raise."""
        self.failure = f"the multiprocess executor failed: {message}"
        logger.error("%s", self.failure)
        # The survivors are blocked in collectives with the dead or hung rank: no grace, terminate them.
        if self._finalizer.detach() is not None:
            _stop_workers(self.procs, self.conns, grace_s=0.0)
        raise ExecutorError(self.failure)

    def check_health(self) -> None:
        if self.failure is None and (dead := self._dead_workers()):
            self._fail(dead)
        if self.failure is not None:
            raise ExecutorError(self.failure)

    @property
    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def shutdown(self) -> None:
        """Stop every worker (they leave their process groups, rank 0 closes the rendezvous port)."""
        if self._finalizer.alive:
            self._finalizer()
