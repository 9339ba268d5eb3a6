"""The names a client may put in `model`: the base model's, and one per LoRA adapter (chapter 09).

Mirrors vLLM's `vllm/entrypoints/openai/serving_models.py: OpenAIServingModels` — `--lora-modules
name=path` served from the start, `show_available_models` (adapters listed with the base model as
their `parent`), `load_lora_adapter` / `unload_lora_adapter` behind POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, which exist only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's
switch: loading code from a path the client names is the operator's decision), with vLLM's
messages and statuses (400 for a bad or duplicate adapter, 404 for an unknown one).

A completion whose `model` is an adapter's name runs with that adapter's LoRARequest; the
response names the adapter. Each adapter gets the next lora_int_id (1, 2, ...), never reused, so a
name loaded again after an unload is a new adapter to the engine and its prefix cache.
"""
from __future__ import annotations

import itertools
import os
from http import HTTPStatus

from mini_vllm.entrypoints.protocol import ModelCard, ModelList
from mini_vllm.entrypoints.serving_engine import OpenAIError
from mini_vllm.lora_request import LoRARequest

RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class OpenAIServingModels:
    def __init__(self, engine, base_model_names: list[str], lora_modules: list[tuple[str, str]] | None = None):
        """lora_modules: (name, path) pairs served from the start (--lora-modules); a bad one raises."""
        self.engine = engine
        self.base_model_names = base_model_names
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = itertools.count(1)
        for name, path in lora_modules or ():
            self.load_lora_adapter(name, path)

    def lora_request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name nobody serves."""
        if model is None or model in self.base_model_names:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def model_name(self, lora_request: LoRARequest | None) -> str:
        return lora_request.lora_name if lora_request is not None else self.base_model_names[0]

    def show_available_models(self) -> ModelList:
        config = self.engine.model_config
        cards = [ModelCard(id=name, root=str(config.model), max_model_len=config.max_model_len)
                 for name in self.base_model_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.base_model_names[0])
                  for lora in self.lora_requests.values()]
        return ModelList(data=cards)

    def load_lora_adapter(self, lora_name: str | None, lora_path: str | None) -> str:
        if not lora_name or not lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if lora_name in self.lora_requests or lora_name in self.base_model_names:
            raise OpenAIError(f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name")
        lora_request = LoRARequest(lora_name, next(self._next_id), lora_path)
        try:
            self.engine.engine.add_lora(lora_request)
        except (ValueError, TypeError) as e:
            status = HTTPStatus.NOT_FOUND if "not found" in str(e) else HTTPStatus.BAD_REQUEST
            raise OpenAIError(str(e), status, "lora_path") from None
        self.lora_requests[lora_name] = lora_request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def unload_lora_adapter(self, lora_name: str | None) -> str:
        if not lora_name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        lora_request = self.lora_requests.get(lora_name)
        if lora_request is None:
            raise OpenAIError(f"The lora adapter '{lora_name}' cannot be found.", HTTPStatus.NOT_FOUND, "lora_name")
        try:
            self.engine.engine.remove_lora(lora_request.lora_int_id)
        except ValueError as e:                     # a running request still uses it
            raise OpenAIError(str(e), param="lora_name") from None
        del self.lora_requests[lora_name]
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
