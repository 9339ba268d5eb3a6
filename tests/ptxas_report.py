"""ptxas's report on one Triton kernel compiled for Hopper (sm_90a): registers, spill bytes, cubin
size. Imported by the compile scripts that chapters' tests run in a subprocess (TRITON_INTERPRET=0,
which this test session may have switched on); they put this folder on sys.path from argv[1]."""
import os
import re
import subprocess
import tempfile

import triton.backends.nvidia as nvidia

PTXAS = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")


def ptxas_report(kernel, label: str) -> dict:
    """{label, spills (bytes of spill stores), regs, cubin (bytes)} for a triton.compile() result.
    ptxas's input and output live in a temporary folder, gone afterwards."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", ptx + ".cubin"],
                             capture_output=True, text=True, check=True).stderr
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    return {"label": label, "spills": spills, "regs": regs, "cubin": len(kernel.asm["cubin"])}
