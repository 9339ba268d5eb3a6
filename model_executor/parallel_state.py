"""Who am I among the ranks, and the collectives the parallel layers call: the tensor- and pipeline-parallel groups.

Mirrors vLLM's `vllm/distributed/parallel_state.py` (`GroupCoordinator`, `init_distributed_environment`,
`initialize_model_parallel`, `get_tp_group`, `get_pp_group`) and `communication_op.py`
(`tensor_model_parallel_all_reduce`, `tensor_model_parallel_all_gather`).

Why global state: a layer deep inside the model (a RowParallelLinear in layer 17) must know its rank
and how to all-reduce, but the model code should read like the single-device model — so, as in vLLM
and Megatron, the groups are set once per process (by chapter 07's worker, before it builds the model)
and the layers ask `get_tp_group()`. Until then every group is a single rank: the layers are exactly
the single-device layers and nothing touches `torch.distributed` (chapter 04's EAGLE head
and every single-process test run this way).

Rank layout (vLLM's): world rank = pp_rank * tp_size + tp_rank. TP groups are consecutive ranks
(they talk every layer: keep them on one node / NVLink); a PP group is every tp_size-th rank.

Each group's `device_group` is a torch.distributed process group: gloo on CPU, NCCL on GPU. (vLLM's
GroupCoordinator also keeps a gloo `cpu_group` for Python objects; here the scheduler output reaches
the workers through the executor's pipes, chapter 07's executor/multiproc_executor.py.) Every
collective is counted (calls, bytes, seconds) so the communication per step can be measured
(chapter 07's `Worker.comm_stats`).
"""
from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """What one group's collectives cost since the last reset: per op, calls, payload bytes, seconds."""
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + nbytes
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds


class GroupCoordinator:
    """A group of ranks that run collectives together (vLLM: GroupCoordinator).

    ranks: the world ranks in this group; rank_in_group: this process's index among them. With one
    rank (or no process group at all) every collective is the identity, so single-device code pays
    nothing for going through it."""

    def __init__(self, ranks: list[int], rank_in_group: int, device_group=None):
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = rank_in_group
        self.device_group = device_group
        self.stats = CommStats()

    @property
    def rank(self) -> int:
        """This process's world rank."""
        return self.ranks[self.rank_in_group]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def _timed(self, op: str, nbytes: int, fn):
        global _COMM_FAILURE
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:
            # Remembered for the worker: a failed collective means a peer is gone or the ranks have
            # diverged — not a fault of the request being run, whatever the caller concludes.
            _COMM_FAILURE = f"{op} on ranks {self.ranks} failed: {e}"
            raise
        self.stats.add(op, nbytes, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ tensors (device_group)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns it. (Row-parallel outputs: each rank holds a partial sum.)"""
        if self.world_size == 1:
            return x
        return self._timed("all_reduce", x.numel() * x.element_size(),
                           lambda: (dist.all_reduce(x, group=self.device_group), x)[1])

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order: [.., n, ..] -> [.., world * n, ..]."""
        if self.world_size == 1:
            return x
        x = x.contiguous()

        def gather():
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.device_group)
            return torch.cat(parts, dim=dim)
        return self._timed("all_gather", x.numel() * x.element_size(), gather)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src` (index in the group)'s `x` into everyone's `x`, in place."""
        if self.world_size == 1:
            return x
        return self._timed("broadcast", x.numel() * x.element_size(),
                           lambda: (dist.broadcast(x, self.ranks[src], group=self.device_group), x)[1])

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point, to group index `dst` (pipeline stages hand their activations on)."""
        self._timed("send", x.numel() * x.element_size(), lambda: dist.send(x.contiguous(), self.ranks[dst],
                                                                            group=self.device_group))

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `x` (shape and dtype known to both sides) from group index `src`."""
        return self._timed("recv", x.numel() * x.element_size(),
                           lambda: (dist.recv(x, self.ranks[src], group=self.device_group), x)[1])


_COMM_FAILURE: str | None = None


def communication_failure() -> str | None:
    """Why a collective of this process failed, if one did: the group is broken for good (chapter
    07's worker checks it after each step — the model runner would otherwise blame the requests)."""
    return _COMM_FAILURE


def _single() -> GroupCoordinator:
    return GroupCoordinator([0], 0)


_WORLD: GroupCoordinator = _single()
_TP: GroupCoordinator = _single()
_PP: GroupCoordinator = _single()


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def init_distributed_environment(world_size: int, rank: int, init_method: str, backend: str = "gloo",
                                 timeout_s: float = 60.0) -> None:
    """Join the world (vLLM: init_distributed_environment). `timeout_s` bounds every collective:
    a rank that never arrives makes the others raise instead of waiting forever."""
    global _WORLD
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD)


def initialize_model_parallel(tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1) -> None:
    """Split the world into TP and PP groups (vLLM: initialize_model_parallel). Every rank creates
    every group, in the same order — `new_group` is itself a collective."""
    global _TP, _PP
    world, rank = _WORLD.world_size, _WORLD.rank
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp * pp != world:
        raise ValueError(f"tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) must equal the world size ({world})")
    for ranks in ([p * tp + t for t in range(tp)] for p in range(pp)):          # TP groups: consecutive ranks
        group = _new_group(ranks, world)
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group)
    for ranks in ([p * tp + t for p in range(pp)] for t in range(tp)):          # PP groups: stride tp
        group = _new_group(ranks, world)
        if rank in ranks:
            _PP = GroupCoordinator(ranks, ranks.index(rank), group)


def _new_group(ranks: list[int], world: int):
    """A process group over `ranks` (the world's backend); one rank needs none, all ranks are the world."""
    if len(ranks) == 1:
        return None
    if len(ranks) == world:
        return dist.group.WORLD
    return dist.new_group(ranks)


def destroy_model_parallel() -> None:
    """Forget the groups and leave the world (the worker's shutdown); back to a single rank."""
    global _WORLD, _TP, _PP, _COMM_FAILURE
    _WORLD, _TP, _PP, _COMM_FAILURE = _single(), _single(), _single(), None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def whole_model_on_this_stage():
    """Build a model that lives whole on this pipeline stage (a drafter beside the last stage of the
    target, vLLM's EAGLE / draft models under pipeline parallelism): inside, the PP group is this
    rank alone; the TP group is unchanged, so the model is sharded like the target's stage. A model
    keeps the groups it was built with (LlamaModel.pp)."""
    global _PP
    saved, _PP = _PP, _single()
    try:
        yield
    finally:
        _PP = saved


@contextlib.contextmanager
def whole_model_on_this_rank():
    """Build a model that is whole on every rank (a small EAGLE head: replicated, not sharded): inside,
    both the TP and the PP group are this rank alone. Its layers keep those groups (they capture the
    group they were built with), so at run time it calls no collective."""
    global _TP, _PP
    saved, (_TP, _PP) = (_TP, _PP), (_single(), _single())
    try:
        yield
    finally:
        _TP, _PP = saved


def set_groups_for_testing(tp: GroupCoordinator | None = None, pp: GroupCoordinator | None = None) -> None:
    """Pretend to be one rank of a larger group without any process group: a test builds the
    layers of rank r of world n in one process and checks their shards (no collective may run).
    Called with no arguments: back to a single rank."""
    global _TP, _PP
    _TP, _PP = tp or _single(), pp or _single()
