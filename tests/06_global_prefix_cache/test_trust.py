"""Nothing that crosses a process boundary is trusted: K/V loaded from another node must be the
K/V of THIS request's tokens under THIS model, whatever the kv_transfer_params say.

Shadow of the truth: every KVNode computes the reference K/V of any prompt itself
(`FakeKVModel.reference_kv`), so a request whose blocks received another prompt's K/V is
caught slot by slot, not only by its tokens."""
import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from global_prefix_cache.node import KVNode
from global_prefix_cache.transfer_params import encode_hashes, parse_kv_transfer_params


@pytest.fixture
def disagg(metadata_service, pool_config):
    """(prefill node P: kv_producer, decode node D: kv_consumer), block size 4."""
    p = KVNode(pool_config(metadata_service.address, "kv_producer", save_to_pool=False, send_capacity_blocks=1024),
               shuffle_seed=5, node_id="P")
    d = KVNode(pool_config(metadata_service.address, "kv_consumer"), shuffle_seed=6, node_id="D")
    yield p, d
    p.close()
    d.close()


def stage(p: KVNode, rid: str, prompt: list[int]) -> dict:
    """The prefill node computes `prompt` and stages its K/V; returns the params it hands out."""
    params = p.run(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    assert params is not None, "nothing staged (send buffer full?)"
    return params


def assert_reference(d: KVNode, record, prompt: list[int]) -> None:
    assert torch.equal(record.kv, d.model.reference_kv(prompt)), "a slot holds K/V of other tokens"
    assert record.output_token_ids == KVNode(shuffle_seed=9).run("plain", prompt, len(record.output_token_ids)) \
        .output_token_ids


# ---------------------------------------------------------------- 1. another prompt's params
def test_params_of_another_prompt_load_only_the_prefix_the_prompts_share(disagg):
    p, d = disagg
    x = list(range(100, 130))                                   # 30 tokens staged
    y = x[:8] + list(range(500, 550))                           # shares 2 blocks of 4 with x, then differs
    params_x = stage(p, "x", x)
    ry = d.run("y", y, max_tokens=3, kv_transfer_params=params_x)
    assert ry.external_tokens == 8 and not ry.failed_load        # the shared blocks, nothing more
    assert_reference(d, ry, y)
    assert p.kv_stats["pushed_blocks"] == 2
    p.check_all_free()
    d.check_all_free()


def test_params_that_share_nothing_load_nothing(disagg):
    p, d = disagg
    x = list(range(100, 130))
    params_x = stage(p, "x", x)
    y = list(range(700, 760))
    ry = d.run("y", y, max_tokens=2, kv_transfer_params=params_x)
    assert ry.trace[0][0] == "RUNNING" and ry.external_tokens == 0
    assert_reference(d, ry, y)
    assert p.kv_stats["pushed_blocks"] == 0               # never asked
    # The wrong request consumed nothing: x's own decode request still gets all of x's K/V.
    rx = d.run("x", x, max_tokens=3, kv_transfer_params=params_x)
    assert rx.external_tokens == 29 and not rx.failed_load       # vLLM's form: the last token recomputed
    assert_reference(d, rx, x)
    d.check_all_free()


def test_forged_hashes_are_refused_by_the_producer(disagg):
    """Params whose hashes are y's but whose request id is x's (a confused proxy): the producer
    compares the hashes with what it staged and refuses before any byte moves."""
    p, d = disagg
    x, y = list(range(100, 130)), list(range(200, 230))
    params_x = stage(p, "x", x)
    params_y = stage(p, "y", y)
    forged = dict(params_y, remote_request_id="x")
    ry = d.run("y-forged", y, max_tokens=2, kv_transfer_params=forged)
    assert ry.failed_load.startswith("mismatch") and ry.external_tokens == 0
    assert_reference(d, ry, y)
    assert p.kv_stats["pushed_blocks"] == 0
    # x's staged K/V was not consumed by the refused pull.
    rx = d.run("x", x, max_tokens=2, kv_transfer_params=params_x)
    assert rx.external_tokens == 29
    assert_reference(d, rx, x)
    d.check_all_free()


def test_the_receiver_checks_the_hashes_that_come_back(disagg, monkeypatch):
    """A producer that does not check (another implementation, an older version) pushes x's
    K/V into y's blocks, honest about whose they are: the decode node compares the hashes in
    the reply with its own tokens' and recomputes — no pushed block counts as computed."""
    p, d = disagg
    x, y = list(range(100, 130)), list(range(200, 230))
    stage(p, "x", x)
    params_y = stage(p, "y", y)
    staged_x = p.worker_connector._staged["x"]
    serve = p.worker_connector._serve_pull

    def serve_without_checking(header, payload):
        return serve(dict(header, block_hashes=encode_hashes(staged_x.block_hashes)), payload)
    monkeypatch.setitem(p.worker_connector.side_channel.handlers, "pull_kv", serve_without_checking)
    ry = d.run("y-forged", y, max_tokens=2, kv_transfer_params=dict(params_y, remote_request_id="x"))
    assert p.kv_stats["pushed_blocks"] > 0                   # the bytes did arrive
    assert ry.failed_load.startswith("mismatch") and ry.external_tokens == 0
    assert_reference(d, ry, y)
    d.check_all_free()


# ---------------------------------------------------------------- 2. malformed params
def good_params(spec: dict) -> dict:
    return {"do_remote_prefill": True, "remote_sessions": ["127.0.0.1:5"], "remote_request_id": "r",
            "num_tokens": 6, "spec": spec, "block_hashes": ["ab" * 32] * 2}


BAD = [
    ({"num_tokens": "many"}, "num_tokens"),
    ({"num_tokens": None}, "num_tokens"),
    ({"num_tokens": 0}, "num_tokens"),
    ({"num_tokens": True}, "num_tokens"),
    ({"num_tokens": 9}, "block_hashes"),                 # 9 tokens need 3 hashes of blocks of 4
    ({"remote_sessions": 5}, "remote_sessions"),
    ({"remote_sessions": "127.0.0.1:5"}, "remote_sessions"),
    ({"remote_sessions": ["nohost"]}, "host:port"),
    ({"remote_sessions": ["127.0.0.1:5", "127.0.0.1:6"]}, "2 addresses for a prefill node of 1 ranks"),
    ({"remote_request_id": ""}, "remote_request_id"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"do_remote_decode": True}, "not both"),
    ({"block_hashes": "abc"}, "block_hashes"),
    ({"block_hashes": ["zz" * 32] * 2}, "not hexadecimal"),
    ({"block_hashes": [1, 2]}, "block_hashes"),
    ({"spec": {"model": "m"}}, "spec"),
    ({"spec": "fake-kv"}, "spec"),
    ({"do_remote_prefil": True}, "unknown keys"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[f"{next(iter(c))}={c[next(iter(c))]!r}"[:40] for c, _ in BAD])
def test_malformed_params_are_refused_in_add_request(metadata_service, pool_config, change, match):
    d = KVNode(pool_config(metadata_service.address, "kv_consumer"), node_id="D")
    try:
        params = dict(good_params(d.connector.spec.as_dict()), **change)
        spec_change = change.get("spec")
        if isinstance(spec_change, dict):
            params["spec"] = spec_change
        with pytest.raises(ValueError, match=match):
            d.add_request("bad", list(range(10)), 1, params)
        assert not d.scheduler.has_unfinished_requests()            # nothing queued, nothing changed
        assert d.run("good", list(range(10)), 2).output_token_ids   # and the node still serves
        d.check_all_free()
    finally:
        d.close()


def test_canonical_form_is_what_the_request_carries():
    spec = {"model": "m", "block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
            "tp_size": 1, "pp_size": 1}
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}) == {"do_remote_decode": True}
    params = good_params(spec)
    parsed = parse_kv_transfer_params(params)
    assert parsed == params and parsed is not params


# ---------------------------------------------------------------- 3. another model
def test_a_consumer_of_another_model_is_refused_when_it_joins(metadata_service, pool_config):
    a = KVNode(pool_config(metadata_service.address, "kv_producer"), node_id="A")
    try:
        with pytest.raises(ValueError, match="cannot join this pool.*model"):
            KVNode(pool_config(metadata_service.address, "kv_consumer", model="another-model"), node_id="B")
    finally:
        a.close()


def test_another_models_block_hashes_never_hit(metadata_service, pool_config, monkeypatch):
    """Even where the pool does not check (here: its join check switched off), the chains of
    two models never meet: the consumer of another model finds nothing and computes."""
    a = KVNode(pool_config(metadata_service.address, "kv_producer"), node_id="A")
    monkeypatch.setattr(metadata_service.server, "join", lambda node_id, spec: None)
    b = KVNode(pool_config(metadata_service.address, "kv_consumer", model="another-model"), node_id="B")
    try:
        prompt = list(range(300, 340))
        a.run("a", prompt)
        assert metadata_service.server.get_stats()["blocks"] == 10
        rb = b.run("b", prompt + [1], max_tokens=2)
        assert rb.external_tokens == 0 and b.kv_stats["hit_blocks"] == 0
        assert torch.equal(rb.kv, b.model.reference_kv(prompt + [1]))
        b.check_all_free()
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- property
REQUEST_NUMBERS = itertools.count()         # unique request ids across hypothesis examples


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(staged_len=st.integers(1, 26), shared=st.integers(0, 26), extra=st.integers(0, 10),
       forge=st.sampled_from(["none", "request_id", "model"]), seed=st.integers(0, 10**6))
def test_random_staged_and_decode_prompts_never_give_other_kv(disagg, staged_len, shared, extra, forge, seed):
    """Any (staged prompt, decode prompt, params): the decode request either is refused in
    add_request (another model's spec) or ends with the reference K/V in every slot and the
    plain node's tokens — never with K/V of other tokens."""
    p, d = disagg
    rng = random.Random(seed)
    x = [rng.randrange(1000) for _ in range(staged_len)]
    shared = min(shared, staged_len)
    y = x[:shared] + [rng.randrange(1000) for _ in range(extra)]
    if len(y) < 2:
        y += [rng.randrange(1000) for _ in range(2 - len(y))]
    n = next(REQUEST_NUMBERS)
    params = stage(p, f"x{n}", x)
    if forge == "request_id":                     # the params of y's staged twin, pointed at x
        params = dict(stage(p, f"y{n}", y), remote_request_id=f"x{n}")
    elif forge == "model":
        params = dict(params, spec=dict(params["spec"], model="another-model"))
        with pytest.raises(ValueError, match="model"):
            d.add_request(f"d{n}", y, 2, params)
        return
    record = d.run(f"d{n}", y, max_tokens=2, kv_transfer_params=params)
    assert_reference(d, record, y)
    d.check_all_free()
