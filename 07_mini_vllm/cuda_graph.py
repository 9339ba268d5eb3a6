"""CUDA graphs for decode steps: capture the whole forward once per batch-size bucket, replay it.

Mirrors vLLM's decode CUDA graphs (`vllm/v1/worker/gpu_model_runner.py: capture_model`,
`_dummy_run`; `CompilationConfig.cudagraph_capture_sizes`; the FULL cudagraph mode that
`TritonAttentionBackend` allows, `AttentionCGSupport.ALWAYS`).

Why [Kwon 2025, §4.6.3]: a decode step of a small model is hundreds of tiny kernels; launching them
one by one from Python costs more than running them. A CUDA graph records the kernel sequence
once and replays it with one launch. What a graph cannot do is change: shapes, pointers, or
host-side decisions are frozen at capture. Hence:

  * **Buckets.** One graph per batch size in `capture_sizes` (1, 2, 4, ..., max_num_seqs); a
    batch of n decodes runs the graph of the smallest bucket >= n, padded. Batches with a
    prefill chunk (max_query_len > 1) or larger than the largest bucket run eagerly.
  * **Static buffers.** Inputs and attention metadata live in preallocated tensors; a step copies
    its values in, replays, and reads the output buffer. `query_start_loc` of a pure decode batch
    is always 0, 1, ..., size: written once.
  * **Padding rows write nothing.** A padded row has slot -1 (reshape_and_cache skips it),
    seq_len 1 and block 0: its attention reads one real slot and its output is never used.
  * **No host reads inside.** The Triton attention and cache kernels are launched with
    `check_values=False` and with `max_query_len=1`, `max_seq_len=max_model_len` fixed, so
    their launch plan is the same at every replay (chapter 05 tests this under capture). The
    torch attention backend reads seq_lens on the host, so it never runs in a graph.

Everything except the capture itself also runs on a CPU (`eager=True`): the tests check that a
padded bucket gives the real rows exactly the hidden states of the unpadded batch.
"""
from __future__ import annotations

import bisect

import torch
from torch import nn

from paged_attention.metadata import AttentionMetadata

from mini_vllm.model_inputs import ModelInputs


def padded_batch_size(num_reqs: int, capture_sizes: list[int]) -> int | None:
    """The smallest captured size >= num_reqs (capture_sizes ascending), or None: run eagerly."""
    i = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[i] if i < len(capture_sizes) else None


class DecodeBuffers:
    """The static inputs every graph reads, sized for the largest bucket."""

    def __init__(self, max_size: int, max_num_blocks_per_req: int, device: torch.device):
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_size, max_num_blocks_per_req, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)   # 1 token per row
        # Rows >= num_real hold padding: a fill writes padding only over the rows the previous fill
        # made real, not over the whole bucket every step — in a run of decode steps the batch size
        # does not change, and each padding write is a kernel launch on a GPU. Unknown at first
        # (the buffers may have been written by anyone): the first fill pads every row it does not fill.
        self.num_real = max_size

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """Views of the first `size` rows: the same memory at capture and at every replay."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 max_query_len=1, max_seq_len=max_seq_len)

    def fill(self, inputs: ModelInputs, size: int) -> None:
        """Copy one pure-decode step (n <= size rows) in; rows n..size-1 become padding."""
        md = inputs.attn_metadata
        n = inputs.input_ids.shape[0]
        if md.max_query_len != 1 or md.num_seqs != n or n > size:
            raise ValueError(f"a CUDA-graph step is n <= {size} requests with one token each; got {n} tokens "
                             f"for {md.num_seqs} requests, max_query_len {md.max_query_len}")
        ### BEGIN SOLUTION
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        # Padding rows: token 0 at position 0, written nowhere (slot -1), attending to one slot of block 0.
        # Rows >= num_real are padding already; only rows the last fill made real need it again.
        if n < self.num_real:
            self.pad_rows(n, self.num_real)
        self.num_real = n
        ### END SOLUTION

    def pad_rows(self, start: int, stop: int) -> None:
        """Make rows start..stop-1 padding rows."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = -1
        self.seq_lens[start:stop] = 1
        self.block_tables[start:stop] = 0


class CUDAGraphRunner:
    """One captured decode forward per bucket. `run(inputs)` -> hidden states [n, hidden].

    eager=True (no capture, e.g. on a CPU) runs the same padded forward eagerly: the buffers and
    padding logic are exercised without a GPU.
    """

    def __init__(self, model: nn.Module, kv_caches, capture_sizes: list[int], max_model_len: int,
                 max_num_blocks_per_req: int, device: torch.device, eager: bool = False):
        if not capture_sizes or capture_sizes != sorted(set(capture_sizes)):
            raise ValueError(f"capture_sizes must be ascending and distinct, got {capture_sizes}")
        self.model, self.kv_caches = model, kv_caches
        self.capture_sizes = list(capture_sizes)
        self.max_model_len = max_model_len
        self.eager = eager
        self.buffers = DecodeBuffers(self.capture_sizes[-1], max_num_blocks_per_req, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}      # size -> the static hidden-state output of its graph

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches,
                          b.metadata(size, self.max_model_len))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (vLLM's order: the
        largest graph's pool is reused by the smaller ones)."""
        if self.eager:
            raise RuntimeError("capture() needs CUDA; this runner was built with eager=True")
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            self.buffers.pad_rows(0, size)              # an all-padding batch: capture writes no KV
            self.buffers.num_real = 0
            for _ in range(2):                          # warm-up: Triton compiles, allocator settles
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, inputs: ModelInputs) -> bool:
        md = inputs.attn_metadata
        return md.max_query_len == 1 and padded_batch_size(md.num_seqs, self.capture_sizes) is not None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        n = inputs.input_ids.shape[0]
        size = padded_batch_size(n, self.capture_sizes)
        if size is None:
            raise ValueError(f"{n} requests exceed the largest captured size {self.capture_sizes[-1]}")
        self.buffers.fill(inputs, size)
        if self.eager:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
