"""Speculative decoding, the model runner's side: drafts in, verified tokens and the next drafts out.

Mirrors what vLLM v1's `GPUModelRunner` does with `self.drafter` (`vllm/v1/worker/gpu_model_runner.py`:
`_calc_spec_decode_metadata`, the rejection sampler in `_sample`, `propose_draft_token_ids`; the
proposers in `vllm/v1/spec_decode/`). `SpecDecodeWorker` (spec_decode_worker.py) owns the drafter
and the rejection sampler; this mixin is where the runner's step meets them:

  * the step's drafts (SchedulerOutput.scheduled_spec_decode_tokens) are written into each request's
    batch row after its last verified token, so the flat batch carries them as ordinary tokens;
  * a step with drafts computes logits at every draft position plus one (SpecDecodeMetadata), samples
    the bonus rows with the engine's Sampler and verifies the drafts with the rejection sampler;
  * after sampling, the drafter proposes the next step's drafts; they leave the runner in
    `ModelRunnerOutput.draft_token_ids` and the engine core hands them to the scheduler.

Every tensor-parallel rank runs the same drafter on the same inputs (its collectives in lockstep with
the other ranks'), so every rank proposes the same drafts; with pipeline parallelism the last stage,
which samples, proposes. A rank or stage without the drafter still writes the drafts into its rows:
they are scheduled tokens like any other.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kernels_cpu import attention as cpu_attention
from spec_decode.eagle_tree import DraftTree
from spec_decode.tree import TreeAttentionMetadata, accepted_kv_slot_moves, tree_attention_mask, tree_depths

from mini_vllm.async_output import PLACEHOLDER_TOKEN_ID
from mini_vllm.structured_output_backend import apply_grammar_bitmask
from mini_vllm.logits_processors import apply_logits_processors
from mini_vllm.model_inputs import ModelInputs
from mini_vllm.models.attention import ATTENTION_BACKENDS
from mini_vllm.sampler import NONFINITE_LOGITS, SamplingMetadata, compute_logprobs, nonfinite_rows
from mini_vllm.spec_decode_worker import SpecDecodeWorker


class SpecDecodeMixin:
    """For ModelRunner (reads `self.input_batch`, `self.model`, `self.sampler`)."""

    spec_decode: SpecDecodeWorker | None = None

    def _init_spec_decode(self, config, model_config) -> None:
        # Async scheduling (async_scheduler.py): a step is scheduled with k placeholder drafts before
        # the drafts are proposed, and on counters that assume every draft of the step in flight is
        # accepted. The runner, which ran that step, knows better: it puts in its own proposals
        # (`_proposed`), runs only the tokens it has, and moves each request back by the drafts the
        # scheduler does not know were rejected (`_rejected_view`, from the step before).
        self._proposed: dict[str, list[int]] = {}         # the last step's proposals, by request
        self._draft_slots: dict[str, int] = {}            # this step: placeholder drafts scheduled
        self._unused_slots: dict[str, int] = {}           # this step: ... of which no proposal filled
        self._rejected_view: dict[str, int] = {}          # the last step: slots - accepted drafts
        # EAGLE-2: this step's trees (the drafts of these requests are tree nodes, not a chain) and,
        # once verified, the nodes each accepted.
        self._step_trees: dict[str, DraftTree] = {}
        self._tree_accepted: dict[str, list[int]] = {}
        self.num_tree_kv_moves = 0                         # K/V slots moved so far (accepted non-first siblings)
        if config.speculative_config is None or not self.samples:
            return                              # (a pipeline stage that does not sample never proposes)
        self.spec_decode = SpecDecodeWorker(
            config.speculative_config, model_config, self.model, device=self.device, block_size=self.block_size,
            attn_backend=self.attn_backend, cpu_gemm_backend=config.cpu_gemm_backend,
            cpu_layer_ops=config.cpu_layer_ops, cuda_layer_ops=config.cuda_layer_ops,
            generator=self.sampler.generator, tokenizer_path=config.tokenizer)

    # ---- the step's drafts into the batch --------------------------------------------------------
    def _write_draft_token_ids(self, so, failed: dict[str, str]) -> None:
        """This step's drafts into their requests' rows (none left over from the last step); the
        drafter forgets finished requests and drops the draft KV of preempted ones."""
        batch = self.input_batch
        batch.num_draft_tokens[:len(batch.req_ids)] = 0
        if self.spec_decode is not None:
            self.spec_decode.remove_requests(so.finished_req_ids)
            self.spec_decode.preempt_requests(so.preempted_req_ids)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._proposed.pop(req_id, None)
        corrections, self._rejected_view = self._rejected_view, {}
        self._draft_slots, self._unused_slots = {}, {}
        self._step_trees, self._tree_accepted = {}, {}
        for req_id, fix in corrections.items():          # async: drafts rejected in the step before
            row = batch.req_id_to_index.get(req_id)
            if row is not None and fix:
                batch.num_computed_tokens[row] -= fix
                self.requests[req_id].num_computed_tokens -= fix
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue                                 # failed above
            if drafts and drafts[0] == PLACEHOLDER_TOKEN_ID:     # async: this runner's own proposals
                self._draft_slots[req_id] = len(drafts)
                drafts = self._proposed.get(req_id, [])[:len(drafts)]
                self._unused_slots[req_id] = self._draft_slots[req_id] - len(drafts)
            try:
                batch.set_draft_token_ids(row, drafts)
            except Exception as error:    # noqa: BLE001
                failed[req_id] = self._state_error(req_id, error)
                continue
            tree = self.spec_decode.tree_for(req_id, drafts) if self.spec_decode is not None else None
            if tree is not None:
                self._step_trees[req_id] = tree

    def _with_tree_layout(self, inputs: ModelInputs, rows: np.ndarray) -> ModelInputs | None:
        """A step that verifies EAGLE-2 trees (None if none of `rows` has one). Node i of a tree
        is laid out in the slot a chain's i-th draft would take (the slot mapping is unchanged),
        but at position root + depth(i), and it sees the context and its own ancestors only —
        chapter 04's tree mask over the request's new tokens; the attention op reads the masks
        (models/attention.py: the CPU kernel, packed once here, or chapter 04's tree attention)."""
        batch = self.input_batch
        starts = inputs.attn_metadata.query_start_loc.tolist()
        positions, masks = inputs.positions, []
        for j, i in enumerate(rows.tolist()):
            tree = self._step_trees.get(batch.req_ids[i])
            if tree is None or len(tree.tokens) != int(batch.num_draft_tokens[i]):
                masks.append(None)                                   # causal, as without trees
                continue
            if positions is inputs.positions:
                positions = positions.clone()
            q = starts[j + 1] - starts[j]
            root = starts[j + 1] - len(tree.tokens) - 1              # the last verified token's row
            depth = torch.tensor(tree_depths(tree.parents)[1:], dtype=positions.dtype, device=positions.device)
            positions[root + 1:starts[j + 1]] = positions[root] + depth
            mask = torch.ones(q, q, dtype=torch.bool).tril()
            mask[root - starts[j]:, root - starts[j]:] = tree_attention_mask(tree.parents)
            masks.append(mask)
        if positions is inputs.positions:
            return None
        md = inputs.attn_metadata
        md = TreeAttentionMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)},
                                   tree_masks=tuple(masks))
        if ATTENTION_BACKENDS[self.attn_backend][1] == "cpu":       # the kernel's masks, packed once per step
            md = dataclasses.replace(md, plan=cpu_attention.pack_tree_masks(masks, md.query_start_loc))
        return dataclasses.replace(inputs, positions=positions, attn_metadata=md)

    # ---- verification ----------------------------------------------------------------------------
    def _sample_with_drafts(self, hidden: torch.Tensor, inputs: ModelInputs, sample_rows: np.ndarray, output) -> None:
        """A speculative engine's sampling (vLLM: GPUModelRunner._sample with spec_decode_metadata).

        A sampling row with k drafts owns its last k + 1 positions: logits at all of them
        (`SpecDecodeMetadata.logits_indices`); the Sampler draws the bonus token of every row
        from its last one (for rows without drafts that is simply its token), then the rejection
        sampler verifies the drafts against the others. Rows without drafts cost what `_sample`
        costs."""
        batch = self.input_batch
        if len(sample_rows) == 0:
            return
        num_draft = batch.num_draft_tokens[sample_rows]                                 # [b]
        if not num_draft.any():
            self._sample(hidden, inputs.logits_indices, sample_rows, output)
            return
        worker = self.spec_decode
        md = worker.metadata(num_draft, inputs.logits_indices, inputs.input_ids)
        logits = self.model.compute_logits(hidden[md.logits_indices.long()])           # [n + b, V] fp32
        # A request with a non-finite logits row anywhere fails alone (before any random draw).
        bad_row = nonfinite_rows(logits).cpu().numpy()                                  # [n + b]
        bad = np.add.reduceat(bad_row, np.concatenate(([0], np.cumsum(num_draft + 1)[:-1]))) > 0   # [b]
        if bad.any():
            for i in sample_rows[bad]:
                output.failed[batch.req_ids[i]] = NONFINITE_LOGITS
            keep = np.repeat(~bad, num_draft + 1)
            sample_rows, num_draft = sample_rows[~bad], num_draft[~bad]
            if len(sample_rows) == 0:
                return
            logits = logits[torch.from_numpy(keep).to(logits.device)]
            md = worker.metadata(num_draft, inputs.logits_indices[torch.from_numpy(~bad)], inputs.input_ids)
        apply_grammar_bitmask(self._grammar_output, [batch.req_ids[i] for i in sample_rows], (num_draft + 1).tolist(),
                              logits, output.failed)                                   # structured output
        sm = self._sampling_metadata_for(sample_rows)
        raw_logits = logits
        if sm.logits_processors is not None:
            logits, sm = self._process_draft_rows(logits, sm, sample_rows, num_draft)
        bonus = self.sampler(logits[md.bonus_logits_indices.long()], sm)                # [b]: the normal sampler
        emitted = worker.verify(md, logits, bonus.sampled_token_ids, sm)                # b lists of 1..k+1 tokens
        trees = {j: tree for j, i in enumerate(sample_rows.tolist())
                 if (tree := self._step_trees.get(batch.req_ids[i])) is not None and num_draft[j] == len(tree.tokens)}
        paths = {}
        if trees:                                          # EAGLE-2: these requests verify a tree, not a chain
            accepted = worker.verify_trees(md, logits, sm, trees, emitted)
            paths = {j: [0] + nodes for j, nodes in accepted.items()}
            self._move_accepted_tree_kv(sample_rows, accepted)
        logprobs = self._emitted_logprobs(raw_logits, md, emitted, sample_rows, sm.max_num_logprobs, paths)
        for i, k, tokens in zip(sample_rows.tolist(), num_draft.tolist(), emitted):
            if k:
                worker.observe_verified(batch.req_ids[i], k, len(tokens) - 1)
        self._append_emitted(sample_rows, emitted, logprobs, output)

    def _move_accepted_tree_kv(self, sample_rows: np.ndarray, accepted: dict[int, list[int]]) -> None:
        """After tree verification: the accepted nodes' K/V, written in their tree slots, copied in
        every layer to the slots a chain would have used (chapter 04's accepted_kv_slot_moves) —
        the cache then holds exactly the accepted sequence, and the scheduler's two counters
        (num_computed_tokens += 1 + accepted) stay true."""
        batch, src, dst = self.input_batch, [], []
        for j, nodes in accepted.items():
            i = int(sample_rows[j])
            self._tree_accepted[batch.req_ids[i]] = nodes
            root = int(batch.num_tokens[i]) - 1                  # the last verified token's position
            blocks = batch.block_table[i, :batch.num_blocks[i]].tolist()
            s, d = accepted_kv_slot_moves(nodes, root, blocks, self.block_size)
            src += s
            dst += d
        if not src:
            return
        self.num_tree_kv_moves += len(src)
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            for cache in (key_cache, value_cache):
                flat = cache.view(-1, *cache.shape[2:])          # [num_blocks * block_size, kv_heads, head_dim]
                flat[dst_t] = flat[src_t]

    def _process_draft_rows(self, logits: torch.Tensor, sm: SamplingMetadata, rows: np.ndarray,
                            num_draft: np.ndarray) -> tuple[torch.Tensor, SamplingMetadata]:
        """Penalties & co. on a speculative step's logits [n + b, V]: the row at draft position j
        of a request sees its output plus its first j drafts — the output it will have if those
        drafts are accepted, which is exactly when that row's distribution is used (vLLM:
        apply_all_penalties / apply_bad_words_with_drafts with the spec tokens). Returns the
        processed logits and the metadata without processors (they have been applied)."""
        per_request = num_draft + 1                                                     # [b] logits rows each
        req_rows = np.repeat(np.arange(len(rows)), per_request)                         # [n + b]
        position = np.arange(len(req_rows)) - np.repeat(np.cumsum(per_request) - per_request, per_request)
        outputs = None
        if sm.logits_processors.needs_output_tokens:
            outputs = self.input_batch.output_tokens(rows[req_rows], extra=position, device=self.device)
        processed = apply_logits_processors(logits, sm.logits_processors,
                                            torch.from_numpy(req_rows).to(logits.device), outputs)
        return processed, dataclasses.replace(sm, logits_processors=None)

    def _emitted_logprobs(self, logits: torch.Tensor, md, emitted: list[list[int]], rows: np.ndarray,
                          num_logprobs: int | None, paths: dict[int, list[int]] | None = None
                          ) -> dict[str, list[tuple[list[int], list[float], int]]]:
        """Logprobs of every emitted token, from the logits row that produced it: the j-th
        emitted token of a request came from its j-th sampled position (accepted drafts, then
        the recovered or bonus token), so they are the logprobs plain decoding would report.
        A tree's (paths[b]: the root, 0, then its accepted nodes) came from the rows of its path."""
        if num_logprobs is None:
            return {}
        batch = self.input_batch
        paths = paths or {}
        starts = (md.cu_num_sampled_tokens.long() - torch.tensor(md.num_draft_tokens) - 1).tolist()   # [b]
        index = [s + (paths[b][j] if b in paths else j)
                 for b, (s, tokens) in enumerate(zip(starts, emitted)) for j in range(len(tokens))]
        flat = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device)
        lp = compute_logprobs(logits[torch.tensor(index, device=logits.device)], flat, num_logprobs,
                              as_logits=self.sampler.logprobs_mode == "raw_logits")
        ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.selected_token_ranks.tolist()
        out, pos = {}, 0
        for i, tokens in zip(rows.tolist(), emitted):
            k = batch.states[i].sampling_params.logprobs
            if k is not None:
                out[batch.req_ids[i]] = [(ids[p][:k + 1], values[p][:k + 1], ranks[p])
                                         for p in range(pos, pos + len(tokens))]
            pos += len(tokens)
        return out

    def _append_emitted(self, rows: np.ndarray, emitted: list[list[int]], logprobs: dict, output) -> None:
        """Append each request's emitted tokens (1..k+1 with drafts; they overwrite the drafts in the
        batch row)."""
        batch = self.input_batch
        for i, tokens in zip(rows.tolist(), emitted):
            output.sampled_token_ids[i].extend(tokens)
            batch.states[i].output_token_ids.extend(tokens)
            for token in tokens:
                batch.append_token(i, token)
        output.logprobs.update(logprobs)

    # ---- the next step's drafts --------------------------------------------------------------------
    def _keep_hidden_for_drafter(self, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray,
                                 output) -> None:
        """EAGLE drafts from the target's hidden states: hand it those of every position whose
        K/V this step computed AND kept — a prefill chunk's tokens, or a decode's last token
        plus its accepted drafts (rejected drafts' states are of an abandoned sequence)."""
        worker = self.spec_decode
        if worker is None or not worker.needs_hidden_states:
            return
        batch = self.input_batch
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        for i, start, n in zip(rows.tolist(), starts.tolist(), num_scheduled.tolist()):
            req_id = batch.req_ids[i]
            if req_id in output.failed:
                continue
            emitted = output.sampled_token_ids[i]
            nodes = self._tree_accepted.get(req_id)
            if nodes is not None:        # a tree: the rows before its nodes, then its accepted nodes'
                base = n - int(batch.num_draft_tokens[i])
                index = list(range(start, start + base)) + [start + base - 1 + a for a in nodes]
                worker.observe_hidden(req_id, int(batch.num_computed_tokens[i]), hidden[index])
                continue
            kept = n - int(batch.num_draft_tokens[i]) + len(emitted) - 1 if emitted else n
            worker.observe_hidden(req_id, int(batch.num_computed_tokens[i]), hidden[start:start + kept])

    def _propose_draft_token_ids(self, output) -> None:
        """After sampling, the drafter guesses the next step's tokens of every request that just
        emitted some (vLLM: propose_draft_token_ids); they leave in the output for the scheduler."""
        worker = self.spec_decode
        if worker is None:
            return
        batch = self.input_batch
        emitted = dict(zip(output.req_ids, output.sampled_token_ids))
        self._rejected_view = {req_id: slots - (len(emitted[req_id]) - 1)
                               for req_id, slots in self._draft_slots.items() if emitted.get(req_id)}
        rows = [i for i, tokens in enumerate(output.sampled_token_ids)
                if tokens and batch.req_ids[i] not in output.failed]
        worker.propose(batch, rows)
        output.draft_token_ids = worker.take_draft_token_ids()
        # Async: a request's proposals stay good until it runs again (a step may pass it over).
        for i in rows:
            self._proposed.pop(batch.req_ids[i], None)
        self._proposed.update(output.draft_token_ids)
        output.spec_decode = worker.end_step()
