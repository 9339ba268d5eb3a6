"""Every Triton kernel of the chapter compiles for Hopper (sm_90) without a GPU, and ptxas
reports no register spills. Runs in a subprocess with TRITON_INTERPRET=0, because this
test session may have the interpreter switched on (conftest, CPU machines)."""
import json
import pathlib
import subprocess
import sys

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent.parent
COMPILE_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])             # tests/: ptxas_report
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_attention import triton_ops as T
from ptxas_report import ptxas_report

TARGET = GPUTarget("cuda", 90, 32)
DT = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
PRECISION = {"fp32": "ieee", "fp16": "tf32", "bf16": "tf32"}   # triton_common.dot_precision

def signature(fn, const, ptr_types, default_ptr):
    sig = {}
    if "KV_QUANT" in fn.arg_names:
        const.setdefault("KV_QUANT", 0)       # a constexpr with a default: a float cache unless given
    for name in fn.arg_names:
        if (name.endswith("_d") or name == "stride_bt_blk") and name.startswith("stride_") and name not in const:
            const[name] = 1      # the JIT specialises ints equal to 1 (contiguous head_dim, block_tables rows)
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, default_ptr)
        elif name in ("scale", "qk_scale", "k_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig

def aligned(fn, const):
    # What the JIT assumes for aligned tensors (every torch allocation) and strides that are
    # multiples of 16 (Llama shapes): tt.divisibility=16 on pointers and strides. With it, loads
    # are vectorised and the KV loop is software-pipelined (cp.async), as on a real launch.
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if n not in const and (n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_bt_seq"))}

def compile_one(label, fn, const, ptr_types, default_ptr, options=None, hints=False):
    sig = signature(fn, const, ptr_types, default_ptr)
    kernel = triton.compile(ASTSource(fn, sig, const, attrs=aligned(fn, const) if hints else None), target=TARGET,
                            options=options or {})
    report = ptxas_report(kernel, label)
    report["shared"] = kernel.metadata.shared
    return report

def decode_launch(cfg, block_size, const):
    # (kernel, constexprs, pointer types) of a DecodeConfig: v1's tile and split count, or v2's tile layout
    split = cfg.num_kv_splits > 1
    ptrs = dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", m_ptr="*fp32", l_ptr="*fp32",
                **({"out_ptr": "*fp32"} if split else {}))
    if cfg.version == "v1":
        return T._paged_decode_kernel, dict(const, TILE=cfg.tile, NUM_KV_SPLITS=cfg.num_kv_splits), ptrs
    rows, blocks, tile = T.v2_tile_layout(cfg.tile, block_size)
    return (T._paged_decode_kernel_v2,
            dict(const, BLOCK_ROWS=rows, BLOCKS_PER_TILE=blocks, TILE_TOKENS=tile, SPLIT_KV=split), ptrs)

results = []
for dt in ("fp16", "bf16", "fp32"):
    p = DT[dt]
    ints = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
    # GQA 8 unsplit at head_dim 128; MHA, block size 1, split-KV at head_dim 64
    for head_dim, group, block_size, splits in ((128, 8, 16, 1), (64, 1, 1, 8)):
        const = dict(QUERIES_PER_KV=group, BLOCK_G=16, HEAD_DIM=head_dim, BLOCK_D=head_dim,
                     BLOCK_SIZE=block_size, TILE=T.DEFAULT_TILE, NUM_KV_SPLITS=splits, UPCAST=False,
                     PRECISION=PRECISION[dt])
        # split-KV writes fp32 partials (acc, m, l); unsplit writes the output dtype
        ptrs = dict(ints, m_ptr="*fp32", l_ptr="*fp32", **({} if splits == 1 else {"out_ptr": "*fp32"}))
        results.append(compile_one(f"decode_{dt}_d{head_dim}_g{group}_b{block_size}_s{splits}",
                                   T._paged_decode_kernel, const, ptrs, p))
    results.append(compile_one(f"reduce_{dt}", T._split_kv_reduce_kernel,
                               dict(NUM_KV_SPLITS=8, BLOCK_S=8, HEAD_DIM=128, BLOCK_D=128, UPCAST=False),
                               {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}, p))
    block_m, block_n = T.PREFILL_BLOCKS[{"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dt]]
    results.append(compile_one(f"prefill_{dt}", T._prefill_kernel,
                               dict(QUERIES_PER_KV=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                                    UPCAST=False, PRECISION=PRECISION[dt]),
                               {"query_start_loc_ptr": "*i32"}, p))
    results.append(compile_one(f"reshape_and_cache_{dt}", T._reshape_and_cache_kernel,
                               dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HD=1024), {"slot_mapping_ptr": "*i64"}, p))
    # an 8-bit cache (kv_quant.py): int8 with per-row scales, fp8 (written as bytes) with the layer's
    for mode, cache, per_row, is_int8, qmax in (("int8", "*i8", True, True, 127.0), ("fp8", "*u8", False, False, 448.0)):
        results.append(compile_one(f"reshape_and_cache_quant_{mode}_{dt}", T._reshape_and_cache_quant_kernel,
                                   dict(HEAD_DIM=128, BLOCK_D=128, PER_ROW=per_row, IS_INT8=is_int8, QMAX=qmax),
                                   {"slot_mapping_ptr": "*i64", "key_cache_ptr": cache, "value_cache_ptr": cache,
                                    "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}, p))
# Every launch choose_decode_config can return for 16-bit head_dim 64/128 (and fp32 128), at
# block sizes whose tile layouts differ (1: one row a block; 12: padded to 16 rows; 16; 256: a
# slice of one block), split and unsplit; without alignment hints (worst case) and, at block
# 16, with them (what the JIT compiles for the benchmark's and an engine's tensors).
seen = set()
for dt, torch_dt in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
    for head_dim in ((64, 128) if dt != "fp32" else (128,)):
        for block_size in ((1, 12, 16, 256) if dt != "fp32" else (16,)):
            for num_seqs, max_seq_len in ((256, 4096), (1, 32768)):
                cfg = T.choose_decode_config(num_seqs, 8, max_seq_len, head_dim, torch_dt, block_size)
                split = cfg.num_kv_splits > 1
                fn, const, ptrs = decode_launch(cfg, block_size, dict(
                    QUERIES_PER_KV=4, BLOCK_G=16, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_SIZE=block_size,
                    UPCAST=False, PRECISION=PRECISION[dt]))
                for hints in ((False, True) if block_size == 16 else (False,)):
                    label = (f"chooser_{dt}_d{head_dim}_b{block_size}_{cfg.version}_t{cfg.tile}_w{cfg.num_warps}"
                             f"_s{cfg.num_stages}_{'split' if split else 'nosplit'}{'_aligned' if hints else ''}")
                    if label in seen:
                        continue
                    seen.add(label)
                    results.append(compile_one(label, fn, dict(const), ptrs, DT[dt],
                                               dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), hints))
# An 8-bit cache (kv_quant.py) read by both decode rungs with quantized_cache_config's launch:
# int8 rows with their inline fp32 scales (KV_QUANT 2) and fp8 with the layer's scales (1).
for dt, torch_dt in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
    for head_dim in (64, 128):
        for block_size, num_seqs, max_seq_len in ((16, 256, 4096), (16, 1, 32768), (1, 256, 4096)):
            cfg = T.choose_decode_config(num_seqs, 8, max_seq_len, head_dim, torch_dt, block_size)
            cfg = T.quantized_cache_config(cfg, head_dim, block_size)
            split = cfg.num_kv_splits > 1
            for mode, cache, kv_quant in (("int8", "*i8", 2), ("fp8", "*fp8e4nv", 1)):
                fn, const, ptrs = decode_launch(cfg, block_size, dict(
                    QUERIES_PER_KV=4, BLOCK_G=16, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_SIZE=block_size,
                    UPCAST=False, PRECISION=PRECISION[dt], KV_QUANT=kv_quant))
                ptrs.update(k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr="*fp32", v_scale_ptr="*fp32")
                label = (f"kvquant_{mode}_{dt}_d{head_dim}_b{block_size}_{cfg.version}_t{cfg.tile}"
                         f"_s{cfg.num_stages}_{'split' if split else 'nosplit'}")
                results.append(compile_one(label, fn, const, ptrs, DT[dt],
                                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), True))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(TESTS_DIR)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled):
    labels = {r["label"].split("_")[0] for r in compiled}
    assert labels == {"decode", "reduce", "prefill", "reshape", "chooser", "kvquant"}
    assert len([r for r in compiled if r["label"].split("_")[0] not in ("chooser", "kvquant")]) == 3 * 7
    assert all(r["cubin"] > 0 for r in compiled)


def test_every_chooser_launch_compiles(compiled):
    """choose_decode_config's picks (v1 at block size 1, v2 otherwise), split and unsplit, both
    head dims; the aligned builds are software-pipelined (their shared memory holds the
    in-flight K/V tiles: more than one 64-token K + V tile at head_dim 128, 32 KiB)."""
    chooser = {r["label"]: r for r in compiled if r["label"].startswith("chooser")}
    assert len(chooser) >= 2 * 2 * 4 * 2
    for dt in ("fp16", "bf16"):
        for d in (64, 128):
            assert any(f"_{dt}_d{d}_" in label and "_split" in label for label in chooser)
            assert any(f"_{dt}_d{d}_" in label and "_nosplit" in label for label in chooser)
    aligned = [r for label, r in chooser.items() if label.endswith("_aligned") and "_d128_" in label
               and "fp32" not in label]
    assert aligned and all(r["shared"] > 32 * 1024 for r in aligned), aligned    # > one K + V tile: pipelined
    print("\n".join(f"{label}: {r['regs']} registers, {r['shared']} B shared, {r['spills']} B spilled"
                    for label, r in sorted(chooser.items())))


def test_the_8bit_cache_launches_compile(compiled):
    """Both rungs reading an int8 (per-row scales) and an fp8 (per-tensor scales) cache, with the
    launch quantized_cache_config gives them, split and unsplit, for every query dtype."""
    quant = [r["label"] for r in compiled if r["label"].startswith("kvquant")]
    for mode in ("int8", "fp8"):
        for dt in ("fp16", "bf16", "fp32"):
            mine = [label for label in quant if label.startswith(f"kvquant_{mode}_{dt}_")]
            assert any("_v1_" in label for label in mine) and any("_v2_" in label for label in mine), mine
            assert any("_split" in label for label in mine) and any("_nosplit" in label for label in mine), mine


def test_no_register_spills(compiled):
    spilled = [r for r in compiled if r["spills"]]
    assert not spilled, spilled


# The fused layer ops (paged_attention/model/triton_layer_ops.py) at the engine's sizes: Qwen3-0.6B
# (hidden 1024, intermediate 3072, 16 / 8 heads of 128) and SmolLM2 (hidden 576, 9 / 3 heads of 64),
# compiled as the wrappers launch them (their num_warps, no FMA contraction).
LAYER_OPS_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_attention.model import triton_layer_ops as L
from ptxas_report import ptxas_report

TARGET = GPUTarget("cuda", 90, 32)
DT = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}

def compile_one(label, fn, const, ptrs, warps, floats=("eps",)):
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*fp32") if n.endswith("_ptr") else
           "fp32" if n in floats else "i32" for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, const), target=TARGET,
                            options=dict(num_warps=warps, **L._launch_options()))
    report = ptxas_report(kernel, label)
    ptx = kernel.asm["ptx"]
    report["rsqrt_approx"] = "rsqrt.approx" in ptx
    report["div_rn"] = "div.rn.f32" in ptx
    report["fma"] = "fma.rn.f32" in ptx
    return report

results = []
for dt in ("bf16", "fp16", "fp32"):
    p = DT[dt]
    for n in (1024, 576, 3072):
        block = triton.next_power_of_2(n)
        for has_res in (False, True):
            results.append(compile_one(f"rms_norm_{dt}_n{n}_res{int(has_res)}", L._rms_norm_kernel,
                                       dict(N=n, BLOCK_N=block, HAS_RESIDUAL=has_res, UPCAST=False, GPU_MATH=True),
                                       dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p), L._warps(block)))
    results.append(compile_one(f"silu_and_mul_{dt}_i3072", L._silu_and_mul_kernel,
                               dict(BLOCK=L.SILU_BLOCK, UPCAST=False, GPU_MATH=True),
                               dict(x_ptr=p, out_ptr=p), L._warps(L.SILU_BLOCK)))
    for h, kvh, d in ((16, 8, 128), (9, 3, 64)):
        bq, bk, bh = (triton.next_power_of_2(x) for x in (h, kvh, d // 2))
        results.append(compile_one(f"rotary_{dt}_h{h}_kv{kvh}_d{d}", L._rotary_embedding_kernel,
                                  dict(NUM_HEADS=h, NUM_KV_HEADS=kvh, HALF=d // 2, BLOCK_HQ=bq, BLOCK_HK=bk,
                                       BLOCK_HALF=bh, HAS_V=True, UPCAST=False),
                                  {n: p for n in L._rotary_embedding_kernel.arg_names if n.endswith("_ptr")},
                                  L._warps(bq * bh * 2)))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled_layer_ops():
    proc = subprocess.run([sys.executable, "-c", LAYER_OPS_SCRIPT, str(TESTS_DIR)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_layer_ops_compile_for_sm90_without_spills(compiled_layer_ops):
    assert len(compiled_layer_ops) == 3 * (3 * 2 + 1 + 2)
    assert all(r["cubin"] > 0 for r in compiled_layer_ops)
    spilled = [r for r in compiled_layer_ops if r["spills"]]
    assert not spilled, spilled


def test_layer_ops_use_torchs_math_and_no_fma(compiled_layer_ops):
    """What makes them match torch's CUDA kernels: rsqrt is __nv_rsqrtf (rsqrt.approx, as torch.rsqrt),
    SiLU divides with IEEE rounding (div.rn, as torch's `/`), and nothing is contracted into an FMA."""
    by_kind = {}
    for r in compiled_layer_ops:
        by_kind.setdefault(r["label"].split("_")[0], []).append(r)
    assert all(r["rsqrt_approx"] for r in by_kind["rms"])
    assert all(r["div_rn"] for r in by_kind["silu"])
    assert not any(r["fma"] for r in compiled_layer_ops)
