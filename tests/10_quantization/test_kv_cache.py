"""The 8-bit KV cache (chapter 01's kv_quant.py; vLLM's --kv-cache-dtype): every backend writes the
same bytes, fp8 rounds as torch's own cast does, every backend's attention reads the cache back
within the stated error of fp32 attention on the unquantized K/V, and the engine holds more blocks
in the same memory and gives the same tokens whatever else is switched on."""
import pytest
import torch
from tolerances import assert_close

from chunked_prefill.ops import unified_attention
from paged_attention import ops as pa
from paged_attention.kv_quant import FP8_MAX, KVQuant
from paged_attention.reference import dense_attention
from paged_attention.triton_common import interpreting

MODES = {
    "int8_per_token_head": KVQuant("int8_per_token_head"),
    "fp8_per_token_head": KVQuant("fp8_per_token_head"),
    "fp8": KVQuant("fp8", k_scale=0.02, v_scale=0.01),
}
# Attention over the dequantized cache vs fp32 attention over the unquantized K/V (unit-normal K/V
# and queries, head_dim 32-64, outputs ~1): the quantization's own error, measured max 0.021 (int8),
# 0.11 (fp8 per row) and 0.15 (fp8 per tensor) over CASES; the bounds leave ~2x.
ATTENTION_ERROR = {"int8_per_token_head": 0.04, "fp8_per_token_head": 0.25, "fp8": 0.3}
# Triton on CPU tensors under the interpreter; on a GPU its kernels are test_on_the_gpu's.
WRITE_BACKENDS = ["torch", "cpu"] + (["triton"] if interpreting() else [])
READ_BACKENDS = WRITE_BACKENDS


def raw(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def empty_cache(kv_quant: KVQuant, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """A cache full of junk bytes (NaN-like fp8, huge scales): a kernel that reads a row it must
    not read shows it."""
    shape = (num_blocks, block_size, kv_heads, kv_quant.cache_head_dim(head_dim))
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(kv_quant.storage_dtype)


def test_fp8_bytes_equal_torchs_cast():
    """Every fp8 value, every midpoint between two neighbours (the ties), subnormals and random
    values: our C++ and Triton conversions give torch's bytes (round to nearest even)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    rand = (torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 2 - 1) * FP8_MAX
    x = torch.cat([grid, mids, rand, rand * 1e-3, rand * 1e-5])
    x = x[: x.numel() // 64 * 64].reshape(-1, 1, 64)                  # rows of 64
    kq = KVQuant("fp8", k_scale=1.0, v_scale=1.0)
    expected = raw(x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    slots = torch.arange(x.shape[0])
    for backend in WRITE_BACKENDS:
        kc = empty_cache(kq, x.shape[0], 1, 1, 64)
        vc = empty_cache(kq, x.shape[0], 1, 1, 64)
        pa.reshape_and_cache(x, x, kc, vc, slots, backend=backend, kv_quant=kq)
        assert torch.equal(raw(kc)[:, 0], expected), backend


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_backend_writes_the_references_bytes(mode, dtype):
    """Bit for bit: the data and, for per-token-head modes, each row's fp32 scale; strided key
    views, padding slots (-1) and rows nobody writes (their junk stays) included."""
    kq = MODES[mode]
    gen = torch.Generator().manual_seed(1)
    T, kvh, d, nb, bs = 29, 3, 64, 9, 8
    kv = torch.randn(T, 2 * kvh, d, generator=gen).to(dtype) * 4
    key, value = kv[:, :kvh], kv[:, kvh:]                             # strided views
    key[0, 0] = 0                                                     # an all-zero row: scale 1e-6
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[[2, 7]] = -1
    caches = {}
    for backend in ["reference"] + WRITE_BACKENDS:
        kc, vc = empty_cache(kq, nb, bs, kvh, d), empty_cache(kq, nb, bs, kvh, d)
        pa.reshape_and_cache(key, value, kc, vc, slots, backend=backend, kv_quant=kq)
        caches[backend] = (raw(kc), raw(vc))
    for backend in WRITE_BACKENDS:
        assert torch.equal(caches[backend][0], caches["reference"][0]), backend
        assert torch.equal(caches[backend][1], caches["reference"][1]), backend
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (caches["reference"][0].reshape(nb * bs, -1)[untouched] == 0x7F).all()


def written_cache(kq: KVQuant, seq_lens, query_lens, block_size: int, h: int, kvh: int, d: int,
                  gen: torch.Generator, spare_blocks: int):
    """A junk-filled cache (empty_cache) holding each request's K/V in shuffled physical blocks, its
    last block partial, written by the reference -> (key_cache, value_cache, block_tables, queries,
    keys, values): per request `query_len` random queries and its unquantized K/V."""
    blocks_per = [-(-n // block_size) for n in seq_lens]
    nb = sum(blocks_per) + spare_blocks
    order = torch.randperm(nb, generator=gen)
    kc, vc = empty_cache(kq, nb, block_size, kvh, d), empty_cache(kq, nb, block_size, kvh, d)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    queries, keys, values, start = [], [], [], 0
    for i, (n, q_len) in enumerate(zip(seq_lens, query_lens)):
        ids = order[start:start + blocks_per[i]]
        start += blocks_per[i]
        block_tables[i, :len(ids)] = ids.int()
        k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
        slots = (ids[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size)
        pa.reshape_and_cache(k, v, kc, vc, slots, backend="reference", kv_quant=kq)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, h, d, generator=gen))
    return kc, vc, block_tables, queries, keys, values


CASES = [   # (seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim): decode, chunked, GQA 3
    ((37, 1, 64), (1, 1, 1), 16, 6, 2, 64),
    ((23, 40), (23, 5), 8, 9, 3, 64),
    ((17,), (17,), 1, 4, 4, 32),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=["decode", "chunked-gqa3", "block1-prefill"])
def test_every_backend_reads_the_quantized_cache(mode, case):
    """Shuffled physical blocks, junk in every slot nobody wrote, partial last blocks: each backend
    equals the reference on the same cache, and the reference is within the stated error of fp32
    attention over the unquantized K/V."""
    kq = MODES[mode]
    seq_lens, query_lens, bs, h, kvh, d = case
    kc, vc, block_tables, queries, keys, values = written_cache(kq, seq_lens, query_lens, bs, h, kvh, d,
                                                                torch.Generator().manual_seed(3), spare_blocks=3)
    query = torch.cat(queries)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = unified_attention(query, kc, vc, block_tables, seq, qsl, d ** -0.5, backend="reference", kv_quant=kq)
    truth = torch.cat([dense_attention(q, k, v, d ** -0.5) for q, k, v in zip(queries, keys, values)])
    assert (ref - truth).abs().max() <= ATTENTION_ERROR[mode]
    for backend in READ_BACKENDS:
        out = unified_attention(query, kc, vc, block_tables, seq, qsl, d ** -0.5, backend=backend, kv_quant=kq)
        assert_close(out, ref, torch.float32)
    if all(q == 1 for q in query_lens):           # chapter 01's decode reads it too
        for backend in ["torch", "cpu"] + (["triton"] if interpreting() else []):
            out = pa.paged_decode_attention(query, kc, vc, block_tables, seq, d ** -0.5, backend=backend,
                                            kv_quant=kq)
            assert_close(out, ref, torch.float32)


@pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs the interpreter; on a GPU: test_on_the_gpu")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version,splits,block_size", [("v1", 1, 16), ("v1", 3, 5), ("v2", 1, 16), ("v2", 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chapter_01s_triton_decode_reads_the_quantized_cache(mode, version, splits, block_size, dtype):
    """Both rungs of chapter 01's Triton decode, with and without split-KV, on a junk-filled cache
    with shuffled blocks, GQA 3 and partial last blocks: equal to the torch backend on the same cache."""
    from paged_attention import triton_ops
    kq = MODES[mode]
    seq_lens, h, kvh, d = [45, 1, 70], 6, 2, 64
    kc, vc, block_tables, queries, _, _ = written_cache(kq, seq_lens, [1] * len(seq_lens), block_size, h, kvh, d,
                                                        torch.Generator().manual_seed(5), spare_blocks=2)
    query = torch.cat(queries).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    ref = pa.paged_decode_attention(query, kc, vc, block_tables, seq, d ** -0.5, backend="torch", kv_quant=kq)
    out = triton_ops.paged_decode_attention(query, kc, vc, block_tables, seq, d ** -0.5, kv_quant=kq,
                                            version=version, num_kv_splits=splits)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_write_run_by_the_emulator_writes_the_references_bytes(mode, dtype):
    """kernels_cuda/cache_kernels.cu's quantized write (one warp per (token, head): warp_max, the
    scale, the rounding), the real .cu run by the CPU emulator: the reference's bytes, int32 and
    int64 slots, padding slots skipped."""
    import ctypes

    from kernels_cuda import emulator
    try:
        lib = emulator.load("cache_kernels")
    except emulator.EmulatorUnavailable as e:
        pytest.skip(str(e))
    kq = MODES[mode]
    gen = torch.Generator().manual_seed(7)
    T, kvh, d, nb, bs = 11, 2, 64, 4, 4
    key, value = (torch.randn(T, kvh, d, generator=gen) * 3).to(dtype), torch.randn(T, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[4] = -1
    want_k, want_v = empty_cache(kq, nb, bs, kvh, d), empty_cache(kq, nb, bs, kvh, d)
    pa.reshape_and_cache(key, value, want_k, want_v, slots, backend="reference", kv_quant=kq)
    for slot_dtype in (torch.int32, torch.int64):
        kc, vc = empty_cache(kq, nb, bs, kvh, d), empty_cache(kq, nb, bs, kvh, d)
        s = slots.to(slot_dtype)
        strides = (ctypes.c_int64 * 10)(*key.stride()[:2], *value.stride()[:2], *kc.stride()[:3], *vc.stride()[:3])
        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
        rc = lib.vfs_reshape_and_cache_quant(code, slot_dtype == torch.int64, 1 if kq.storage_dtype == torch.int8 else 2,
                                             kq.per_token_head, key.data_ptr(), value.data_ptr(), kc.data_ptr(),
                                             vc.data_ptr(), s.data_ptr(), T, bs, kvh, d, kq.k_scale, kq.v_scale,
                                             strides, 0)
        assert rc == 0
        assert torch.equal(raw(kc), raw(want_k)) and torch.equal(raw(vc), raw(want_v))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_triton_and_cuda_write_and_read_the_cache(mode, dtype):
    """Native Triton and CUDA: the writes' bytes equal the reference's but where a GPU division
    (Triton's 1 / scale need not be correctly rounded) moves a value across a rounding boundary —
    one step, in a few elements; chapter 05's 2-D and split-KV reads, chapter 01's two Triton decode
    rungs and its CUDA v1 / v2 / v3 equal the reference on the same cache."""
    kq = MODES[mode]
    gen = torch.Generator().manual_seed(4)
    T, kvh, h, d, bs = 300, 2, 8, 64, 16
    key, value = torch.randn(T, kvh, d, generator=gen).to(dtype), torch.randn(T, kvh, d, generator=gen).to(dtype)
    nb = -(-T // bs) + 2
    slots = torch.arange(T) + bs                                     # block 0 stays junk
    ref_k, ref_v = empty_cache(kq, nb, bs, kvh, d), empty_cache(kq, nb, bs, kvh, d)
    pa.reshape_and_cache(key, value, ref_k, ref_v, slots, backend="reference", kv_quant=kq)
    written = []
    for backend in ("triton", "cuda"):
        gpu_k, gpu_v = empty_cache(kq, nb, bs, kvh, d).cuda(), empty_cache(kq, nb, bs, kvh, d).cuda()
        pa.reshape_and_cache(key.cuda(), value.cuda(), gpu_k, gpu_v, slots.cuda(), backend=backend, kv_quant=kq)
        written += [(gpu_k, ref_k), (gpu_v, ref_v)]
    for ours, ref in written:
        data, want = ours.cpu()[..., :d], ref[..., :d]
        steps = (data.float() - want.float()).abs() if kq.storage_dtype == torch.int8 else \
            (raw(data).int() - raw(want).int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
    block_tables = torch.arange(1, nb, dtype=torch.int32)[None]
    query = torch.randn(1, h, d, generator=gen).to(dtype)
    seq, qsl = torch.tensor([T], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    ref = unified_attention(query, ref_k, ref_v, block_tables, seq, qsl, d ** -0.5, backend="reference", kv_quant=kq)
    from chunked_prefill import triton_ops
    from paged_attention import triton_ops as decode_ops
    for splits in (1, 4):
        out = triton_ops.unified_attention(query.cuda(), ref_k.cuda(), ref_v.cuda(), block_tables.cuda(), seq.cuda(),
                                           qsl.cuda(), d ** -0.5, kv_quant=kq, num_kv_splits=splits)
        assert_close(out.cpu(), ref, dtype)
        for version in ("v1", "v2"):                 # chapter 01's decode rungs on the same cache
            out = decode_ops.paged_decode_attention(query.cuda(), ref_k.cuda(), ref_v.cuda(), block_tables.cuda(),
                                                    seq.cuda(), d ** -0.5, kv_quant=kq, version=version,
                                                    num_kv_splits=splits)
            assert_close(out.cpu(), ref, dtype)
    for version in ("v1", "v2", "v3"):               # the CUDA decode kernels read it too
        out = pa.paged_decode_attention(query.cuda(), ref_k.cuda(), ref_v.cuda(), block_tables.cuda(), seq.cuda(),
                                        d ** -0.5, backend="cuda", version=version, kv_quant=kq)
        assert_close(out.cpu(), ref, dtype)


def test_bad_kv_cache_input_is_refused_clearly():
    kq = MODES["int8_per_token_head"]
    key = torch.randn(2, 2, 64)
    float_cache = torch.zeros(4, 4, 2, 68)                                        # the right rows, wrong dtype
    with pytest.raises(TypeError, match="int8_per_token_head cache is torch.int8"):
        pa.reshape_and_cache(key, key, float_cache, float_cache, torch.tensor([0, 1]), kv_quant=kq)
    int8_cache = torch.zeros(4, 4, 2, 64, dtype=torch.int8)                       # no room for the scales
    with pytest.raises(ValueError, match="row holds 68"):
        pa.reshape_and_cache(key, key, int8_cache, int8_cache, torch.tensor([0, 1]), kv_quant=kq)
    with pytest.raises(TypeError, match="needs kv_quant="):
        pa.reshape_and_cache(key, key, int8_cache, int8_cache, torch.tensor([0, 1]))
    for backend in ("torch", "cpu"):                                             # the read checks the rows too
        with pytest.raises(ValueError, match="row holds 68"):
            pa.paged_decode_attention(torch.randn(1, 2, 64), int8_cache, int8_cache,
                                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1,
                                      backend=backend, kv_quant=kq)
    with pytest.raises(ValueError, match="computes a scale per row"):
        KVQuant("int8_per_token_head", k_scale=0.5)


# ------------------------------------------------------------------------------------ engine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far", "1, 2, 3, 4,"]


def greedy(llm, prompts=PROMPTS, max_tokens=12):
    from mini_vllm import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_memory_holds_more_blocks(tiny_float, make_llm, dtype):
    """One byte a number: vs fp32 4x the blocks, vs bf16 2x; with each row's fp32 scale after its
    head_dim bytes, x head_dim / (head_dim + 4) — vLLM's page arithmetic for the same formats."""
    path, _ = tiny_float
    blocks = {kv: make_llm(path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20)
              .llm_engine.engine_core.kv_cache_report.num_blocks
              for kv in ("auto", "fp8", "int8_per_token_head")}
    elem = 4 if dtype == "float32" else 2
    head_dim = 32                                     # the tiny model's (TINY_QUANT: 128 / 4 heads)
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(elem, rel=0.01)
    assert blocks["int8_per_token_head"] / blocks["auto"] == pytest.approx(elem * head_dim / (head_dim + 4), rel=0.01)


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8"])
def test_quantized_cache_tokens_are_the_same_whatever_else_runs(tiny_float, make_llm, mode):
    """The 8-bit cache composes: the plain engine's tokens on it equal those with the per-token
    reference attention, prefix caching (a second run hits the cache), chunked prefill in 8-token
    chunks, preemption (a pool too small for all four), n-gram drafts, and async scheduling."""
    path, _ = tiny_float
    base = greedy(make_llm(path, kv_cache_dtype=mode))
    assert greedy(make_llm(path, kv_cache_dtype=mode, attention_backend="reference")) == base
    cached = make_llm(path, kv_cache_dtype=mode, enable_prefix_caching=True)
    assert greedy(cached) == base and greedy(cached) == base
    assert greedy(make_llm(path, kv_cache_dtype=mode, enable_chunked_prefill=True, max_num_batched_tokens=8,
                           max_num_seqs=4)) == base
    assert greedy(make_llm(path, kv_cache_dtype=mode, num_gpu_blocks_override=6, block_size=4)) == base
    assert greedy(make_llm(path, kv_cache_dtype=mode, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})) == base
    assert greedy(make_llm(path, kv_cache_dtype=mode, async_scheduling=True)) == base


def test_quantized_cache_stays_close_to_the_float_cache(tiny_float):
    """Logits of a prefill + decode through the int8 cache vs the float one: within the
    quantization's own error (the tokens may part where two logits are within it)."""
    from paged_forward import paged_logits

    from mini_vllm.config import ModelConfig
    from mini_vllm.models.loader import get_model
    path, _ = tiny_float
    ids = [list(range(5, 45)), list(range(100, 117))]
    logits = {}
    for kv in ("auto", "int8_per_token_head"):
        config = ModelConfig.from_pretrained(path, kv_cache_dtype=kv)
        logits[kv] = paged_logits(get_model(config), config, ids)
    diff = (logits["int8_per_token_head"] - logits["auto"]).abs().max() / logits["auto"].abs().max()
    assert diff < 0.02


def test_bad_kv_cache_dtype_is_refused_with_the_name(tiny_float, make_llm):
    path, _ = tiny_float
    with pytest.raises(ValueError, match="fp8_e5m2.*does not implement"):
        make_llm(path, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int9'"):
        make_llm(path, kv_cache_dtype="int9")
    with pytest.raises(ValueError, match="differs from the model's dtype"):
        make_llm(path, kv_cache_dtype="bfloat16", dtype="float32")


def with_kv_scales(src, dst, scheme: dict, scales: dict[str, float]):
    """A copy of checkpoint `src` whose config.json has `kv_cache_scheme` and whose safetensors holds
    `model.layers.{i}.self_attn.{k,v}_scale` (compressed-tensors' names and [1] shape)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                              "config_groups": {}, "ignore": []})
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (dst / "config.json").write_text(json.dumps(config))
    [file] = list(dst.glob("*.safetensors"))
    tensors = load_file(file)
    tensors.update({name: torch.tensor([value]) for name, value in scales.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return dst


FP8_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


def test_a_checkpoints_fp8_kv_scales_are_loaded_for_an_fp8_cache_only(tiny_quantized, tmp_path):
    """llmcompressor's kv_cache_scheme: `self_attn.k_scale` / `v_scale` per layer. With
    kv_cache_dtype="fp8" every layer's cache uses them (vLLM: BaseKVCacheMethod); a float cache and
    the per-token-head modes ignore them, as vLLM does; a missing layer keeps 1.0."""
    from mini_vllm.config import ModelConfig
    from mini_vllm.models.attention import PagedAttention
    from mini_vllm.models.loader import get_model
    scales = {"model.layers.0.self_attn.k_scale": 0.03, "model.layers.0.self_attn.v_scale": 0.007,
              "model.layers.1.self_attn.k_scale": 0.05}                          # layer 1: v from k
    path = with_kv_scales(tiny_quantized["w8a16"], tmp_path / "kv", FP8_SCHEME, scales)

    def quants(kv):
        model = get_model(ModelConfig.from_pretrained(path, kv_cache_dtype=kv))
        assert not any("k_scale" in n for n, _ in model.named_parameters())
        return [m.kv_quant for m in model.modules() if isinstance(m, PagedAttention)]
    fp8 = quants("fp8")
    assert (fp8[0].k_scale, fp8[0].v_scale) == (pytest.approx(0.03), pytest.approx(0.007))
    assert (fp8[1].k_scale, fp8[1].v_scale) == (pytest.approx(0.05), pytest.approx(0.05))
    assert all((q.k_scale, q.v_scale) == (1.0, 1.0) for q in fp8[2:])
    assert all(q is None for q in quants("auto"))
    assert all(q == KVQuant("int8_per_token_head") for q in quants("int8_per_token_head"))


def test_an_fp8_cache_with_checkpoint_scales_runs_in_the_engine(tiny_quantized, make_llm, tmp_path):
    """The scales reach the engine's attention layers, and its C++ attention gives the reference
    attention's tokens on the cache they scale."""
    from mini_vllm.models.attention import PagedAttention
    scales = {f"model.layers.{i}.self_attn.{w}_scale": s for i in range(2) for w, s in (("k", 0.02), ("v", 0.01))}
    path = with_kv_scales(tiny_quantized["w8a16"], tmp_path / "kv", FP8_SCHEME, scales)
    llm = make_llm(path, kv_cache_dtype="fp8")
    layers = [m for m in llm.llm_engine.engine_core.model_runner.model.modules() if isinstance(m, PagedAttention)]
    assert [(q.k_scale, q.v_scale) for q in (m.kv_quant for m in layers[:2])] == [(pytest.approx(0.02),
                                                                                    pytest.approx(0.01))] * 2
    assert greedy(llm) == greedy(make_llm(path, kv_cache_dtype="fp8", attention_backend="reference"))


@pytest.mark.parametrize("scheme, field", [
    ({**FP8_SCHEME, "type": "int"}, "num_bits=8, type=int"),
    ({**FP8_SCHEME, "strategy": "channel"}, "Invalid strategy .* found strategy: 'channel'"),
    ({**FP8_SCHEME, "symmetric": False}, "Only support symmetric"),
])
def test_unsupported_kv_cache_schemes_are_refused_naming_them(tiny_quantized, tmp_path, scheme, field):
    from mini_vllm.config import ModelConfig
    from mini_vllm.models.loader import get_model
    path = with_kv_scales(tiny_quantized["w8a16"], tmp_path / "kv", scheme, {})
    with pytest.raises(ValueError, match=f"kv_cache_scheme: .*{field}"):
        get_model(ModelConfig.from_pretrained(path, kv_cache_dtype="fp8"))


def test_calibrated_kv_scales_bound_what_the_cache_stores(tiny_float, tmp_path):
    """quantize --kv-cache-scheme fp8: each layer's scale is its largest |K| (after RoPE) or |V| on
    the calibration text over 448, so those numbers land exactly at fp8's largest, none beyond; the
    checkpoint loads with them (kv_cache_dtype="fp8")."""
    import json

    from mini_vllm.config import ModelConfig
    from mini_vllm.models.attention import PagedAttention
    from mini_vllm.models.loader import get_model
    from quantization.quantize import main as quantize_main
    path, _ = tiny_float
    out = tmp_path / "w8-kv"
    quantize_main(["--model", str(path), "--out", str(out), "--scheme", "W8A16", "--kv-cache-scheme", "fp8",
                   "--num-samples", "4", "--seq-len", "64"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    model = get_model(ModelConfig.from_pretrained(out, kv_cache_dtype="fp8"))
    quants = [m.kv_quant for m in model.modules() if isinstance(m, PagedAttention)]
    assert all(q.k_scale != 1.0 and q.v_scale != 1.0 for q in quants)
    seen = []                                      # what each layer writes on one calibration window
    for layer, q in zip((m for m in model.modules() if isinstance(m, PagedAttention)), quants):
        layer.register_forward_pre_hook(lambda mod, args, q=q: seen.append(
            (float(args[1].abs().max()) / q.k_scale, float(args[2].abs().max()) / q.v_scale)))
    from paged_forward import paged_logits
    from quantization.calibration import calibration_samples
    from transformers import AutoTokenizer
    window = calibration_samples(AutoTokenizer.from_pretrained(out), 4, 64)[0].tolist()
    paged_logits(model, ModelConfig.from_pretrained(out, kv_cache_dtype="fp8"), [window])
    assert len(seen) == len(quants) and all(k <= FP8_MAX * (1 + 1e-5) and v <= FP8_MAX * (1 + 1e-5) for k, v in seen)


def test_per_head_kv_scales_load_as_their_largest(tiny_float, make_llm, tmp_path):
    """quantize --kv-strategy attn_head: one scale per KV head, stored [heads, 1, 1] (llmcompressor's
    layout). Each layer's largest head scale is the per-layer scale of the same calibration (a max of
    maxima), and the engine reads per-head scales as that largest, as vLLM's CPU attention does; so
    the two checkpoints give one engine the same scales and the same tokens."""
    from safetensors.torch import load_file

    from mini_vllm.models.attention import PagedAttention
    from mini_vllm.models.quantization import kv_heads_of_rank
    from quantization.quantize import main as quantize_main
    path, hf = tiny_float
    out = {}
    for strategy in ("tensor", "attn_head"):
        out[strategy] = tmp_path / strategy
        quantize_main(["--model", str(path), "--out", str(out[strategy]), "--scheme", "W8A16", "--kv-cache-scheme",
                       "fp8", "--kv-strategy", strategy, "--num-samples", "4", "--seq-len", "64"])
    per_head, per_layer = (load_file(str(out[s] / "model.safetensors")) for s in ("attn_head", "tensor"))
    name = "model.layers.1.self_attn.k_scale"
    assert per_head[name].shape == (hf.config.num_key_value_heads, 1, 1) and per_layer[name].shape == (1,)
    assert per_head[name].max() == per_layer[name][0] and bool((per_head[name] < per_layer[name][0]).any())

    def scales_and_tokens(ckpt):
        llm = make_llm(ckpt, kv_cache_dtype="fp8")
        layers = [m for m in llm.llm_engine.engine_core.model_runner.model.modules() if isinstance(m, PagedAttention)]
        return [(m.kv_quant.k_scale, m.kv_quant.v_scale) for m in layers], greedy(llm)
    assert scales_and_tokens(out["attn_head"]) == scales_and_tokens(out["tensor"])
    assert [kv_heads_of_rank(4, 2, r) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]       # fewer heads: replicated
