"""The rejection-sampling Triton kernel compiles for Hopper (sm_90) without a GPU, in every
constexpr configuration the dispatcher uses, and ptxas reports no register spills. Runs in
a subprocess with TRITON_INTERPRET=0 (this session may have the interpreter on)."""
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
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spec_decode import triton_ops as T
from ptxas_report import ptxas_report

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {"out_ptr": "*i32", "cu_num_draft_ptr": "*i32", "draft_ptr": "*i32", "draft_probs_ptr": "*fp32",
        "target_probs_ptr": "*fp32", "target_argmax_ptr": "*i32", "bonus_ptr": "*i32", "is_greedy_ptr": "*i8",
        "uniform_ptr": "*fp32", "inv_exp_ptr": "*fp32"}
results = []
fn = T._rejection_sample_kernel
for no_q in (False, True):
    for greedy, rand in ((True, True), (False, True), (True, False)):
        const = dict(NO_DRAFT_PROBS=no_q, HAS_GREEDY=greedy, HAS_RANDOM=rand, BLOCK_S=8, BLOCK_V=T.DEFAULT_BLOCK_V)
        sig = {n: ("constexpr" if n in const else PTRS.get(n, "i32")) for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, const), target=TARGET)
        label = f"q{int(not no_q)}_g{int(greedy)}_r{int(rand)}"
        results.append(ptxas_report(kernel, label))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(TESTS_DIR)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_configuration_compiles_for_sm90(compiled):
    assert len(compiled) == 6
    assert all(r["cubin"] > 0 for r in compiled)


def test_no_register_spills(compiled):
    assert not [r for r in compiled if r["spills"]], compiled
