"""Block tables and slot mappings: the read view and the write view of the paged KV cache.

A request's KV lives in fixed-size blocks scattered over one big per-layer cache
`[num_blocks, block_size, num_kv_heads, head_dim]`. Two small integer tensors say where:

* block_tables[i, j] = physical block holding tokens [j*B, (j+1)*B) of request i. The
  attention kernels READ history through it. Rows are padded to one width so the whole
  batch is one int32 tensor (vLLM's `BlockTable.block_table` in vllm/v1/worker/block_table.py).
* slot_mapping[t] = block_tables[req(t), pos(t) // B] * B + pos(t) % B: the flat cache row
  each NEW token's K/V is WRITTEN to (by `reshape_and_cache`). A flat index rather than
  (block, offset) because the write kernel then treats the cache as one array of rows.

Example (block_size 16, block table [7, 23, 4]): token 18 is in logical block 18 // 16 = 1,
offset 18 % 16 = 2, physical block 23, slot 23 * 16 + 2 = 370.
"""
from __future__ import annotations

from typing import Sequence

import torch

from paged_attention.metadata import AttentionMetadata


def make_block_tables(
    block_ids: Sequence[Sequence[int]],
    max_num_blocks: int | None = None,
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:                                   # [num_seqs, max_num_blocks] int32
    """Pad per-request lists of physical block ids into one int32 tensor.

    Why pad with 0 (a real block id) like vLLM: kernels never dereference an entry past a
    request's ceil(seq_len / B) blocks, so the pad value is never read as data; a valid id
    keeps even a careless gather in bounds. Tests pad with junk to prove it is never read.
    """
    width = max((len(ids) for ids in block_ids), default=0)
    if max_num_blocks is None:
        max_num_blocks = width
    elif width > max_num_blocks:
        raise ValueError(f"a request holds {width} blocks but max_num_blocks={max_num_blocks}")
    table = torch.full((len(block_ids), max_num_blocks), pad_id, dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        if len(ids) and min(ids) < 0:
            raise ValueError(f"request {i} has a negative block id: {list(ids)}")
        table[i, :len(ids)] = torch.tensor(list(ids), dtype=torch.int32)
    return table.to(device) if device is not None else table


def slot_mapping_for_request(block_ids: Sequence[int], start_pos: int, num_tokens: int, block_size: int) -> list[int]:
    """The clear per-token loop: slots of positions [start_pos, start_pos + num_tokens) of one request."""
    if start_pos < 0 or num_tokens < 0:
        raise ValueError(f"start_pos ({start_pos}) and num_tokens ({num_tokens}) must be >= 0")
    if start_pos + num_tokens > len(block_ids) * block_size:
        raise IndexError(f"positions up to {start_pos + num_tokens - 1} need more than the "
                         f"{len(block_ids)} blocks of {block_size} tokens given")
    slots = []
    ### BEGIN SOLUTION
    for pos in range(start_pos, start_pos + num_tokens):
        physical_block = block_ids[pos // block_size]        # logical block -> physical block
        slots.append(physical_block * block_size + pos % block_size)
    ### END SOLUTION
    return slots


def compute_slot_mapping(
    block_tables: torch.Tensor,   # [num_seqs, max_num_blocks] int32 (rows padded past each request's blocks)
    req_indices: torch.Tensor,    # [num_tokens] int: which request each new token belongs to
    positions: torch.Tensor,      # [num_tokens] int: the token's position in its request
    block_size: int,
    check_values: bool = True,
    *,
    num_blocks_per_req: torch.Tensor | None = None,   # [num_seqs] int: blocks each request really holds
) -> torch.Tensor:                # [num_tokens] int64
    """Slots of a whole batch of new tokens at once, as the model runner builds them.

    Mirrors vLLM v1's `BlockTable.compute_slot_mapping` (vllm/v1/worker/block_table.py):
    index the flattened block table with req * max_num_blocks + pos // B, then add the
    in-block offset.

    Why the range check needs `num_blocks_per_req` (vLLM's `num_blocks_per_row`): a row of
    block_tables is padded to the widest request, and the padding is a real block id (0).
    A position past a request's OWN blocks but inside the padded width would silently get
    a slot in the padding block and overwrite someone else's K/V. So with check_values
    every position must be < num_blocks_per_req[req] * block_size. The check reads the
    tensors (a device sync): the engine's hot path passes check_values=False (and then
    need not pass the counts) once its own bookkeeping is trusted.
    """
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_num_blocks], got {tuple(block_tables.shape)}")
    if req_indices.shape != positions.shape or req_indices.dim() != 1:
        raise ValueError(f"req_indices and positions must both be [num_tokens]; got {tuple(req_indices.shape)} and {tuple(positions.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_seqs, max_num_blocks = block_tables.shape
    if num_blocks_per_req is not None and num_blocks_per_req.shape != (num_seqs,):
        raise ValueError(f"num_blocks_per_req must be [num_seqs={num_seqs}], got {tuple(num_blocks_per_req.shape)}")
    if check_values:
        if num_blocks_per_req is None:
            raise ValueError("check_values=True needs num_blocks_per_req (the blocks each request holds): the padded "
                             "table width cannot tell a request's own blocks from padding")
        _check_slot_mapping_inputs(block_tables, req_indices, positions, block_size, num_blocks_per_req)
    ### BEGIN SOLUTION
    positions = positions.long()
    flat_index = req_indices.long() * max_num_blocks + positions // block_size   # [num_tokens]
    physical_blocks = block_tables.reshape(-1)[flat_index].long()                # [num_tokens]
    slot_mapping = physical_blocks * block_size + positions % block_size
    ### END SOLUTION
    return slot_mapping


def _check_slot_mapping_inputs(block_tables, req_indices, positions, block_size, num_blocks_per_req) -> None:
    num_seqs, max_num_blocks = block_tables.shape
    lo_n, hi_n = (int(num_blocks_per_req.min()), int(num_blocks_per_req.max())) if num_seqs else (0, 0)
    if lo_n < 0 or hi_n > max_num_blocks:
        raise ValueError(f"num_blocks_per_req in [{lo_n}, {hi_n}] but block_tables rows hold {max_num_blocks} entries")
    if not positions.numel():
        return
    if int(req_indices.min()) < 0 or int(req_indices.max()) >= num_seqs:
        raise IndexError(f"req_indices in [{int(req_indices.min())}, {int(req_indices.max())}] but there are {num_seqs} requests")
    if int(positions.min()) < 0:
        raise IndexError(f"positions must be >= 0, got min {int(positions.min())}")
    capacity = num_blocks_per_req.long()[req_indices.long()] * block_size           # [num_tokens] each token's own limit
    beyond = (positions.long() >= capacity).nonzero()
    if beyond.numel():
        t = int(beyond[0, 0])
        req = int(req_indices[t])
        raise IndexError(f"token {t}: position {int(positions[t])} of request {req} is past its own "
                         f"{int(num_blocks_per_req[req])} blocks of {block_size} (= {int(capacity[t])} positions); "
                         "the rest of its block_tables row is padding")


def build_attention_metadata(
    block_ids: Sequence[Sequence[int]],    # per request: its physical blocks, in logical order
    num_computed_tokens: Sequence[int],    # per request: tokens whose KV is already cached
    num_new_tokens: Sequence[int],         # per request: tokens computed (and cached) this step
    block_size: int,
    max_num_blocks: int | None = None,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """Everything one step's attention needs, from the block manager's view of the batch.

    This is the model runner's job in vLLM (`GPUModelRunner._prepare_inputs`): new tokens
    of all requests are laid out back to back; request i's new tokens sit at positions
    num_computed[i] ... num_computed[i] + num_new[i] - 1.
    """
    n = len(block_ids)
    if not (len(num_computed_tokens) == len(num_new_tokens) == n):
        raise ValueError("block_ids, num_computed_tokens and num_new_tokens need one entry per request")
    for i in range(n):
        if num_computed_tokens[i] < 0 or num_new_tokens[i] < 0:
            raise ValueError(f"request {i}: token counts must be >= 0")
        if num_computed_tokens[i] + num_new_tokens[i] > len(block_ids[i]) * block_size:
            raise ValueError(f"request {i} needs {num_computed_tokens[i] + num_new_tokens[i]} slots but holds "
                             f"{len(block_ids[i])} blocks of {block_size}")
    block_tables = make_block_tables(block_ids, max_num_blocks)
    new = torch.tensor(list(num_new_tokens), dtype=torch.int64)
    computed = torch.tensor(list(num_computed_tokens), dtype=torch.int64)
    ### BEGIN SOLUTION
    req_indices = torch.repeat_interleave(torch.arange(n), new)                      # [num_tokens]
    query_start_loc = torch.zeros(n + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(new, 0)
    positions = computed[req_indices] + torch.arange(int(new.sum())) - query_start_loc[req_indices]
    ### END SOLUTION
    num_blocks_per_req = torch.tensor([len(ids) for ids in block_ids], dtype=torch.int64)
    slot_mapping = compute_slot_mapping(block_tables, req_indices, positions, block_size,
                                        num_blocks_per_req=num_blocks_per_req)
    seq_lens = computed + new
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        max_query_len=int(new.max()) if n else 0,
        max_seq_len=int(seq_lens.max()) if n else 0,
    )
