"""LoRARequest: which adapter a request runs with (vLLM: `vllm/lora/request.py: LoRARequest`).

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    sql = LoRARequest("sql", 1, "/adapters/sql")           # name, a positive id, a PEFT directory
    llm.generate(prompts, params, lora_request=sql)

The id is what the engine keys everything by: the adapter's device slot, the scheduler's count of
adapters per step (`max_loras`), and the prefix cache's block hash (two adapters never share K/V:
the same prompt gives different K/V under each, chapter 02's `generate_block_hash_extra_keys`). The
name is what the server's clients ask for (the request's `model`). One id means one adapter: the
engine refuses the same id with another name or path until it is removed (`remove_lora`).

Chapter 09 (`lora`) does the work: loading the PEFT directory, the slots, the batched ops. This
file is the message, plain data that crosses to the engine core's process and the workers'.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            # vLLM: "id must be > 0" -- 0 means "no adapter" in its token -> adapter maps
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRARegistry:
    """The front end's adapters: which LoRARequest each id (and each name) stands for, checked when it
    is first seen so that a bad adapter is refused before its request is queued (vLLM:
    `Processor._validate_lora`, `LLMEngine.add_lora / remove_lora / list_loras`).

    First sight reads the adapter's `adapter_config.json` (chapter 09's PEFTConfig: supported options,
    rank <= max_lora_rank) and checks that its weights file exists; the tensors themselves are read by
    the model runner, which fails the request alone if they do not fit the model. An id stands for one
    adapter until it is removed, and an adapter in use by a running request is never removed: a batch
    must not see two adapters under one id."""

    def __init__(self, enable_lora: bool, max_lora_rank: int):
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self.by_id: dict[int, LoRARequest] = {}

    def check(self, lora_request) -> LoRARequest | None:
        """`lora_request` validated and registered (None passes through); ValueError says what is wrong."""
        if lora_request is None:
            return None
        if not self.enable_lora:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")    # vLLM's message
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a mini_vllm.LoRARequest, got {type(lora_request).__name__}")
        known = self.by_id.get(lora_request.lora_int_id)
        if known == lora_request:
            return known
        if known is not None:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r} "
                             f"({known.lora_path}); remove_lora({known.lora_int_id}) first, or use another id")
        same_name = next((r for r in self.by_id.values() if r.lora_name == lora_request.lora_name), None)
        if same_name is not None:
            raise ValueError(f"an adapter named {lora_request.lora_name!r} is already lora_int_id "
                             f"{same_name.lora_int_id} ({same_name.lora_path})")
        self._check_directory(lora_request)
        self.by_id[lora_request.lora_int_id] = lora_request
        return lora_request

    def _check_directory(self, lora_request: LoRARequest) -> None:
        checkpoint = importlib.import_module("lora.peft_checkpoint")       # chapter 09, by name
        path = Path(lora_request.lora_path)
        config = path / checkpoint.CONFIG_FILE
        if not config.is_file():
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: {config} not found "
                             "(lora_path must be a PEFT adapter directory)")
        checkpoint.PEFTConfig.from_file(config, self.max_lora_rank)
        if not (path / checkpoint.WEIGHTS_FILE).is_file():
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: {path / checkpoint.WEIGHTS_FILE} not found")

    def remove(self, lora_int_id: int, in_use: bool) -> bool:
        """Forget an adapter (False: unknown). ValueError while a request still runs with it."""
        if lora_int_id not in self.by_id:
            return False
        if in_use:
            raise ValueError(f"LoRA adapter {self.by_id[lora_int_id].lora_name!r} (lora_int_id {lora_int_id}) is in "
                             "use by a running request: remove it once its requests finish")
        del self.by_id[lora_int_id]
        return True

    def get_by_name(self, name: str) -> LoRARequest | None:
        return next((r for r in self.by_id.values() if r.lora_name == name), None)
