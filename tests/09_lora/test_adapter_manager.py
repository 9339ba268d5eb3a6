"""The two caches: device slots (LRU among adapters the running batch does not use) and the host
cache of loaded adapters (LRU, re-read from disk only after eviction). And what a slot holds:
A and scaling * B in its corner, zeros everywhere else, whatever the slot held before."""
from __future__ import annotations

import pytest
import torch

from lora.adapter_manager import NO_LORA, AllSlotsPinnedError, LoRAAdapterManager


def manager_with(tiny_lora, max_loras=2, max_cpu_loras=4, ids=(1, 2, 3)) -> LoRAAdapterManager:
    """Adapters 1, 2, 3 = plain, rslora, partial (4 = plain again under another id)."""
    manager = LoRAAdapterManager(tiny_lora.model, max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras)
    names = {1: "plain", 2: "rslora", 3: "partial", 4: "plain"}
    for i in ids:
        manager.add_adapter(i, tiny_lora.dirs[names[i]])
    return manager


def test_free_slots_first_then_the_least_recently_used(tiny_lora):
    m = manager_with(tiny_lora, max_loras=2)
    assert (m.activate(1), m.activate(2)) == (0, 1)
    assert m.activate(None) == NO_LORA
    assert m.activate(1) == 0                             # resident: same slot; now 2 is the least recent
    assert m.activate(3) == 1 and m.slot_of(2) is None    # 2 evicted, 1 kept
    assert m.activate(2) == 0 and m.slot_of(1) is None    # now 1 was the least recent


def test_pinned_slots_are_never_evicted(tiny_lora):
    m = manager_with(tiny_lora, max_loras=2)
    m.activate(1)
    m.activate(2)                                         # 1 is the least recently used...
    assert m.activate(3, pinned={1}) == 1                 # ...but the running batch uses it: 2 goes
    assert (m.slot_of(1), m.slot_of(3), m.slot_of(2)) == (0, 1, None)
    with pytest.raises(AllSlotsPinnedError, match="all 2 LoRA slots"):
        m.activate(2, pinned={1, 3})
    assert (m.slot_of(1), m.slot_of(3)) == (0, 1)         # a refused activation changes nothing


def test_activate_batch_pins_the_whole_batch(tiny_lora):
    m = manager_with(tiny_lora, max_loras=2)
    m.activate(1)
    m.activate(2)
    # Batch {2, 3, base}: 1 is the only one the batch does not use, so 3 takes its slot.
    assert m.activate_batch([2, None, 3, 2]) == {2: 1, None: NO_LORA, 3: 0}
    with pytest.raises(AllSlotsPinnedError, match="3 adapters but there are only max_loras=2"):
        m.activate_batch([1, 2, 3])


def test_reactivating_a_cached_adapter_does_not_read_the_disk(tiny_lora):
    m = manager_with(tiny_lora, max_loras=1, max_cpu_loras=3)
    assert m.num_disk_loads == 3                          # add_adapter loads (and validates) once
    for i in (1, 2, 3, 1, 2, 3):                          # each activation evicts the previous slot
        m.activate(i)
    assert m.num_disk_loads == 3
    m.add_adapter(2, tiny_lora.dirs["rslora"])            # adding again from the same path: a cache hit
    assert m.num_disk_loads == 3


def test_host_cache_evicts_the_least_recently_used(tiny_lora):
    m = manager_with(tiny_lora, max_loras=1, max_cpu_loras=2)
    assert m.list_adapters() == [2, 3] and m.num_disk_loads == 3   # adding 3 evicted 1
    m.activate(2)                                                  # 2 is now the most recent
    assert m.list_adapters() == [3, 2]
    assert m.activate(1) == 0 and m.num_disk_loads == 4            # evicted: read from disk again
    assert m.list_adapters() == [2, 1]


def test_slot_holds_padded_a_and_scaled_b(tiny_lora):
    m = manager_with(tiny_lora, max_loras=2)
    plain, partial = m.add_adapter(1, tiny_lora.dirs["plain"]), m.add_adapter(3, tiny_lora.dirs["partial"])
    layer = "model.layers.1.self_attn.qkv_proj"
    weights = m.slot_weights[layer]
    assert m.activate(1) == 0
    for index, pair in plain.layers[layer].items():
        out = weights.output_sizes[index]
        assert torch.equal(weights.lora_a[0, index], pair.lora_a)                   # rank 8 = max: no padding
        assert torch.equal(weights.lora_b[0, index, :out], pair.lora_b * 2.0)       # alpha 16 / r 8
        assert not weights.lora_b[0, index, out:].any()                             # k/v rows past their size
    m.activate(2)
    assert m.activate(3) == 0                      # partial (rank 2, k only) overwrites plain's slot
    assert not weights.lora_a[0, [0, 2]].any() and not weights.lora_b[0, [0, 2]].any()   # q, v untargeted
    pair = partial.layers[layer][1]
    assert torch.equal(weights.lora_a[0, 1, :2], pair.lora_a) and not weights.lora_a[0, 1, 2:].any()
    kv = weights.output_sizes[1]
    assert torch.equal(weights.lora_b[0, 1, :kv, :2], pair.lora_b * 2.5)            # alpha 5 / r 2
    assert not weights.lora_b[0, 1, :, 2:].any()                                    # no stale rank-8 columns
    assert not m.slot_weights["model.layers.0.self_attn.o_proj"].lora_a[0].any()   # o_proj untargeted


def test_remove_adapter_frees_and_zeroes_its_slot(tiny_lora):
    m = manager_with(tiny_lora, max_loras=2)
    m.activate(1)
    m.activate(2)
    assert m.remove_adapter(1) is True and m.remove_adapter(1) is False
    assert m.slot_of(1) is None and m.list_adapters() == [3, 2]
    assert all(not w.lora_a[0].any() and not w.lora_b[0].any() for w in m.slot_weights.values())
    assert m.activate(3) == 0                      # the freed slot, not 2's
    with pytest.raises(KeyError, match="unknown adapter id 1"):
        m.activate(1)


def test_bad_arguments(tiny_lora):
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAAdapterManager(tiny_lora.model, max_loras=2, max_lora_rank=8, max_cpu_loras=1)
    m = manager_with(tiny_lora, ids=())
    with pytest.raises(ValueError, match="positive ints"):
        m.add_adapter(0, tiny_lora.dirs["plain"])
    small = LoRAAdapterManager(tiny_lora.model, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="above max_lora_rank=4"):
        small.add_adapter(1, tiny_lora.dirs["plain"])
    assert small.list_adapters() == []


def test_an_id_re_pointed_at_another_adapter_replaces_it_once_loaded(tiny_lora, tmp_path):
    m = manager_with(tiny_lora, ids=())
    m.add_adapter(1, tiny_lora.dirs["plain"])
    slot = m.activate(1)
    name = next(iter(m.slot_weights))
    plain_a = m.slot_weights[name].lora_a[slot].clone()
    # A directory that fails to load leaves the old adapter exactly as it was, slot included.
    with pytest.raises(ValueError, match="not found"):
        m.add_adapter(1, tmp_path / "missing")
    assert m.path_of(1) == tiny_lora.dirs["plain"] and m.slot_of(1) == slot
    assert torch.equal(m.slot_weights[name].lora_a[slot], plain_a)
    # One that loads replaces it: the slot is given up, the next activation writes the new weights.
    m.add_adapter(1, tiny_lora.dirs["rslora"])
    assert m.path_of(1) == tiny_lora.dirs["rslora"] and m.slot_of(1) is None
    slot = m.activate(1)
    r = m._get(1).rank
    assert not torch.equal(m.slot_weights[name].lora_a[slot], plain_a)
    assert not m.slot_weights[name].lora_a[slot, :, r:].any()          # rank 4: the rest of the slot is zero
