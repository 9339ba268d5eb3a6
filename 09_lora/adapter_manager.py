"""Which adapters are loaded, and which sit in the fixed device slots the LoRA layers read.

Mirrors vLLM's `vllm/lora/model_manager.py: LRUCacheLoRAModelManager` and `vllm/lora/worker_manager.py:
LRUCacheWorkerLoRAManager`. Two caches, two sizes:

    host cache   up to `max_cpu_loras` LoRAModels read from disk (CPU tensors), least recently used evicted
    device slots `max_loras` rows of preallocated stacked tensors, one set per target layer:
                     lora_a [max_loras, num_slices, max_lora_rank, in]
                     lora_b [max_loras, num_slices, max_out, max_lora_rank]   max_out = the largest slice

Why fixed slots: a batch mixes requests of different adapters, and one kernel (vLLM's punica
shrink/expand) serves all of them by indexing these stacked tensors with a slot id per token. The
tensors are allocated once, so activating an adapter is a copy into a slot, never an allocation, and
their shapes never change (CUDA graphs captured over them stay valid).

Why zero padding: an adapter of rank r < max_lora_rank fills A's first r rows and B's first r columns;
the rest stay zero and add exactly nothing. A slice the adapter does not target (a LoRA on q only)
is all zeros in its slot. Every write zeroes the whole slot first, so a rank-2 adapter never
inherits the rank-8 rows of the one it evicted.

The scaling (alpha / r, or alpha / sqrt(r)) is FOLDED INTO B when a slot is written (vLLM:
`LoRAModel.optimize`/`lora_b * scaling`): the layer then computes (x A^T) B^T with no per-slot scale.
The host copy keeps B as stored, so the slot is rebuilt from it the same way every time.

Slot ids are what `LoRAMapping.token_lora` holds per token (layers.py); -1 means "no LoRA" (the base
model). Adapter ids are the caller's positive ints (vLLM: LoRARequest.lora_int_id).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lora.peft_checkpoint import LoRAModel, LoRATarget, checkpoint_targets, load_peft_adapter

NO_LORA = -1                                     # the slot of a token that runs the base model


class AllSlotsPinnedError(RuntimeError):
    """Every device slot holds an adapter the running batch needs: nothing may be evicted."""


@dataclass
class SlotWeights:
    """One target layer's stacked slot tensors (what LoRALinearMethod reads)."""
    lora_a: torch.Tensor                         # [max_loras, num_slices, max_lora_rank, in]
    lora_b: torch.Tensor                         # [max_loras, num_slices, max_out, max_lora_rank], scaling folded in
    output_sizes: tuple[int, ...]                # each slice's rows; slice i's B is lora_b[:, i, :output_sizes[i]]

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.output_sizes[:i]) for i in range(len(self.output_sizes)))


class LoRAAdapterManager:
    """Host LRU cache of loaded adapters + `max_loras` device slots with LRU eviction."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        # This rank's shard of every layer (tensor parallel), other stages' layers too (pipeline parallel):
        # an adapter is checked whole, its local part kept.
        self.targets: dict[str, LoRATarget] = checkpoint_targets(model)
        if not self.targets:
            raise ValueError("the model has no layer a LoRA can target (qkv_proj, o_proj, gate_up_proj, down_proj)")
        param = next(model.parameters())
        self.slot_weights: dict[str, SlotWeights] = {
            name: SlotWeights(
                torch.zeros(max_loras, len(t.output_sizes), max_lora_rank, t.input_size, dtype=param.dtype,
                            device=param.device),
                torch.zeros(max_loras, len(t.output_sizes), max(t.output_sizes), max_lora_rank, dtype=param.dtype,
                            device=param.device),
                t.output_sizes)
            for name, t in self.targets.items() if t.local}
        self._paths: dict[int, Path] = {}                      # every added adapter, cached or not
        self._host: OrderedDict[int, LoRAModel] = OrderedDict()   # least recently used first
        self._slot_owner: list[int | None] = [None] * max_loras   # adapter id in each slot
        self._slot_lru: OrderedDict[int, int] = OrderedDict()     # adapter id -> slot, least recently used first
        self.num_disk_loads = 0

    # ---- host cache ------------------------------------------------------------------------

    def add_adapter(self, adapter_id: int, path: str | Path) -> LoRAModel:
        """Register `adapter_id` and load it into the host cache (validated now: a bad adapter fails
        when it is added, not in the middle of a batch). Already cached from the same path: no reload.
        Known from ANOTHER path: the new adapter replaces it once it has loaded (a failed load leaves
        the old one as it was) -- an id names one adapter at a time, and the engine's front end
        refuses an id re-pointed while requests use it."""
        if not isinstance(adapter_id, int) or adapter_id < 1:
            raise ValueError(f"adapter ids are positive ints, got {adapter_id!r}")
        path = Path(path)
        if self._paths.get(adapter_id, path) != path:
            lora = self._load(path)
            self.remove_adapter(adapter_id)
            self._paths[adapter_id] = path
            self._cache(adapter_id, lora)
        elif adapter_id not in self._host:
            lora = self._load(path)
            self._paths[adapter_id] = path
            self._cache(adapter_id, lora)
        return self._get(adapter_id)

    def path_of(self, adapter_id: int) -> Path | None:
        """Where `adapter_id` was added from (None: unknown)."""
        return self._paths.get(adapter_id)

    def remove_adapter(self, adapter_id: int) -> bool:
        """Forget `adapter_id`: host copy, path and device slot (zeroed). False if it was unknown."""
        known = self._paths.pop(adapter_id, None) is not None
        self._host.pop(adapter_id, None)
        slot = self._slot_lru.pop(adapter_id, None)
        if slot is not None:
            self._slot_owner[slot] = None
            for weights in self.slot_weights.values():
                weights.lora_a[slot].zero_()
                weights.lora_b[slot].zero_()
        return known

    def list_adapters(self) -> list[int]:
        """Adapter ids in the host cache, least recently used first."""
        return list(self._host)

    def _load(self, path: Path) -> LoRAModel:
        self.num_disk_loads += 1
        return load_peft_adapter(path, self.targets, self.max_lora_rank)

    def _cache(self, adapter_id: int, lora: LoRAModel) -> None:
        self._host[adapter_id] = lora
        while len(self._host) > self.max_cpu_loras:
            # A slot holds its own copy, so an evicted host entry's slot keeps serving; only a later
            # re-activation after the slot is lost reads the disk again.
            self._host.popitem(last=False)

    def _get(self, adapter_id: int) -> LoRAModel:
        """The host copy, most recently used now; read again from disk if the cache evicted it."""
        if adapter_id not in self._paths:
            raise KeyError(f"unknown adapter id {adapter_id}: add_adapter it first")
        if adapter_id in self._host:
            self._host.move_to_end(adapter_id)
        else:
            self._cache(adapter_id, self._load(self._paths[adapter_id]))
        return self._host[adapter_id]

    # ---- device slots ----------------------------------------------------------------------

    def slot_of(self, adapter_id: int | None) -> int | None:
        """The slot `adapter_id` is in (NO_LORA for None: the base model), None if not resident."""
        return NO_LORA if adapter_id is None else self._slot_lru.get(adapter_id)

    def activate(self, adapter_id: int | None, pinned: Collection[int] = ()) -> int:
        """Make `adapter_id` resident and return its slot (NO_LORA for None). `pinned`: adapters the
        running batch uses; their slots are never evicted (AllSlotsPinnedError if nothing else is left)."""
        if adapter_id is None:
            return NO_LORA
        if adapter_id in self._slot_lru:                      # resident: just most recently used now
            self._slot_lru.move_to_end(adapter_id)
            if adapter_id in self._host:
                self._host.move_to_end(adapter_id)
            return self._slot_lru[adapter_id]
        lora = self._get(adapter_id)
        slot = self._choose_slot(set(pinned))
        evicted = self._slot_owner[slot]
        if evicted is not None:
            del self._slot_lru[evicted]
        self._write_slot(slot, lora)
        self._slot_owner[slot] = adapter_id
        self._slot_lru[adapter_id] = slot
        return slot

    def activate_batch(self, adapter_ids: Iterable[int | None]) -> dict[int | None, int]:
        """Slots for every adapter of one batch (vLLM: set_active_adapters): all of them pinned while
        the others are brought in. More distinct adapters than slots is an error."""
        wanted = list(dict.fromkeys(adapter_ids))
        pinned = {a for a in wanted if a is not None}
        if len(pinned) > self.max_loras:
            raise AllSlotsPinnedError(f"the batch uses {len(pinned)} adapters but there are only "
                                      f"max_loras={self.max_loras} slots")
        return {a: self.activate(a, pinned) for a in wanted}

    def _choose_slot(self, pinned: set[int]) -> int:
        """A free slot if there is one, else the slot of the least recently used adapter not in `pinned`."""
        ### BEGIN SOLUTION
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        for adapter_id, slot in self._slot_lru.items():       # least recently used first
            if adapter_id not in pinned:
                return slot
        ### END SOLUTION
        raise AllSlotsPinnedError(f"all {self.max_loras} LoRA slots hold adapters the running batch uses "
                                  f"({sorted(self._slot_lru)}): raise max_loras or run fewer adapters per batch")

    def _write_slot(self, slot: int, lora: LoRAModel) -> None:
        """Zero the slot, then copy each slice's A and scaling * B into its corner (zero padding)."""
        r = lora.rank
        for name, weights in self.slot_weights.items():
            weights.lora_a[slot].zero_()
            weights.lora_b[slot].zero_()
            for index, pair in lora.layers.get(name, {}).items():
                out = weights.output_sizes[index]
                weights.lora_a[slot, index, :r].copy_(pair.lora_a)                      # [r, in]
                weights.lora_b[slot, index, :out, :r].copy_(pair.lora_b.float() * lora.scaling)  # [out_i, r]
