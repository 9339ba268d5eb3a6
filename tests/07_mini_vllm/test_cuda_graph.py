"""CUDA graphs for decode: bucket choice and padding (CPU, exact), the padded forward equal to
the unpadded one (CPU, eager), and the real capture/replay against eager execution (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mini_vllm import SamplingParams
from mini_vllm.config import ModelConfig
from mini_vllm.cuda_graph import CUDAGraphRunner, DecodeBuffers, padded_batch_size
from mini_vllm.engine_config import EngineConfig
from mini_vllm.models.loader import get_model
from mini_vllm.input_batch import CachedRequestState, InputBatch


def test_capture_sizes_and_buckets():
    assert EngineConfig(max_num_seqs=64).capture_sizes() == [1, 2, 4, 8, 16, 32, 64]
    assert EngineConfig(max_num_seqs=48).capture_sizes() == [1, 2, 4, 8, 16, 32, 48]
    assert EngineConfig(max_num_seqs=1).capture_sizes() == [1]
    assert EngineConfig(max_num_seqs=8, cuda_graph_sizes=[8, 3, 100, 3]).capture_sizes() == [3, 8]
    sizes = [1, 2, 4, 8, 16, 32, 48]
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 33, 48, 49)] == [1, 2, 4, 8, 8, 16, 48, 48, None]


def decode_batch(rows: list[tuple[list[int], list[int]]], block_size: int, max_model_len: int = 64):
    """A pure-decode step: each (tokens, blocks) computes its last token."""
    batch = InputBatch(len(rows), max_model_len, max_model_len // block_size)
    for i, (tokens, blocks) in enumerate(rows):
        batch.add_request(CachedRequestState(f"r{i}", tokens, SamplingParams(), None, blocks, len(tokens) - 1))
    inputs, _ = batch.prepare_inputs(np.ones(len(rows), dtype=np.int64), block_size)
    return inputs


def test_fill_pads_with_rows_that_write_nothing():
    inputs = decode_batch([([5, 6, 7], [3]), ([8, 9, 10, 11, 12], [1, 4])], block_size=4)
    buffers = DecodeBuffers(max_size=8, max_num_blocks_per_req=16, device=torch.device("cpu"))
    buffers.block_tables.fill_(77)                                     # stale junk from an earlier step
    buffers.fill(inputs, size=4)
    md = buffers.metadata(4, max_seq_len=64)
    assert buffers.input_ids[:4].tolist() == [7, 12, 0, 0] and buffers.positions[:4].tolist() == [2, 4, 0, 0]
    assert md.slot_mapping.tolist() == [3 * 4 + 2, 4 * 4 + 0, -1, -1]
    assert md.seq_lens.tolist() == [3, 5, 1, 1] and md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.block_tables[:2, :2].tolist() == [[3, 0], [1, 4]]       # the step's table, width 2
    assert (md.block_tables[:2, 2:] == 77).all()                       # beyond it: stale, never read
    assert md.block_tables[2:].tolist() == [[0] * 16] * 2
    assert (md.max_query_len, md.max_seq_len) == (1, 64)
    with pytest.raises(ValueError, match="one token each"):
        buffers.fill(decode_batch([([5, 6, 7], [3])] * 3, 4), size=2)


def test_a_smaller_fill_pads_the_rows_the_last_one_filled():
    """Padding is written only where the previous fill put real rows: a batch that shrinks
    within its bucket leaves padding, never the last step's tokens and slots, behind it."""
    buffers = DecodeBuffers(max_size=8, max_num_blocks_per_req=16, device=torch.device("cpu"))
    buffers.fill(decode_batch([([5, 6, 7], [3]), ([8, 9, 10, 11, 12], [1, 4]), ([1, 2], [2])], 4), size=4)
    assert buffers.seq_lens[:4].tolist() == [3, 5, 2, 1]
    buffers.fill(decode_batch([([5, 6, 7], [3])], 4), size=4)
    md = buffers.metadata(4, max_seq_len=64)
    assert buffers.input_ids[:4].tolist() == [7, 0, 0, 0] and buffers.positions[:4].tolist() == [2, 0, 0, 0]
    assert md.slot_mapping.tolist() == [3 * 4 + 2, -1, -1, -1] and md.seq_lens.tolist() == [3, 1, 1, 1]
    assert md.block_tables[1:].tolist() == [[0] * 16] * 3
    buffers.fill(decode_batch([([5, 6, 7], [3])] * 2, 4), size=2)     # grows again, another bucket
    assert buffers.seq_lens.tolist() == [3, 3, 1, 1, 1, 1, 1, 1] and (buffers.slot_mapping[2:] == -1).all()


@torch.inference_mode()
def test_padded_bucket_gives_the_real_rows_the_unpadded_result(tiny_engine_models):
    """The CUDA-graph path's padding, run eagerly on a CPU: 3 decodes padded to a bucket of 4
    give the same hidden states as the 3 alone, and the padding row writes no KV."""
    from tolerances import assert_close

    model_dir, _ = tiny_engine_models["qwen3"]
    config = ModelConfig.from_pretrained(model_dir, max_model_len=64)
    model = get_model(config)
    caches = [(torch.randn(16, 4, config.num_key_value_heads, config.head_dim),
               torch.randn(16, 4, config.num_key_value_heads, config.head_dim)) for _ in range(config.num_hidden_layers)]
    rows = [([5, 6, 7], [3]), ([8, 9, 10, 11, 12], [1, 4]), (list(range(20, 29)), [9, 2, 6])]
    inputs = decode_batch(rows, block_size=4)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    originals = [(k.clone(), v.clone()) for k, v in caches]
    expected = model(inputs.input_ids, inputs.positions, eager_caches, inputs.attn_metadata)
    runner = CUDAGraphRunner(model, caches, [1, 2, 4], 64, 16, torch.device("cpu"), eager=True)
    assert runner.can_run(inputs)
    assert_close(runner.run(inputs), expected, dtype=torch.float32)
    # The real rows write their slots (values equal up to GEMM blocking: a 4-row matmul may sum in
    # another order than a 3-row one); every other slot, the padding row's included, is untouched.
    written = inputs.attn_metadata.slot_mapping
    untouched = torch.ones(16 * 4, dtype=torch.bool)
    untouched[written] = False
    for (k, v), (ek, ev), (k0, v0) in zip(caches, eager_caches, originals):
        for new, eager, old in ((k, ek, k0), (v, ev, v0)):
            new, eager, old = (t.view(16 * 4, -1) for t in (new, eager, old))
            assert torch.equal(new[untouched], old[untouched])
            assert_close(new[written], eager[written], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_graphs_match_eager(offline_engine_models, make_llm, backend):
    model_dir, _ = offline_engine_models["llama"]
    prompts = [[7], [8, 8], [9, 9, 9, 9, 9], [10] * 19, [11]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = make_llm(model_dir, device="cuda", attention_backend=backend, max_num_seqs=8, kv_cache_memory=64 << 20)
    eager = make_llm(model_dir, device="cuda", attention_backend=backend, max_num_seqs=8, kv_cache_memory=64 << 20,
                     enforce_eager=True)
    runner = graphs.llm_engine.engine_core.model_runner.cuda_graph_runner
    assert runner is not None and sorted(runner.graphs) == [1, 2, 4, 8]
    assert eager.llm_engine.engine_core.model_runner.cuda_graph_runner is None
    replays = []
    run = runner.run
    runner.run = lambda inputs: replays.append(inputs.input_ids.shape[0]) or run(inputs)
    out_graphs = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == out_graphs
    assert replays and max(replays) == 5                              # 5 decodes -> the bucket of 8


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_smollm2_shaped_engine_matches_hf_on_cuda(smollm2_shaped_dir, make_llm, hf_oracle, backend):
    """SmolLM2-135M's exact shape (30 layers, 9 query / 3 KV heads, head_dim 64, tied 49152 vocab)
    with random weights, fp32 on CUDA: the whole engine — profiled KV size, CUDA graphs for the
    triton / cuda backends, the fused layer ops — gives HF generate's greedy tokens on the same
    weights. Runs without network, where the real weights cannot be installed."""
    from transformers import AutoModelForCausalLM

    hf_greedy, assert_same_greedy = hf_oracle
    hf = AutoModelForCausalLM.from_pretrained(smollm2_shaped_dir, dtype=torch.float32).to("cuda").eval()
    prompts = [[1, 504, 3387, 282, 4649, 314], list(range(100, 140)), [9] * 17]
    llm = make_llm(smollm2_shaped_dir, device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=4,
                   kv_cache_memory=256 << 20)
    runner = llm.llm_engine.engine_core.model_runner
    assert (runner.cuda_graph_runner is not None) == (backend != "torch")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_same_greedy(list(out.outputs[0].token_ids), hf_greedy(hf, prompt, 16), 16, [2], f"{backend}")
    del hf
    torch.cuda.empty_cache()
