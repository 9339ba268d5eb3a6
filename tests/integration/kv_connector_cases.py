"""The engine-level cases both layers must pass (test_kv_connector_scratch.py, test_kv_connector_mooncake.py):
a prefill ENGINE PROCESS (SmolLM2, kv_producer) and a decode / consumer engine in the test
process (kv_consumer, registered: every block free after every test), plus a reference engine
that computes everything itself."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mini_vllm.engine_process import run_requests

BLOCK = 16
# Small KV caches and pool segments: SmolLM2's K/V is 46,080 B/token (737,280 B per 16-token block).
ENGINE_KW = dict(max_model_len=512, kv_cache_memory=48 << 20, max_num_seqs=8)
SYSTEM_TEXT = ("You are a careful assistant for a museum of natural history. Answer visitors' questions "
               "about dinosaurs, fossils, minerals and meteorites in two or three short sentences, and "
               "say plainly when something is not known.")


class Prompts:
    """Chat-formatted SmolLM2 prompts; `system(i)` differs from `system(j)` in its first block,
    so every test gets a system prompt that no engine has seen (no accidental hits)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def chat(self, system: str, question: str) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": question}],
                                                  tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @staticmethod
    def system(i: int) -> str:
        return f"Session {i}. " + SYSTEM_TEXT

    def shared_prefix(self, a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n


@dataclass
class Cluster:
    layer: str
    server: Any                 # MetadataServerProcess | MooncakeMaster
    prefill: Any                # EngineProcess (kv_producer)
    decode: Any                 # LLMEngine in this process (kv_consumer)

    @property
    def connector(self):
        """The decode engine's scheduler-side connector."""
        return self.decode.engine_core.kv_connector


def start_cluster(layer, server, config, engine_registry, load_timeout_s=5.0) -> Cluster:
    """The prefill process loads while the decode engine is built here (2 cores, in parallel)."""
    import torch

    from mini_vllm.engine_process import EngineProcess
    from mini_vllm.llm_engine import LLMEngine

    prefill = EngineProcess(wait=False, kv_transfer_config=config("kv_producer"), num_threads=torch.get_num_threads(),
                            **ENGINE_KW)
    try:
        decode = LLMEngine(kv_transfer_config=config("kv_consumer", load_timeout_s=load_timeout_s), **ENGINE_KW)
        engine_registry.append(decode)
        prefill.wait_ready()
    except BaseException:
        prefill.close()
        raise
    return Cluster(layer, server, prefill, decode)


def stop_cluster(cluster: Cluster, engine_registry) -> None:
    cluster.prefill.close()
    engine_registry.remove(cluster.decode)
    cluster.decode.shutdown()


def on_decode(cluster, rid, prompt, max_tokens, params=None, on_step=None, timeout=60.0) -> dict:
    result, = run_requests(cluster.decode, [{"request_id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens,
                                             "kv_transfer_params": params}], timeout=timeout, on_step=on_step)
    return result


def on_prefill(cluster, rid, prompt, max_tokens=1, params=None) -> dict:
    result, = cluster.prefill.generate([{"request_id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens,
                                         "kv_transfer_params": params}])
    return result


def first_running(result) -> tuple:
    return next(t for t in result["trace"] if t[0] == "RUNNING")


# ---------------------------------------------------------------- the cases
def disaggregation_thesis_state(cluster, prompts, reference):
    """Table 4.1: the decode engine starts at num_computed_tokens = L_prompt with the prefill
    node's first token as its last prompt token, computes ONE token, and the two engines'
    greedy tokens are one engine's, token for token."""
    prompt = prompts.chat(prompts.system(100), "Name three minerals found in meteorites.")
    L = len(prompt)
    rp = on_prefill(cluster, "req", prompt, max_tokens=1, params={"do_remote_decode": True})
    params = rp["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["num_tokens"] == L
    rd = on_decode(cluster, "req", prompt + rp["token_ids"], 9, params)
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", L, 0)
    assert first_running(rd) == ("RUNNING", L + 1, 1)          # only the first token is computed here
    assert rd["external_tokens"] == L and not rd["failed_load"] and rd["num_cached_tokens"] == L
    assert rp["token_ids"] + rd["token_ids"] == reference(prompt, 10)
    stats = cluster.prefill.check()
    assert stats["connector"]["pushed_blocks"] == math.ceil(L / BLOCK) and stats["free_blocks"] == stats["num_blocks"]


def disaggregation_vllm_form(cluster, prompts, reference):
    """vLLM's form: the decode request carries the ORIGINAL prompt; L_prompt - 1 tokens are
    loaded and the last prompt token is recomputed to get the first token's logits."""
    prompt = prompts.chat(prompts.system(101), "What is a trilobite?")
    L = len(prompt)
    rp = on_prefill(cluster, "req2", prompt, max_tokens=1, params={"do_remote_decode": True})
    rd = on_decode(cluster, "req2", prompt, 8, rp["kv_transfer_params"])
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", L - 1, 0) and first_running(rd) == ("RUNNING", L, 1)
    assert rd["token_ids"][0] == rp["token_ids"][0]
    assert rd["token_ids"] == reference(prompt, 8)
    cluster.prefill.check()


def shared_pool(cluster, prompts, reference):
    """Two engines, one system prompt: the second engine loads its full blocks from the pool and
    computes only the rest; same tokens as recomputing; hit rate counted."""
    system = prompts.system(102)
    first = prompts.chat(system, "How do fossils form?")
    second = prompts.chat(system, "Which dinosaurs could fly?")
    on_prefill(cluster, "user-1", first, max_tokens=2)                 # publishes its full blocks
    shared = prompts.shared_prefix(first, second)
    hit = shared // BLOCK * BLOCK
    assert hit >= 3 * BLOCK
    before = cluster.decode.engine_core.kv_connector_stats()["connector"]
    rd = on_decode(cluster, "user-2", second, 8)
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", hit, 0)
    assert first_running(rd)[2] == len(second) - hit                    # the prefill it skipped
    assert rd["external_tokens"] == hit and rd["num_cached_tokens"] == hit
    assert rd["token_ids"] == reference(second, 8)
    stats = cluster.decode.engine_core.kv_connector_stats()["connector"]
    assert stats["hit_blocks"] - before["hit_blocks"] == hit // BLOCK
    assert stats["loaded_tokens"] - before["loaded_tokens"] == hit
    cluster.prefill.check()


def assert_recomputed(result, reason, prompt, reference, max_tokens):
    """The load failed for `reason`, the request computed its whole prompt here, the tokens are
    the reference's — and (the autouse fixture) no block of the decode engine is left held."""
    assert result["failed_load"].startswith(reason), result["failed_load"]
    assert result["external_tokens"] == 0
    # It waited for its K/V — unless the load failed within the step that started it (an idle
    # engine waits for its loads inside the step), which sends it straight back to WAITING.
    assert result["trace"][0][0] in ("WAITING_FOR_REMOTE_KVS", "WAITING")
    assert first_running(result)[2] == len(prompt)                      # Δ = everything: no hit kept
    assert result["token_ids"] == reference(prompt, max_tokens)


def publish(cluster, prompts, index: int) -> list[int]:
    """The prefill engine serves a user with a fresh system prompt (publishing its blocks);
    returns another user's prompt that would hit those blocks."""
    system = prompts.system(index)
    on_prefill(cluster, f"pub{index}", prompts.chat(system, "What is a fossil?"))
    return prompts.chat(system, "Where are meteorites found?")
