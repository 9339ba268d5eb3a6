"""`Request.kv_transfer_params` (vLLM's name): what a KV connector needs to know about one
request, carried by the request and read only by the connector."""
import pytest

from kvcache import BlockSpaceManager
from global_prefix_cache.scheduler import KVConnectorBase, KVConnectorScheduler
from scheduler import FinishReason, ModelRunnerOutput, Request, SchedulerConfig


def test_default_none_dict_kept_and_bad_type_refused():
    assert Request("a", [1, 2], 1).kv_transfer_params is None
    params = {"do_remote_decode": True}
    assert Request("b", [1, 2], 1, kv_transfer_params=params).kv_transfer_params is params
    with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
        Request("c", [1, 2], 1, kv_transfer_params="do_remote_decode")


def test_the_connector_sees_them_and_the_scheduler_ignores_them():
    seen = {}

    class Reader(KVConnectorBase):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            seen[request.request_id] = request.kv_transfer_params
            return 0, False

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            raise AssertionError("nothing was matched")

    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32),
                  BlockSpaceManager(8, 4), connector=Reader())
    s.add_request(Request("p", [1, 2, 3], 1, kv_transfer_params={"do_remote_decode": True}))
    s.add_request(Request("q", [4, 5, 6], 1))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"p": 3, "q": 3}
    assert seen == {"p": {"do_remote_decode": True}, "q": None}


def test_a_connector_fault_fails_that_request_alone():
    """Whatever escapes a connector while it handles ONE request's remote KV (here: its params
    were never validated and do not parse) finishes that request with an error and frees what
    it held; the request beside it runs as if nothing happened."""
    class Strict(KVConnectorBase):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            params = request.kv_transfer_params or {}
            return int(params.get("num_tokens", 0)), False

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            if request.request_id == "late":
                raise RuntimeError("no room in the send buffer")

    kv = BlockSpaceManager(16, 4)
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv, connector=Strict())
    s.add_request(Request("good", [1, 2, 3], 1))
    s.add_request(Request("bad", [4, 5, 6], 1, kv_transfer_params={"num_tokens": "many"}))
    s.add_request(Request("late", [7, 8, 9, 10, 11], 1, kv_transfer_params={"num_tokens": 4}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"good": 3}
    outputs = {o.request_id: o for o in s.update_from_output(out, ModelRunnerOutput(["good"], [[9]]))}
    assert outputs["bad"].finish_reason == FinishReason.ERROR and "ValueError" in outputs["bad"].stop_reason
    assert outputs["late"].finish_reason == FinishReason.ERROR and "send buffer" in outputs["late"].stop_reason
    assert outputs["good"].finish_reason == FinishReason.LENGTH and outputs["good"].new_token_ids == [9]
    assert not s.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
    s.check_invariants()
