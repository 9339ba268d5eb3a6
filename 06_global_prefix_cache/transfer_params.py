"""kv_transfer_params: what a request carries from one engine to another, checked at the door.

In vLLM the prefill engine returns them with its RequestOutput and a proxy copies them into
the decode engine's request (`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/
mooncake_connector.py` reads `do_remote_prefill`, the remote address and request id). They
cross process boundaries and pass through user code, so nothing in them is trusted:
`parse_kv_transfer_params` checks every field's type and range when the request is added
(where vLLM's `Processor` checks a request), and returns the canonical form that the
connector later reads as is — nothing from a remote party is parsed inside `schedule()`.

What ties loaded K/V to a request is not the request id in them but `block_hashes`: the
chained hashes (chapter 02, seeded with the model's identity, `NodeSpec.root_hash`) of the
tokens whose K/V the prefill node staged, one per block, the last one over a partial block.
The decode node loads only the blocks whose hashes equal those of its own tokens — another
prompt's params load nothing, or just the prefix the two prompts share — and compares the
hashes that come back with the bytes before any loaded block counts as computed.
"""
from __future__ import annotations

from typing import Any, Sequence

from global_prefix_cache.kv_layout import NodeSpec
from global_prefix_cache.rpc import parse_address
from paged_attention import cdiv

# Every key a request may carry, and its type. A prefill request sends {"do_remote_decode": True};
# the decode request sends back what the prefill engine returned (do_remote_prefill and the rest).
FLAGS = ("do_remote_decode", "do_remote_prefill")
REMOTE_PREFILL_KEYS = ("remote_sessions", "remote_request_id", "num_tokens", "spec", "block_hashes")
HASH_HEX_DIGITS = 64          # sha256


def encode_hashes(hashes: Sequence[int]) -> list[str]:
    """Block hashes as fixed-width hex strings: JSON-safe (a 256-bit int is not, in most languages)."""
    return [f"{h:0{HASH_HEX_DIGITS}x}" for h in hashes]


def decode_hashes(encoded: Any, what: str = "block_hashes") -> list[int]:
    if not isinstance(encoded, list):
        raise ValueError(f"{what} must be a list of hex strings, got {type(encoded).__name__}")
    hashes = []
    for i, h in enumerate(encoded):
        if not isinstance(h, str) or len(h) != HASH_HEX_DIGITS:
            raise ValueError(f"{what}[{i}] must be a {HASH_HEX_DIGITS}-digit hex string, got {h!r}")
        try:
            hashes.append(int(h, 16))
        except ValueError:
            raise ValueError(f"{what}[{i}] is not hexadecimal: {h!r}") from None
    return hashes


def parse_kv_transfer_params(params: Any) -> dict | None:
    """The canonical form of a request's kv_transfer_params, or ValueError naming the field.

    {} and None mean "nothing remote". Flags are bools; with do_remote_prefill every remote key
    is required: remote_sessions one "host:port" per rank of the prefill node (rank r's side
    channel, in rank order), remote_request_id a non-empty str, num_tokens an int >= 1, spec a
    NodeSpec dict, block_hashes one hex hash per block of num_tokens tokens.
    Unknown keys are refused (a misspelt flag would otherwise silently do nothing)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    unknown = sorted(set(params) - set(FLAGS) - set(REMOTE_PREFILL_KEYS), key=str)
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown keys {unknown}; known: {list(FLAGS + REMOTE_PREFILL_KEYS)}")
    for flag in FLAGS:
        if flag in params and not isinstance(params[flag], bool):
            raise ValueError(f"kv_transfer_params[{flag!r}] must be True or False, got {params[flag]!r}")
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    if decode and prefill:
        raise ValueError("kv_transfer_params: a request is prefilled elsewhere (do_remote_prefill) or decoded "
                         "elsewhere (do_remote_decode), not both")
    given = [k for k in REMOTE_PREFILL_KEYS if k in params]
    if not prefill:
        if given:
            raise ValueError(f"kv_transfer_params: {given} only go with do_remote_prefill=True")
        return {"do_remote_decode": True} if decode else None
    missing = [k for k in REMOTE_PREFILL_KEYS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill needs {missing} "
                         "(pass the prefill engine's returned kv_transfer_params unchanged)")
    sessions, rid, num_tokens = params["remote_sessions"], params["remote_request_id"], params["num_tokens"]
    if not isinstance(sessions, list) or not sessions or not all(isinstance(s, str) for s in sessions):
        raise ValueError(f"kv_transfer_params['remote_sessions'] must be a list of 'host:port', got {sessions!r}")
    for session in sessions:
        parse_address(session)
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"kv_transfer_params['remote_request_id'] must be a non-empty str, got {rid!r}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"kv_transfer_params['num_tokens'] must be an int >= 1, got {num_tokens!r}")
    spec = NodeSpec.from_dict(params["spec"], "kv_transfer_params['spec']")
    if len(sessions) != spec.world_size:
        raise ValueError(f"kv_transfer_params['remote_sessions'] has {len(sessions)} addresses for a prefill node "
                         f"of {spec.world_size} ranks (tp_size {spec.tp_size} x pp_size {spec.pp_size})")
    hashes = decode_hashes(params["block_hashes"], "kv_transfer_params['block_hashes']")
    num_blocks = cdiv(num_tokens, spec.block_size)
    if len(hashes) != num_blocks:
        raise ValueError(f"kv_transfer_params['block_hashes'] has {len(hashes)} hashes; {num_tokens} tokens in "
                         f"blocks of {spec.block_size} need {num_blocks}")
    return {"do_remote_prefill": True, "remote_sessions": list(sessions), "remote_request_id": rid,
            "num_tokens": num_tokens, "spec": spec.as_dict(), "block_hashes": encode_hashes(hashes)}


def check_kv_transfer_params(params: Any, config) -> dict | None:
    """What any front end can check without the connector: the canonical form
    (`parse_kv_transfer_params`) and that this node's role (`config`, a KVTransferConfig) can do what
    the params ask. Whether a prefill node's K/V fits this node (model, layout) is the connector's
    to say (`ConnectorScheduler.validate_kv_transfer_params`), where it runs."""
    parsed = parse_kv_transfer_params(params)
    if parsed is None:
        return None
    if parsed.get("do_remote_decode"):
        config.require("save")
    if parsed.get("do_remote_prefill"):
        config.require("load")
    return parsed
