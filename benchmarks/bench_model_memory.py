"""Resident memory of the loaded default model (SmolLM2-135M-Instruct, fp32, CPU), three ways:
plain `F.linear` weights, oneDNN-packed weights with the unpacked copies kept, and packed with
the unpacked copies dropped (what the engine does: vLLM's `dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`).

    python -m benchmarks.bench_model_memory

Each configuration loads the model in a fresh process and reports VmRSS after loading minus
VmRSS after `import torch` (so the interpreter and torch itself are not counted).
Writes benchmarks/results/model_memory.json.
"""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import write_result

CHILD = """
import json, sys
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import torch
base = rss_mb()
from mini_vllm.config import ModelConfig
from mini_vllm.models.loader import get_model, load_weights, iterate_weights, process_weights_after_loading
from mini_vllm.default_model import default_model_path
config = ModelConfig.from_pretrained(default_model_path())
backend, remove = sys.argv[1], sys.argv[2] == "drop"
model = get_model(config, cpu_gemm_backend="torch")
if backend == "onednn":
    process_weights_after_loading(model, "onednn", remove_weight=remove)
import gc; gc.collect()
print(json.dumps({"rss_mb": rss_mb() - base}))
"""

CONFIGS = [("F.linear (unpacked)", "torch", "keep"), ("oneDNN packed, unpacked kept", "onednn", "keep"),
           ("oneDNN packed, unpacked dropped (engine)", "onednn", "drop")]


def measure(backend: str, remove: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, backend, remove], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_mb"]


def main() -> list[dict]:
    rows = [{"config": name, "rss_mb": round(measure(backend, remove), 1)} for name, backend, remove in CONFIGS]
    for row in rows:
        print(f"{row['config']:45s} {row['rss_mb']:8.1f} MB")
    write_result("model_memory", {"model": "SmolLM2-135M-Instruct", "dtype": "float32",
                                  "measure": "VmRSS after loading minus VmRSS after import torch"}, rows)
    return rows


if __name__ == "__main__":
    main()
