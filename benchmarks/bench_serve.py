"""Serving benchmark in `vllm bench serve`'s shape: our OpenAI server and real vLLM's, the same
client, the same model, the same CPU, one after the other.

    python -m benchmarks.bench_serve                       # ours + vLLM's server, ~10 min on 2 cores
    python -m benchmarks.bench_serve --smoke               # tiny random model, ours only, seconds
    python -m benchmarks.bench_serve --vllm-venv /path/to/.venv-vllm   # where benchmarks.vllm_peer set it up

Workload (fixed by --seed; fresh prompts at each rate): prompts are windows of real English text (the Python documentation
every Python installation ships, as bench_engine's), sent as text to /v1/completions with
stream=True, ignore_eos and max_tokens = the drawn output length. Lengths follow a ShareGPT-like
long-tailed distribution — lognormal, as the ShareGPT conversations vLLM benchmarks on are —
scaled down for a 2-core CPU: prompt tokens median 128 (sigma 0.7, clipped to 16..768), output
tokens median 48 (sigma 0.6, clipped to 8..160).

Arrivals are Poisson at each rate of --rates (exponential gaps, vLLM's `--request-rate` with
burstiness 1). Per request the client records TTFT (send -> first text chunk), ITL (gaps between
chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency; per rate: p50 and
p99 of each, request and output-token throughput, and goodput — requests per second that met
the SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, vLLM's `--goodput`).

Peers: vLLM 0.32's OpenAI server from the side venv (`python -m vllm.entrypoints.openai.api_server`,
both cores: VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0, 2 GiB KV cache as our
default); and vLLM's own benchmark client (`vllm.benchmarks.serve`: add_cli_args + main, run in
that venv) against both servers at one rate — a client nobody here wrote must work against ours.
Writes benchmarks/results/serve.json and serve.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_engine import real_text_corpus, tiny_model_dir
from benchmarks.common import RESULTS_DIR, write_result
from benchmarks.vllm_peer import CONFIGS, VENV, peer_env, unavailable_reason, venv_python

REPO = Path(__file__).resolve().parent.parent
PROMPT_LEN = dict(median=128, sigma=0.7, lo=16, hi=768)
OUTPUT_LEN = dict(median=48, sigma=0.6, lo=8, hi=160)
SMOKE_PROMPT_LEN = dict(median=24, sigma=0.5, lo=8, hi=64)
SMOKE_OUTPUT_LEN = dict(median=8, sigma=0.5, lo=4, hi=16)
MAX_MODEL_LEN = 1024
SERVED_NAME = "bench-model"


# ------------------------------------------------------------------------------ the workload
def lognormal_lengths(rng: random.Random, n: int, spec: dict) -> list[int]:
    return [min(spec["hi"], max(spec["lo"], round(rng.lognormvariate(math.log(spec["median"]), spec["sigma"]))))
            for _ in range(n)]


def make_workload(tokenizer, num_prompts: int, seed: int, prompt_spec=PROMPT_LEN, output_spec=OUTPUT_LEN):
    """[(prompt text, prompt tokens, output tokens)]: windows of the corpus, decoded back to text."""
    rng = random.Random(seed)
    corpus = tokenizer(real_text_corpus()).input_ids
    out = []
    for p_len, o_len in zip(lognormal_lengths(rng, num_prompts, prompt_spec),
                            lognormal_lengths(rng, num_prompts, output_spec)):
        start = rng.randrange(0, len(corpus) - p_len)
        out.append((tokenizer.decode(corpus[start:start + p_len]), p_len, o_len))
    return out


# ------------------------------------------------------------------------------ the client
async def one_request(session, url: str, prompt: str, max_tokens: int) -> dict:
    import aiohttp

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunk_times, usage, error = None, [], None, None
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=1800)) as r:
            if r.status != 200:
                return dict(ok=False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                now = time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices") and event["choices"][0].get("text"):
                    if ttft is None:
                        ttft = now - t0
                    chunk_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = repr(e)
    latency = time.perf_counter() - t0
    if error is not None or ttft is None or usage is None:
        return dict(ok=False, error=str(error or "no tokens or no usage"))
    n_out = usage["completion_tokens"]
    return dict(ok=True, ttft=ttft, latency=latency, output_tokens=n_out, prompt_tokens=usage["prompt_tokens"],
                tpot=(latency - ttft) / (n_out - 1) if n_out > 1 else 0.0,
                itl=[b - a for a, b in zip(chunk_times, chunk_times[1:])])


async def run_rate(url: str, workload, rate: float, seed: int) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` requests/s -> (per-request results, seconds from first send to last answer)."""
    import aiohttp

    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        tasks = []
        for prompt, _, n_out in workload:
            tasks.append(asyncio.create_task(one_request(session, url, prompt, n_out)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[dict], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: [1e3 * x for x in xs]                      # noqa: E731
    ttft, tpot, e2e = ms([r["ttft"] for r in ok]), ms([r["tpot"] for r in ok]), ms([r["latency"] for r in ok])
    itl = ms([x for r in ok for x in r["itl"]])
    good = [r for r in ok if 1e3 * r["ttft"] <= slo_ttft_ms and 1e3 * r["tpot"] <= slo_tpot_ms]
    row = dict(completed=len(ok), failed=len(results) - len(ok), duration_s=round(duration, 2),
               request_throughput=round(len(ok) / duration, 3),
               output_throughput=round(sum(r["output_tokens"] for r in ok) / duration, 1),
               goodput=round(len(good) / duration, 3), slo_met_fraction=round(len(good) / len(results), 3))
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        row[f"p50_{name}"] = round(percentile(xs, 50), 1)
        row[f"p99_{name}"] = round(percentile(xs, 99), 1)
    errors = sorted({r["error"] for r in results if not r["ok"]})
    if errors:
        row["errors"] = errors[:3]
    return row


# ------------------------------------------------------------------------------ the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ours(model_dir: Path, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mini_vllm", "serve", str(model_dir), "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--served-model-name", SERVED_NAME,
           "--disable-log-stats"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_vllm(python: Path, model_dir: Path, port: int, log) -> subprocess.Popen:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
           "--served-model-name", SERVED_NAME, "--disable-log-stats"]
    env = peer_env(VLLM_CPU_KVCACHE_SPACE="2", **CONFIGS["both cores"])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (its engine process too), then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


VLLM_CLIENT = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def run_vllm_client(python: Path, url: str, model_dir: Path, rate: float, num_prompts: int, out_dir: Path,
                    name: str, slo_ttft_ms: float, slo_tpot_ms: float, input_len: int, output_len: int) -> dict:
    """vLLM's own benchmark client (random dataset) against `url`; returns the metrics it saved."""
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
            "50,99", "--goodput", f"ttft:{slo_ttft_ms}", f"tpot:{slo_tpot_ms}", "--save-result", "--result-dir",
            str(out_dir), "--result-filename", f"{name}.json", "--disable-tqdm", "--num-warmups", "0",
            "--temperature", "0"]       # greedy, as our client asks (vLLM's client leaves it to the server)
    proc = subprocess.run([str(python), "-c", VLLM_CLIENT, *args], capture_output=True, text=True, env=peer_env(),
                          timeout=1800)
    if proc.returncode != 0 or not (out_dir / f"{name}.json").exists():
        return dict(ok=False, returncode=proc.returncode, error=client_error(proc.stdout + proc.stderr))
    data = json.loads((out_dir / f"{name}.json").read_text())
    keep = ("completed", "failed", "request_throughput", "output_throughput", "request_goodput", "p50_ttft_ms",
            "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms")
    return dict(ok=True, **{k: round(data[k], 3) if isinstance(data.get(k), float) else data.get(k) for k in keep})


NOISE = ("nanobind:", " - leaked", "Triton is installed", "See https://nanobind")


def client_error(output: str) -> str:
    """The last lines of a failed client's output that say something (not the Triton/nanobind chatter
    every vLLM-CPU process prints at exit)."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip() and not ln.startswith(NOISE)]
    return " | ".join(lines[-4:])[-600:] or "no output"


class ServerStartError(RuntimeError):
    def __init__(self, label: str, message: str):
        super().__init__(f"{label}: {message}")
        self.label = label


def bench_servers(starters: dict, workloads: list, rates, seed: int, slo, log_dir: Path,
                  vllm_client=None) -> tuple[list[dict], dict]:
    """Start every server (side by side, idle until asked), then at each rate run the same
    arrivals against each in turn — the order flipping from rate to rate — so that a shared
    machine's drift falls on both alike. Each rate sends prompts of its own (`workloads[i]`):
    prompts sent at an earlier rate would be prefix-cache hits on both servers, and the TTFT
    measured would be a cache's, not a prefill's."""
    procs, urls, info = {}, {}, {}
    try:
        for label, start in starters.items():
            port = free_port()
            urls[label] = f"http://127.0.0.1:{port}"
            procs[label] = start(port, open(log_dir / f"{label}.log", "w"))
        for label in starters:
            try:
                info[label] = dict(startup_s=round(wait_ready(urls[label], procs[label], timeout=900), 1))
            except (RuntimeError, TimeoutError) as e:
                tail = (log_dir / f"{label}.log").read_text()[-1500:]
                raise ServerStartError(label, f"{e}; its log ends: {tail}") from None
            # Warm-up: two requests (kernels, allocator), not timed.
            asyncio.run(run_rate(urls[label], workloads[-1][:2], 100.0, seed))
        rows = []
        for i, rate in enumerate(rates):
            order = list(starters) if i % 2 == 0 else list(reversed(starters))
            for label in order:
                results, duration = asyncio.run(run_rate(urls[label], workloads[i], rate, seed))
                row = dict(server=label, request_rate=rate, **summarize(results, duration, *slo))
                print(row, flush=True)
                rows.append(row)
        if vllm_client is not None:
            for label in starters:
                info[label]["vllm_bench_client"] = vllm_client(urls[label])
                print(label, "vLLM's client:", info[label]["vllm_bench_client"], flush=True)
        return rows, info
    finally:
        for proc in procs.values():
            stop(proc)


def plot(rows: list[dict], path: Path, slo) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for server in sorted({r["server"] for r in rows}):
        rs = [r for r in rows if r["server"] == server]
        x = [r["request_rate"] for r in rs]
        axes[0].plot(x, [r["p99_ttft_ms"] / 1e3 for r in rs], "o-", label=f"{server} p99")
        axes[0].plot(x, [r["p50_ttft_ms"] / 1e3 for r in rs], "o--", label=f"{server} p50")
        axes[1].plot(x, [r["p99_tpot_ms"] for r in rs], "o-", label=f"{server} p99")
        axes[1].plot(x, [r["p50_tpot_ms"] for r in rs], "o--", label=f"{server} p50")
        axes[2].plot(x, [r["goodput"] for r in rs], "o-", label=server)
    axes[0].axhline(slo[0] / 1e3, color="grey", lw=0.8)
    axes[1].axhline(slo[1], color="grey", lw=0.8)
    for ax, title in zip(axes, ("TTFT (s)", "TPOT (ms)", f"goodput (req/s), SLO TTFT<={slo[0]:.0f} ms, TPOT<={slo[1]:.0f} ms")):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_of(args, ap: argparse.ArgumentParser) -> str:
    """The command that reproduces the JSON: every flag that changes what is measured and is not
    its default (not --out-dir: where the files go; a venv is named PATH)."""
    parts = ["python -m benchmarks.bench_serve"]
    if args.smoke:                           # its own rates, prompts and server set
        return parts[0] + " --smoke"
    if args.skip_vllm:
        parts.append("--skip-vllm")
    for flag in ("rates", "num_prompts", "seed", "slo_ttft_ms", "slo_tpot_ms", "vllm_client_rate"):
        value = getattr(args, flag)
        if value != ap.get_default(flag):
            values = value if isinstance(value, list) else [value]
            parts.append("--" + flag.replace("_", "-") + " " + " ".join(f"{v:g}" if isinstance(v, float) else str(v)
                                                                          for v in values))
    if args.vllm_venv != VENV:
        parts.append("--vllm-venv PATH")
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--vllm-venv", type=Path, default=VENV)
    ap.add_argument("--skip-vllm", action="store_true", help="our server only")
    ap.add_argument("--vllm-client-rate", type=float, default=1.0, help="the rate vLLM's own client runs at")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, our server only, a few requests")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path

    tmp = tempfile.TemporaryDirectory()
    tmp_dir = Path(tmp.name)
    if args.smoke:
        model_dir = tiny_model_dir(tmp_dir)
        args.rates, args.num_prompts, args.skip_vllm = [4.0, 16.0], 8, True
        specs = (SMOKE_PROMPT_LEN, SMOKE_OUTPUT_LEN)
    else:
        model_dir = default_model_path()
        specs = (PROMPT_LEN, OUTPUT_LEN)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # One set of prompts per rate (and one for the warm-up, the last): no prefix-cache hit across rates.
    workloads = [make_workload(tokenizer, args.num_prompts, args.seed + i, *specs) for i in range(len(args.rates) + 1)]
    workload = [w for ws in workloads[:-1] for w in ws]
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    python = venv_python(args.vllm_venv)
    reason = "skipped (--skip-vllm)" if args.skip_vllm else (unavailable_reason(args.vllm_venv) if python else
                                                              f"no venv at {args.vllm_venv}")
    run_vllm = reason is None
    mean_in = round(statistics.mean(p for _, p, _ in workload))
    mean_out = round(statistics.mean(o for _, _, o in workload))

    def vllm_client(url):
        return run_vllm_client(python, url, model_dir, args.vllm_client_rate, args.num_prompts, tmp_dir,
                               f"client-{time.time_ns()}", *slo, mean_in, mean_out)

    starters = {"mini_vllm": lambda port, log: start_ours(model_dir, port, log)}
    if run_vllm:
        starters["vllm"] = lambda port, log: start_vllm(python, model_dir, port, log)
    try:
        rows, servers = bench_servers(starters, workloads, args.rates, args.seed, slo, tmp_dir,
                                      vllm_client if run_vllm else None)
    except ServerStartError as e:
        if not run_vllm or e.label != "vllm":
            raise
        reason, run_vllm = f"the vLLM server did not start: {e}", False      # ours alone, and say why
        rows, servers = bench_servers({"mini_vllm": starters["mini_vllm"]}, workloads, args.rates, args.seed, slo,
                                      tmp_dir)
    max_rate_meeting_slo = {}
    for server in servers:
        ok = [r["request_rate"] for r in rows if r["server"] == server and r["slo_met_fraction"] >= 0.9
              and r["failed"] == 0]
        max_rate_meeting_slo[server] = max(ok) if ok else 0.0
    name = "serve_smoke" if args.smoke else "serve"
    vllm_version = None
    if run_vllm:
        vllm_version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                      capture_output=True, text=True, env=peer_env()).stdout.strip()
    workload_info = dict(
        model=Path(model_dir).name, dtype="float32", device="cpu", num_prompts=args.num_prompts, rates=args.rates,
        prompt_len=specs[0], output_len=specs[1], mean_prompt_tokens=mean_in, mean_output_tokens=mean_out,
        text="windows of the Python documentation (pydoc_data.topics), sent as text", arrivals="Poisson",
        prompts_per_rate="drawn afresh at each rate (seed + rate index): no prefix-cache hit across rates",
        greedy=True, ignore_eos=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
        slo=dict(ttft_ms=slo[0], tpot_ms=slo[1], met_when="at least 90% of requests meet both"),
        servers=servers, max_rate_meeting_slo=max_rate_meeting_slo, vllm=vllm_version,
        vllm_peer=None if run_vllm else reason,
        vllm_bench_client=dict(dataset="random", input_len=mean_in, output_len=mean_out,
                               num_prompts=args.num_prompts, request_rate=args.vllm_client_rate),
        command=command_of(args, ap))
    path = write_result(name, workload_info, rows, args.out_dir)
    plot(rows, args.out_dir / f"{name}.png", slo)
    print(f"wrote {path}; highest rate meeting the SLO: {max_rate_meeting_slo}", flush=True)
    tmp.cleanup()
    return dict(rows=rows, workload=workload_info)


if __name__ == "__main__":
    main()
