"""The model runner's LoRA half (vLLM: `vllm/v1/worker/lora_model_runner_mixin.py: LoRAModelRunnerMixin`).

With `enable_lora`, chapter 09 wraps the model's qkv / o / gate_up / down layers once, after loading
(`apply_lora`: each layer's linear method adds its LoRA part), and gives the runner an adapter
manager with `max_loras` device slots. Then, every step:

    _load_loras(so, failed)          the adapters of requests new this step, loaded from their PEFT
                                     directories into the host cache; a request whose adapter does not
                                     load fails alone, with the loader's message (the batch goes on)
    _set_active_loras(rows, n)       before the forward: the rows' adapters into slots (evicting the
                                     least recently used adapter no row needs), then one slot per token,
                                     laid out as the step's tokens are (row after row, n[j] tokens each)
    the forward                      every wrapped layer adds (x A^T) B^T of its token's slot, all
                                     adapters of the batch in one shrink and one expand (chapter 09's ops)
    _clear_active_loras()            after it: anything else that runs the target's layers (the
                                     layer-skip drafter) runs the base model

The scheduler has already kept the batch to at most `max_loras` adapters (lora_scheduler.py), so
the slots always suffice. A request without an adapter maps to no slot: the base model, exactly.

What the runner knows of a request's adapter arrives once, in its NewRequestData (`lora_request`),
and is kept here by request id until the request finishes. Each rank does the same with its shard
of the adapter (tensor parallel) or its layers (pipeline parallel), reaching the same verdict on a
bad adapter because every rank checks the whole file (chapter 09's `checkpoint_targets`).

Drafts (chapter 04) are proposed by the base model; verification runs each request's adapter, so the
output is the adapter's exactly (a draft the adapter would not produce is rejected, as any other).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from scheduler import SchedulerOutput


def lora_backend(config) -> str:
    """Which of chapter 09's op backends the layers use: Triton on a GPU (vLLM's punica_gpu), on a
    CPU the C++ kernels when they build here and cpu_kernels allows them, else batched torch."""
    if config.resolved_device.type == "cuda":
        return "triton"
    if config.cpu_kernels != "off" and importlib.import_module("lora.cpu_ops").is_available():
        return "cpu"
    return "torch"


class LoRAModelRunnerMixin:
    lora_manager = None                  # chapter 09's LoRAAdapterManager, with enable_lora
    lora_mapping = None                  # chapter 09's LoRAMapping: the step's token -> slot map

    def _init_lora(self, config) -> None:
        """After the model is loaded: wrap its layers and make the slots (vLLM: load_lora_model)."""
        self._lora_of: dict = {}                             # req_id -> its LoRARequest
        if not config.enable_lora:
            return
        manager_module = importlib.import_module("lora.adapter_manager")
        layers = importlib.import_module("lora.layers")
        self.lora_manager = manager_module.LoRAAdapterManager(self.model, config.max_loras, config.max_lora_rank,
                                                              config.max_cpu_loras)
        self.lora_mapping = layers.apply_lora(self.model, self.lora_manager, backend=lora_backend(config))

    def _require_lora(self, lora_request) -> None:
        if self.lora_manager is None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")    # vLLM's message

    # ---- every step ---------------------------------------------------------------------------------

    def _load_loras(self, so: SchedulerOutput, failed: dict[str, str]) -> None:
        """Note the adapter of each new request and load it if it is new here (or re-pointed to
        another path); a request whose adapter cannot be loaded leaves the batch and fails alone."""
        for req_id in so.finished_req_ids:
            self._lora_of.pop(req_id, None)
        dropped = False
        for new in so.scheduled_new_reqs:
            lora_request = getattr(new, "lora_request", None)
            if lora_request is None or new.req_id in failed:
                continue
            try:
                self._require_lora(lora_request)
                if self.lora_manager.path_of(lora_request.lora_int_id) != Path(lora_request.lora_path):
                    self.lora_manager.add_adapter(lora_request.lora_int_id, lora_request.lora_path)
            except (ValueError, OSError) as error:
                failed[new.req_id] = f"LoRA adapter {lora_request.lora_name!r} could not be loaded: {error}"
                self.input_batch.remove_request(new.req_id)
                dropped = True
                continue
            self._lora_of[new.req_id] = lora_request
        if dropped:
            self.input_batch.condense()

    def _set_active_loras(self, rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        """The rows' adapters into device slots, and each of the step's tokens mapped to its row's slot
        (vLLM: set_active_loras -> PunicaWrapper.update_metadata)."""
        if self.lora_mapping is None:
            return
        req_ids = self.input_batch.req_ids
        ids = [getattr(self._lora_of.get(req_ids[i]), "lora_int_id", None) for i in rows]
        if not any(ids):
            self.lora_mapping.set_token_lora(None)           # a base-model step: the layers skip LoRA
            return
        slot_of = self.lora_manager.activate_batch(ids)
        self.lora_mapping.set_requests([slot_of[a] for a in ids], num_scheduled.tolist(), self.device)

    def _clear_active_loras(self) -> None:
        if self.lora_mapping is not None:
            self.lora_mapping.set_token_lora(None)

