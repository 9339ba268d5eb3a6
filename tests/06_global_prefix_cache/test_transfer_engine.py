"""The from-scratch transfer engine: Mooncake's API over loopback TCP, registered-memory
checks, checksums, the async form, timeouts, revoked writes and the link model."""
import time

import pytest
import torch

from global_prefix_cache.transfer_engine import LinkModel, TransferEngine


@pytest.fixture
def pair():
    a, b = TransferEngine(timeout=2.0), TransferEngine(timeout=2.0)
    a.initialize()
    b.initialize()
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(1024)
    a.register_memory(src.data_ptr(), src.nbytes)
    b.register_memory(dst.data_ptr(), dst.nbytes)
    yield a, b, src, dst
    a.close()
    b.close()


def test_batched_write_and_read_move_exact_bytes(pair):
    a, b, src, dst = pair
    s, d = src.data_ptr(), dst.data_ptr()
    assert a.batch_transfer_sync_write(b.session_id, [s + 40, s], [d, d + 400], [80, 16]) == 0
    assert torch.equal(dst[:20], src[10:30]) and torch.equal(dst[100:104], src[:4])
    dst.zero_()
    assert b.batch_transfer_sync_read(a.session_id, [d + 8], [s + 4000], [12]) == 0
    assert dst[2:5].tolist() == [1000.0, 1001.0, 1002.0]


def test_memory_outside_registered_ranges_is_refused(pair):
    a, b, src, dst = pair
    rc = a.batch_transfer_sync_write(b.session_id, [src.data_ptr()], [dst.data_ptr() + dst.nbytes - 8], [16])
    assert rc == -1 and "not inside memory registered" in a.last_error
    assert dst.abs().sum() == 0


def test_corrupted_payload_is_detected_and_nothing_is_written(pair):
    a, b, src, dst = pair
    a.faults.corrupt_payloads = 1                      # a's next outgoing payload gets a flipped byte
    assert a.batch_transfer_sync_write(b.session_id, [src.data_ptr()], [dst.data_ptr()], [4096]) == -1
    assert "checksum" in a.last_error and dst.abs().sum() == 0
    a.faults.corrupt_payloads = 1                      # ... and in the other direction (a serves a read)
    assert b.batch_transfer_sync_read(a.session_id, [dst.data_ptr()], [src.data_ptr()], [4096]) == -1
    assert "checksum" in b.last_error and dst.abs().sum() == 0


def test_submit_wait_is_complete_and_a_timeout_writes_nothing(pair):
    a, b, src, dst = pair
    bid = b.submit("read", a.session_id, [dst.data_ptr()], [src.data_ptr()], [64])
    result = b.wait(bid, timeout=2)
    assert result.ok and result.num_bytes == 64 and torch.equal(dst[:16], src[:16])
    dst.zero_()
    a.faults.serve_delay_s = 0.6                        # a slow owner
    bid = b.submit("read", a.session_id, [dst.data_ptr()], [src.data_ptr() + 64], [64])
    assert not b.is_complete(bid)
    t0 = time.monotonic()
    result = b.wait(bid, timeout=0.2)
    assert not result.ok and "not complete within" in result.error and time.monotonic() - t0 < 0.5
    time.sleep(0.8)                                    # the bytes arrive late ...
    assert dst.abs().sum() == 0                        # ... and are dropped, not written
    with pytest.raises(ValueError, match="op must be"):
        b.submit("copy", a.session_id, [1], [1], [1])
    with pytest.raises(ValueError, match="3 buffers, 1 peer"):
        b.submit("read", a.session_id, [1, 2, 3], [1], [1])


def test_revoked_tag_refuses_late_writes(pair):
    a, b, src, dst = pair
    b.revoke_tag("req-1")
    assert a.batch_transfer_sync_write(b.session_id, [src.data_ptr()], [dst.data_ptr()], [8], tag="req-1") == -1
    assert "after its load was given up" in a.last_error
    assert a.batch_transfer_sync_write(b.session_id, [src.data_ptr()], [dst.data_ptr()], [8], tag="req-2") == 0


def test_link_model_paces_transfers(pair):
    a, b, src, dst = pair
    link = LinkModel(latency_s=2e-3, bandwidth_Bps=1e6)            # 2 ms per transfer, 1 MB/s
    assert link.seconds(4000, 2) == pytest.approx(4e-3 + 4e-3)
    a.link = link
    t0 = time.perf_counter()
    assert a.batch_transfer_sync_write(b.session_id, [src.data_ptr()] * 2, [dst.data_ptr(), dst.data_ptr() + 2000],
                                       [2000, 2000]) == 0
    assert time.perf_counter() - t0 >= link.seconds(4000, 2)
    with pytest.raises(ValueError):
        LinkModel(latency_s=-1)


def test_unreachable_peer_fails_fast():
    """A refused connection fails at once, not after the transfer timeout: the bound is a
    quarter of a long timeout, so a busy 2-core machine cannot trip it (1.5 s was seen)."""
    from global_prefix_cache.rpc import free_port
    engine = TransferEngine(timeout=20.0)
    engine.initialize()
    src = torch.arange(4, dtype=torch.float32)
    engine.register_memory(src.data_ptr(), src.nbytes)
    try:
        t0 = time.monotonic()
        assert engine.batch_transfer_sync_write(f"127.0.0.1:{free_port()}", [src.data_ptr()], [0], [8]) == -1
        assert time.monotonic() - t0 < engine.timeout / 4
        assert "refused" in engine.last_error
    finally:
        engine.close()
