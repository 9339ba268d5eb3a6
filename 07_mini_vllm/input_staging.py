"""One step's index arrays on their way to the GPU: pinned host buffers, non-blocking copies, an event.

Mirrors vLLM v1's `CpuGpuBuffer` (`vllm/v1/utils.py`: a pinned host tensor, its numpy view and a
device tensor of the same shape; `copy_to_gpu(n)`) and `GPUModelRunner.prepare_inputs_event`
(`synchronize_input_prep`: wait for the event before writing the host buffers, record it after
the copies).

Why: a host-to-device copy from ordinary (pageable) host memory is synchronous. CUDA stages it
through a driver buffer and torch returns only when the copy is done — and the copy, queued on the
same stream as everything else, runs only after every kernel queued before it: the previous step's
forward pass. So `torch.from_numpy(ids).to("cuda")` makes the host wait for the GPU, once per copy.
Without async scheduling the host waits for that step anyway; with it (async_scheduler.py), step N+1
is prepared while step N runs, and this one wait removes the overlap. From page-locked (pinned)
memory a copy is a DMA the host only enqueues (`non_blocking=True`) and returns at once.

The price: the host must not write the pinned buffer again until the DMA has read it. An event
recorded after the copies marks that point; the next step waits for it before it writes. It waits
for the copies only, which ran before step N's forward (the stream's order: copies, then the
kernels that read them), so it does not wait for the forward pass.

The device buffers are persistent too: each step's `ModelInputs` tensors are views of them. That is
safe on one stream — a later step's copies are queued after this step's kernels, which have read
their inputs by then — but a step's `ModelInputs` hold its values only until its buffers are used
again. Two buffer sets, used in turn, keep them through the next step's preparation, which is as
long as async scheduling's engine core needs them (it traces step N after sending step N+1).

On a CPU there is nothing to overlap and no DMA: `InputBatch` then hands numpy arrays to torch
without a copy (`torch.from_numpy`), and no staging exists.
"""
from __future__ import annotations

import numpy as np
import torch


class StagingBuffer:
    """A host tensor (pinned where the device is a GPU), its numpy view, and a device tensor of the
    same size: the host side is written with numpy, then `copy_to_device(n)` sends its first n
    elements (vLLM: CpuGpuBuffer). It grows when a step needs more than it holds."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool):
        self.dtype, self.device, self.pin_memory = dtype, device, pin_memory
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.host = torch.zeros(size, dtype=self.dtype, pin_memory=self.pin_memory)          # [size]
        self.np = self.host.numpy()                                                            # same memory
        self.device_tensor = torch.zeros(size, dtype=self.dtype, device=self.device)          # [size]

    @property
    def size(self) -> int:
        return self.host.numel()

    def reserve(self, n: int) -> None:
        """Room for n elements. Only once this set's event has completed: a host buffer given up here
        is then read by no copy in flight (and a device buffer given up still serves the kernels
        queued before: torch's caching allocator reuses its memory in stream order)."""
        if n > self.size:
            self._allocate(max(n, 2 * self.size))

    def copy_to_device(self, n: int) -> torch.Tensor:
        """The first n host elements, sent without waiting; returns the device view [n]."""
        return self.device_tensor[:n].copy_(self.host[:n], non_blocking=self.pin_memory)


class _BufferSet:
    """One step's three buffers (int64: input ids, positions, slot mapping, logits indices and the
    async scatter indices; int32: seq_lens and query_start_loc; int32: the block table, flattened)
    and the event that says when the host may write them again."""

    def __init__(self, device: torch.device, max_num_tokens: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 pin: bool):
        self.int64 = StagingBuffer(3 * max_num_tokens + max_num_reqs, torch.int64, device, pin)
        self.int32 = StagingBuffer(2 * max_num_reqs + 1, torch.int32, device, pin)
        self.block_table = StagingBuffer(max_num_reqs * max_num_blocks_per_req, torch.int32, device, pin)
        self.event = torch.cuda.Event() if device.type == "cuda" else None


class InputStaging:
    """`num_sets` buffer sets, used in turn: a step's `ModelInputs` keep their values until `num_sets`
    more steps have been prepared. With async scheduling one step is in flight while the next is
    prepared, and a trace reads the older step's inputs after that (step_trace.py): two sets keep
    it true."""

    def __init__(self, device: str | torch.device, max_num_tokens: int, max_num_reqs: int,
                 max_num_blocks_per_req: int, num_sets: int = 2, pin_memory: bool | None = None):
        self.device = torch.device(device)
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.sets = [_BufferSet(self.device, max_num_tokens, max_num_reqs, max_num_blocks_per_req, pin)
                     for _ in range(num_sets)]
        self.num_staged = 0                       # steps staged so far; the next uses sets[num_staged % num_sets]

    def stage(self, int64_parts: list[np.ndarray], int32_parts: list[np.ndarray],
              table: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Write the parts into the next set's host buffers and start the three copies; returns the
        device views of the parts (in order) and of the table [n, width]."""
        bufs = self.sets[self.num_staged % len(self.sets)]
        self.num_staged += 1
        if bufs.event is not None:
            bufs.event.synchronize()              # its last copies have read the host buffers
        out = []
        for buffer, parts in ((bufs.int64, int64_parts), (bufs.int32, int32_parts)):
            sizes = [len(p) for p in parts]
            total = sum(sizes)
            buffer.reserve(total)
            np.concatenate(parts, out=buffer.np[:total], casting="same_kind")
            out.append(list(buffer.copy_to_device(total).split(sizes)))
        n, width = table.shape
        bufs.block_table.reserve(n * width)
        bufs.block_table.np[:n * width].reshape(n, width)[:] = table
        table_t = bufs.block_table.copy_to_device(n * width).view(n, width)                 # [n, width]
        if bufs.event is not None:
            bufs.event.record()                   # what the next use of this set waits for
        return out[0], out[1], table_t
