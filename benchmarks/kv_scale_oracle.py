"""Our fp8 KV-cache scales against llmcompressor's on the same calibration windows, and the
engine on llmcompressor's checkpoint — in one run, here.

    python -m benchmarks.kv_scale_oracle            # SmolLM2-135M, 8 windows of 128 tokens, both observers

For each observer ("static_minmax": the largest |K| / |V| written; "minmax": llmcompressor's
default, a moving average of each window's): llmcompressor 0.14 (.venv-quant,
kv_scale_oracle_llmc.py) writes a checkpoint with a kv_cache_scheme; `quantization.kv_scales`
calibrates on the same token ids; reported: ours ÷ theirs for every layer's k_scale and v_scale.
Then our engine loads llmcompressor's checkpoint with kv_cache_dtype="fp8": the scales its
attention layers use must be the file's, and it generates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import write_result

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-quant"


def llmc_checkpoint(model: Path, ids: Path, out: Path, observer: str) -> Path:
    if not (out / "model.safetensors").exists():
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
        subprocess.run([str(VENV / "bin" / "python"), str(REPO / "benchmarks" / "kv_scale_oracle_llmc.py"),
                        "--ids", str(ids), "--model", str(model), "--out", str(out), "--observer", observer],
                       check=True, env=env, cwd=REPO)
    return out


def file_scales(path: Path) -> dict[str, float]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: float(f.get_tensor(k)) for k in f.keys() if k.endswith((".k_scale", ".v_scale"))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--work", type=Path, default=REPO / "build" / "kv_scale_oracle")
    args = ap.parse_args(argv)
    if not (VENV / "bin" / "python").exists():
        sys.exit(f"needs llmcompressor in {VENV} (see 10_quantization/README.md)")
    from transformers import AutoTokenizer

    from mini_vllm import LLM, SamplingParams, default_model_path
    from mini_vllm.models.attention import PagedAttention
    from quantization.calibration import calibration_samples
    from quantization.kv_scales import calibrate_kv_scales

    model = Path(default_model_path())
    args.work.mkdir(parents=True, exist_ok=True)
    ids = args.work / "ids.json"
    samples = calibration_samples(AutoTokenizer.from_pretrained(model), args.windows, args.seq_len)
    ids.write_text(json.dumps(samples.tolist()))
    rows = []
    for observer in ("static_minmax", "minmax"):
        ckpt = llmc_checkpoint(model, ids, args.work / f"llmc_{observer}", observer)
        theirs = file_scales(ckpt)
        ours = calibrate_kv_scales(model, args.windows, args.seq_len, observer=observer)
        ratios = [float(ours[k]) / theirs[k] for k in sorted(theirs)]
        llm = LLM(str(ckpt), kv_cache_dtype="fp8", max_model_len=512, seed=0)
        layers = [m for m in llm.llm_engine.engine_core.model_runner.model.modules() if isinstance(m, PagedAttention)]
        used = {f"model.layers.{i}.self_attn.{w}_scale": getattr(m.kv_quant, f"{w}_scale")
                for i, m in enumerate(layers) for w in "kv"}
        text = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
        rows.append(dict(observer=observer, layers=len(layers), scales=len(ratios),
                         ours_over_llmcompressor_min=min(ratios), ours_over_llmcompressor_median=statistics.median(ratios),
                         ours_over_llmcompressor_max=max(ratios),
                         engine_uses_the_files_scales=all(abs(used[k] - theirs[k]) <= 1e-7 * theirs[k] for k in theirs),
                         engine_text=text))
        print(rows[-1], flush=True)
        del llm
    print(write_result("kv_scale_oracle", dict(model="SmolLM2-135M-Instruct", windows=args.windows,
                                               seq_len=args.seq_len, llmcompressor="0.14"), rows))


if __name__ == "__main__":
    main()
