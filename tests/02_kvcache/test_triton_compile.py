"""The Triton block-move kernel compiles for Hopper (sm_90) without a GPU, with 16-byte
vector accesses when the host promises alignment and no register spills. Runs in a
subprocess because the rest of the suite imports Triton in interpreter mode."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, pathlib, re, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcache.triton_ops import _move_blocks_kernel

ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
sig = {"src_ptrs": "*i64", "dst_ptrs": "*i64", "block_mapping": "*i64", "words_per_block": "i64",
       "WORD": "constexpr", "CHUNK": "constexpr", "ALIGNED16": "constexpr"}
out = {}
for word in ("int64", "int32", "int16", "int8"):
    for aligned in (False, True):
        src = ASTSource(_move_blocks_kernel, sig, {"WORD": getattr(tl, word), "CHUNK": 1024, "ALIGNED16": aligned},
                        attrs={(3,): [["tt.divisibility", 16]]})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        ptx = k.asm["ptx"]
        with tempfile.TemporaryDirectory() as d:
            p = pathlib.Path(d) / "k.ptx"
            p.write_text(ptx)
            rep = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(p), "-o", str(pathlib.Path(d) / "k.cubin")],
                                 capture_output=True, text=True, check=True)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep.stdout + rep.stderr)]
        vec = any(re.search(r"ld\.global(\.\w+)*\.v\d", l) for l in ptx.splitlines())
        out[f"{word}/{aligned}"] = {"cubin": len(k.asm["cubin"]), "spills": spills, "vector": vec}
print(json.dumps(out))
"""


def test_move_blocks_kernel_compiles_for_hopper():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 8
    for variant, r in report.items():
        assert r["cubin"] > 0, variant
        assert not any(r["spills"]), f"{variant} spills registers: {r}"
    # With the alignment promise the copy uses 16-byte vector accesses (int64/int32 words);
    # without it, one access per word.
    assert report["int64/True"]["vector"] and report["int32/True"]["vector"]
    assert not report["int64/False"]["vector"]
