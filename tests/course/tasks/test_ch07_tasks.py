"""Chapter 07's hidden edge cases (tests/course/tasks/conftest.py): the model's engine seams
(ch07_task4) at the ends of what a checkpoint and a step can hold, each rule stated in the
function's docstring. Oracles: HF's own tensors and torch's SDPA on caches written by hand."""
import importlib.util
import pathlib
import random

import pytest
import torch

_spec = importlib.util.spec_from_file_location("_ch01_tasks", pathlib.Path(__file__).with_name("test_ch01_tasks.py"))
_ch01 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch01)
paged_cache, sdpa, GEN = _ch01.paged_cache, _ch01.sdpa, _ch01.GEN

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """A tiny tied-embedding Llama saved by HF; returns (its directory, the HF model)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = tmp_path_factory.mktemp("tied")
    config = AutoConfig.for_model("llama", tie_word_embeddings=True, **TINY)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def test_load_weights_takes_any_order_and_skips_what_a_checkpoint_may_carry_beyond_the_model(tied_checkpoint):
    """load_weights: checkpoint tensors may come in any order (q/k/v pieces of one merged
    parameter apart); a tied checkpoint that also stores `lm_head.weight` keeps the embedding
    (the embedding wins, as in vLLM); RoPE's stored `rotary_emb.inv_freq` is skipped; every
    merged parameter ends up equal to its pieces concatenated."""
    from mini_vllm.config import ModelConfig
    from mini_vllm.models.loader import _default_dtype, iterate_weights, load_weights
    from mini_vllm.models.registry import get_model_class
    path, hf = tied_checkpoint
    config = ModelConfig.from_pretrained(path)
    with _default_dtype(config.dtype):
        model = get_model_class(config.architecture)(config, attn_backend="torch")
    weights = list(iterate_weights(path))
    names = {n for n, _ in weights}
    weights.append(("lm_head.weight", torch.full_like(hf.model.embed_tokens.weight, 7.0)))   # a stale copy
    weights.append(("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)))
    random.Random(5).shuffle(weights)
    load_weights(model, weights)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    a, h = model.model.layers[0].self_attn, hf.model.layers[0].self_attn
    assert torch.equal(a.qkv_proj.weight, torch.cat([h.q_proj.weight, h.k_proj.weight, h.v_proj.weight]))
    assert torch.equal(a.o_proj.weight, h.o_proj.weight)
    m, hm = model.model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(m.gate_up_proj.weight, torch.cat([hm.gate_proj.weight, hm.up_proj.weight]))


def test_load_weights_names_the_checkpoint_tensor_of_a_wrong_shaped_piece(tied_checkpoint):
    """A piece of a merged parameter (k_proj into qkv_proj) with the wrong shape is a ValueError
    naming the checkpoint tensor, not the merged parameter."""
    from mini_vllm.config import ModelConfig
    from mini_vllm.models.loader import _default_dtype, iterate_weights, load_weights
    from mini_vllm.models.registry import get_model_class
    path, _ = tied_checkpoint
    config = ModelConfig.from_pretrained(path)
    with _default_dtype(config.dtype):
        model = get_model_class(config.architecture)(config, attn_backend="torch")
    weights = [(n, t[:-1] if n == "model.layers.0.self_attn.k_proj.weight" else t) for n, t in iterate_weights(path)]
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight"):
        load_weights(model, weights)


def test_paged_attention_forward_on_a_mixed_step_with_a_padding_row():
    """PagedAttention.forward writes this step's K/V at slot_mapping (a -1 slot: a padding row,
    written nowhere) and attends over the cache: a prefill chunk after cached context, a decode
    row and a padding row in one call equal SDPA over each request's K/V."""
    from mini_vllm.models.attention import PagedAttention
    from paged_attention.metadata import AttentionMetadata
    block_size, kvh, d = 4, 2, 16
    context, new = [6, 9], [3, 1]                       # request 0: a chunk of 3 after 6; request 1: a decode
    total = [c + n for c, n in zip(context, new)]
    kc, vc, table, lens, keys, values = paged_cache(total, num_kv_heads=kvh, head_dim=d, block_size=block_size)
    slots = []
    for i, (c, n) in enumerate(zip(context, new)):
        for p in range(c, c + n):
            slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
            kc.view(-1, kvh, d)[slots[-1]] = float("nan")            # the step's rows are not written yet
            vc.view(-1, kvh, d)[slots[-1]] = float("nan")
    k_new = torch.cat([keys[i][c:] for i, c in enumerate(context)] + [torch.randn(1, kvh, d, generator=GEN)])
    v_new = torch.cat([values[i][c:] for i, c in enumerate(context)] + [torch.randn(1, kvh, d, generator=GEN)])
    slots.append(-1)                                  # a padding row: a request of its own, written nowhere
    table = torch.cat([table, torch.zeros(1, table.shape[1], dtype=torch.int32)])
    lens = torch.cat([lens, torch.ones(1, dtype=torch.int32)])
    before = kc.clone()
    q = torch.randn(sum(new) + 1, 4, d, generator=GEN)
    md = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=table, seq_lens=lens,
                           query_start_loc=torch.tensor([0, 3, 4, 5], dtype=torch.int32), max_query_len=3,
                           max_seq_len=max(total))
    attn = PagedAttention(num_heads=4, head_dim=d, num_kv_heads=kvh, scale=d ** -0.5, backend="torch")
    out = attn(q, k_new, v_new, (kc, vc), md)
    torch.testing.assert_close(out[:3], sdpa(q[:3], keys[0], values[0], causal=True), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[3:4], sdpa(q[3:4], keys[1], values[1], causal=True), atol=1e-4, rtol=1e-4)
    written = torch.zeros(kc.view(-1, kvh, d).shape[0], dtype=torch.bool)
    written[torch.tensor(slots[:4])] = True
    flat, old = kc.view(-1, kvh, d), before.view(-1, kvh, d)
    assert torch.equal(flat[torch.tensor(slots[:4])], k_new[:4])
    assert torch.equal(flat[~written].nan_to_num(123.0), old[~written].nan_to_num(123.0))   # nothing else written
