"""Hopper compile check of the unified-attention kernels, without a GPU.

The interpreter runs the kernels' Python semantics; it does not prove they compile for a
GPU (tile shapes tl.dot rejects, register blow-ups). So compile each launch the wrapper
would make for realistic shapes — the same arguments, specialised by Triton's own JIT
rules (ints equal to 1 become constants, 16-divisible ints and pointers get alignment
hints) — for sm_90 in a subprocess with TRITON_INTERPRET=0, and read registers and
spills from the bundled `ptxas -v`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, pathlib, re, subprocess, sys, tempfile
import torch, triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from chunked_prefill.triton_ops import plan_launches

PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_launch(launch):
    fn = launch.kernel
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, launch.args)):
        kind, attr = native_specialize_impl(CUDABackend, arg, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    for name in launch.constexprs:
        signature[name] = "constexpr"
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(launch.options))
    with tempfile.TemporaryDirectory() as d:
        ptx = pathlib.Path(d) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        info = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    return dict(kernel=fn.__name__, regs=regs, spills=spills, shared=kernel.metadata.shared,
                BLOCK_M=launch.constexprs.get("BLOCK_M"), HEAD_DIM=launch.constexprs["HEAD_DIM"],
                TILE_N=launch.constexprs.get("TILE_N"), num_stages=kernel.metadata.num_stages)


from paged_attention.kv_quant import KVQuant

CASES = {   # name: (num_heads, num_kv_heads, head_dim, dtype, max_query_len, num_kv_splits[, kv_cache_dtype])
    "smollm2-decode-fp16": (9, 3, 64, torch.float16, 1, 1),
    "smollm2-decode-split-kv-fp16": (9, 3, 64, torch.float16, 1, 16),
    "smollm2-prefill-bf16": (9, 3, 64, torch.bfloat16, None, 1),
    "smollm2-mixed-fp32-ieee": (9, 3, 64, torch.float32, None, 1),
    "llama8b-prefill-bf16": (32, 8, 128, torch.bfloat16, None, 1),
    "llama8b-decode-split-kv-bf16": (32, 8, 128, torch.bfloat16, 1, 8),
    "qwen3-0.6b-decode-bf16": (16, 8, 128, torch.bfloat16, 1, 1),
    "d256-prefill-bf16": (8, 1, 256, torch.bfloat16, None, 1),
    "d256-decode-split-kv-fp32": (8, 1, 256, torch.float32, 1, 4),
    # an 8-bit cache (paged_attention/kv_quant.py): per-row int8 / fp8 scales, per-tensor fp8
    "smollm2-decode-int8kv-bf16": (9, 3, 64, torch.bfloat16, 1, 1, "int8_per_token_head"),
    "qwen3-0.6b-decode-fp8kv-rows-bf16": (16, 8, 128, torch.bfloat16, 1, 1, "fp8_per_token_head"),
    "llama8b-decode-split-kv-fp8kv-bf16": (32, 8, 128, torch.bfloat16, 1, 8, "fp8"),
}
for name, (h, kvh, d, dtype, max_q, splits, *kv) in CASES.items():
    num_tokens, num_seqs, num_blocks, block_size = 64, 8, 64, 16
    query = torch.empty(num_tokens, h, d, dtype=dtype)
    kv_quant = KVQuant(kv[0]) if kv else None
    cache = (torch.empty(num_blocks, block_size, kvh, kv_quant.cache_head_dim(d), dtype=kv_quant.storage_dtype)
             if kv_quant else torch.empty(num_blocks, block_size, kvh, d, dtype=dtype))
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32)
    tables = torch.zeros(num_seqs, 32, dtype=torch.int32)
    for launch in plan_launches(query, cache, cache, tables, seq_lens, qsl, d ** -0.5, torch.empty_like(query),
                                max_query_len=max_q, num_kv_splits=splits, kv_quant=kv_quant):
        print(json.dumps(dict(case=name, **compile_launch(launch))), flush=True)
'''


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_every_launch_compiles_for_hopper_without_spills(compiled):
    kernels = {(r["case"], r["kernel"]) for r in compiled}
    assert len(compiled) == 16 and len(kernels) == 16        # 8 two-D cases + 4 x (3-D + reduce)
    for r in compiled:
        assert r["spills"] == 0, r
        assert 0 < r["regs"] <= 255, r
        assert r["shared"] <= 227 * 1024, r                  # H100: 227 KB of shared memory per block


def test_tile_shapes_are_the_ones_the_wrapper_picks(compiled):
    blocks = {r["case"]: r["BLOCK_M"] for r in compiled if r["kernel"] == "kernel_unified_attention_2d"}
    assert blocks == {"smollm2-decode-fp16": 16, "smollm2-prefill-bf16": 64, "qwen3-0.6b-decode-bf16": 16,
                      "smollm2-mixed-fp32-ieee": 16, "llama8b-prefill-bf16": 64, "d256-prefill-bf16": 32,
                      "smollm2-decode-int8kv-bf16": 16, "qwen3-0.6b-decode-fp8kv-rows-bf16": 16}
    # 16-bit pure decode streams K/V in 64-key tiles through a 4-stage pipeline; the rest keep 32 keys.
    decode = {(r["case"], r["kernel"]): (r["TILE_N"], r["num_stages"]) for r in compiled
              if r["kernel"] != "reduce_segments"}
    assert decode[("qwen3-0.6b-decode-bf16", "kernel_unified_attention_2d")] == (64, 4)
    assert decode[("llama8b-decode-split-kv-bf16", "kernel_unified_attention_3d")] == (64, 4)
    assert decode[("smollm2-prefill-bf16", "kernel_unified_attention_2d")][0] == 32
