"""The start-up heap, frozen out of the garbage collector's walks (vLLM: `vllm/utils/gc_utils.py:
freeze_gc_heap`, called in `EngineCore.__init__` and the API server's start-up).

Why: CPython's cyclic collector walks every tracked container of the generation it collects. After
start-up a serving process holds ~300,000 of them (torch, transformers, the model's modules), alive
for as long as the process is; each collection of the oldest generation walks them all (with
SmolLM2 loaded: 310,000 objects, 158 ms on this project's 2-core CPU while another job ran), paid
by whatever step or streamed token is running at that moment: it lands in the tail latencies (p99
TTFT, ITL). `gc.freeze()` moves every object tracked at that moment to a permanent generation the
collector never visits; collecting first means only live objects are frozen.

Where: the engine core's process (`core_proc.run_engine_core`) and the server's
(`entrypoints/api_server.run_server`), once each has started. Not in-process engines: a test or
notebook process makes and drops many engines, and an object frozen there that later ends up in a
reference cycle would never be collected.
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect every generation, then freeze what is left; returns how many objects are frozen."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    return gc.get_freeze_count()
