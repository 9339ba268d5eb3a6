"""Serving benchmark in `vllm bench serve`'s shape: our OpenAI server and real vLLM's, the same
client, the same model, the same CPU, one after the other.

    python -m benchmarks.bench_serve                       # ours + vLLM's server, 3 runs per rate, ~30 min on 2 cores
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
chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency; per run: p50 and
p99 of each, request and output-token throughput, and goodput — requests per second that met
the SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, vLLM's `--goodput`). Each rate runs
--repeats times (fresh prompts and arrivals each time): the p99 of 40 requests moves by hundreds
of milliseconds from run to run on a shared 2-core machine, so the summary is the median of the
runs' metrics, with the range of the p99s beside it. Every run keeps its per-request timeline.

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
async def one_request(session, url: str, prompt: str, max_tokens: int, start: float) -> dict:
    """One streamed completion; `start` is the rate's clock origin (the record says when it was sent)."""
    import aiohttp

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    sent = t0 - start
    ttft, chunk_times, usage, error = None, [], None, None
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=1800)) as r:
            if r.status != 200:
                return dict(ok=False, sent=sent, error=f"HTTP {r.status}: {(await r.text())[:200]}")
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
        return dict(ok=False, sent=sent, error=str(error or "no tokens or no usage"))
    n_out = usage["completion_tokens"]
    return dict(ok=True, sent=sent, ttft=ttft, latency=latency, output_tokens=n_out, prompt_tokens=usage["prompt_tokens"],
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
            tasks.append(asyncio.create_task(one_request(session, url, prompt, n_out, t0)))
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
                  vllm_client=None, repeats: int = 1, cool_down_s: float = 0.0) -> tuple[list[dict], dict]:
    """Start every server (side by side, idle until asked), then at each rate run the same
    arrivals against each in turn — the order flipping from run to run — so that a shared
    machine's drift falls on both alike. Each run sends prompts of its own
    (`workloads[i * repeats + r]` for rate i, repeat r): prompts sent earlier would be
    prefix-cache hits on both servers, and the TTFT measured would be a cache's, not a prefill's.
    A repeat also draws its own arrival times (seed + r). Each run starts `cool_down_s` after the
    previous one ended: a server goes on using the CPU for a moment after its last answer (vLLM's
    worker kept a core ~1.3 s busy here), and that must not fall on the next server's first requests."""
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
            for r in range(repeats):
                run = i * repeats + r
                order = list(starters) if run % 2 == 0 else list(reversed(starters))
                for label in order:
                    time.sleep(cool_down_s)
                    results, duration = asyncio.run(run_rate(urls[label], workloads[run], rate, seed + r))
                    row = dict(server=label, request_rate=rate, repeat=r, **summarize(results, duration, *slo))
                    print(row, flush=True)
                    rows.append(dict(row, requests=timeline(results)))
        if vllm_client is not None:
            for label in starters:
                info[label]["vllm_bench_client"] = vllm_client(urls[label])
                print(label, "vLLM's client:", info[label]["vllm_bench_client"], flush=True)
        return rows, info
    finally:
        for proc in procs.values():
            stop(proc)


TIMELINE_FIELDS = ("sent_s", "ttft_ms", "latency_ms", "prompt_tokens", "output_tokens")


def timeline(results: list[dict]) -> list[list | None]:
    """Every request of a run as [sent_s, ttft_ms, latency_ms, prompt_tokens, output_tokens] (None if it
    failed), in the order sent: where a p99 came from — one stall, or a queue that kept growing."""
    return [[round(r["sent"], 3), round(1e3 * r["ttft"], 1), round(1e3 * r["latency"], 1), r["prompt_tokens"],
             r["output_tokens"]] if r["ok"] else None for r in results]


MEDIAN_KEYS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
               "output_throughput", "goodput", "slo_met_fraction")


def median_over_repeats(rows: list[dict]) -> list[dict]:
    """One row per (server, rate): the median over repeats of each metric, each computed per run
    (a median of p99s, not a p99 of the pooled requests: each run is one sample of the p99), and the
    range of the p99s — how far one run's p99 can be from another's on this machine."""
    out = []
    for server in dict.fromkeys(r["server"] for r in rows):
        for rate in dict.fromkeys(r["request_rate"] for r in rows):
            runs = [r for r in rows if r["server"] == server and r["request_rate"] == rate]
            if not runs:
                continue
            row = dict(server=server, request_rate=rate, repeats=len(runs),
                       failed=sum(r["failed"] for r in runs))
            for key in MEDIAN_KEYS:
                row[key] = round(statistics.median(r[key] for r in runs), 3)
            for key in ("p99_ttft_ms", "p99_tpot_ms"):
                row[key + "_range"] = [min(r[key] for r in runs), max(r[key] for r in runs)]
            out.append(row)
    return out


def paired_ttft(rows: list[dict], ours: str, peer: str) -> list[dict]:
    """Request by request: both servers got the same prompts at the same offsets in each run, so the
    ratio of one request's TTFT on ours to its TTFT on the peer compares like with like — far less
    noisy than two p99s, each set by one request. Per rate: the median over runs of each run's median
    ratio, and the fraction of requests ours answered first."""
    out = []
    for rate in dict.fromkeys(r["request_rate"] for r in rows):
        per_run = []
        for rep in sorted({r["repeat"] for r in rows if r["request_rate"] == rate}):
            pick = {r["server"]: r["requests"] for r in rows if r["request_rate"] == rate and r["repeat"] == rep}
            if ours not in pick or peer not in pick:
                continue
            pairs = [(a[1], b[1]) for a, b in zip(pick[ours], pick[peer]) if a is not None and b is not None]
            if pairs:
                per_run.append((statistics.median(a / b for a, b in pairs), sum(a < b for a, b in pairs) / len(pairs)))
        if per_run:
            out.append(dict(request_rate=rate, runs=len(per_run),
                            median_ttft_ratio=round(statistics.median(m for m, _ in per_run), 3),
                            median_ttft_ratio_per_run=[round(m, 3) for m, _ in per_run],
                            ours_first_fraction=round(statistics.median(f for _, f in per_run), 3)))
    return out


def plot(summary: list[dict], rows: list[dict], path: Path, slo) -> None:
    """Latency and goodput against the rate, per server: the medians over repeats, with bars from the
    lowest to the highest run's p99 when there was more than one run; and, at the highest rate, each
    request's TTFT against when it was sent (first run): a queue that grows, or one stall."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    top = max(r["request_rate"] for r in rows)
    for r in rows:
        if r["request_rate"] == top and r["repeat"] == 0:
            done = [q for q in r["requests"] if q is not None]
            axes[3].plot([q[0] for q in done], [q[1] / 1e3 for q in done], "o", ms=3, label=r["server"])
    axes[3].set_xlabel("sent at (s from the run's first request)")
    axes[3].set_title(f"TTFT (s) of each request at {top:g} req/s (first run)", fontsize=10)
    axes[3].grid(alpha=0.3)
    axes[3].legend(fontsize=8)
    for server in dict.fromkeys(r["server"] for r in summary):
        rs = [r for r in summary if r["server"] == server]
        x = [r["request_rate"] for r in rs]
        for ax, key, scale in ((axes[0], "ttft_ms", 1e-3), (axes[1], "tpot_ms", 1.0)):
            p99 = [r[f"p99_{key}"] * scale for r in rs]
            spread = [[(m - r[f"p99_{key}_range"][0] * scale) for m, r in zip(p99, rs)],
                      [(r[f"p99_{key}_range"][1] * scale - m) for m, r in zip(p99, rs)]]
            line = ax.errorbar(x, p99, yerr=spread, fmt="o-", capsize=3, label=f"{server} p99")
            ax.plot(x, [r[f"p50_{key}"] * scale for r in rs], "o--", color=line[0].get_color(),
                    label=f"{server} p50")
        axes[2].plot(x, [r["goodput"] for r in rs], "o-", label=server)
    axes[0].axhline(slo[0] / 1e3, color="grey", lw=0.8)
    axes[1].axhline(slo[1], color="grey", lw=0.8)
    repeats = max(r["repeats"] for r in summary)
    runs = f"median of {repeats} runs, bars: their range" if repeats > 1 else "one run"
    for ax, title in zip(axes, (f"TTFT (s), {runs}", f"TPOT (ms), {runs}",
                                f"goodput (req/s), SLO TTFT<={slo[0]:.0f} ms, TPOT<={slo[1]:.0f} ms")):
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
    for flag in ("rates", "num_prompts", "repeats", "cool_down_s", "seed", "slo_ttft_ms", "slo_tpot_ms",
                 "vllm_client_rate"):
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
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per rate, each with its own prompts and arrivals; the summary is their median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--cool-down-s", type=float, default=5.0,
                    help="seconds of quiet before each run (the previous server's last work must not fall on it)")
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
        args.rates, args.num_prompts, args.repeats, args.cool_down_s, args.skip_vllm = [4.0, 16.0], 8, 2, 0.0, True
        specs = (SMOKE_PROMPT_LEN, SMOKE_OUTPUT_LEN)
    else:
        model_dir = default_model_path()
        specs = (PROMPT_LEN, OUTPUT_LEN)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    # One set of prompts per run (and one for the warm-up, the last): no prefix-cache hit across runs.
    num_runs = len(args.rates) * args.repeats
    workloads = [make_workload(tokenizer, args.num_prompts, args.seed + i, *specs) for i in range(num_runs + 1)]
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
                                      vllm_client if run_vllm else None, args.repeats, args.cool_down_s)
    except ServerStartError as e:
        if not run_vllm or e.label != "vllm":
            raise
        reason, run_vllm = f"the vLLM server did not start: {e}", False      # ours alone, and say why
        rows, servers = bench_servers({"mini_vllm": starters["mini_vllm"]}, workloads, args.rates, args.seed, slo,
                                      tmp_dir, repeats=args.repeats, cool_down_s=args.cool_down_s)
    summary = median_over_repeats(rows)
    max_rate_meeting_slo = {}
    for server in servers:
        ok = [r["request_rate"] for r in summary if r["server"] == server and r["slo_met_fraction"] >= 0.9
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
        repeats=args.repeats,
        prompts_per_run="drawn afresh for each run of each rate (seed + run index), arrivals by seed + repeat: "
                        "no prefix-cache hit across runs",
        greedy=True, ignore_eos=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=64, cool_down_s=args.cool_down_s,
        slo=dict(ttft_ms=slo[0], tpot_ms=slo[1],
                 met_when="at least 90% of requests meet both (the median over repeats), none failed"),
        timeline_fields=TIMELINE_FIELDS,
        servers=servers, max_rate_meeting_slo=max_rate_meeting_slo, vllm=vllm_version,
        vllm_peer=None if run_vllm else reason,
        vllm_bench_client=dict(dataset="random", input_len=mean_in, output_len=mean_out,
                               num_prompts=args.num_prompts, request_rate=args.vllm_client_rate),
        command=command_of(args, ap))
    paired = paired_ttft(rows, "mini_vllm", "vllm") if run_vllm else []
    if paired:
        print("TTFT ours / vLLM, request by request:", paired, flush=True)
    path = write_result(name, workload_info, rows, args.out_dir, median_over_repeats=summary, paired_ttft=paired)
    plot(summary, rows, args.out_dir / f"{name}.png", slo)
    print(f"wrote {path}; highest rate meeting the SLO: {max_rate_meeting_slo}", flush=True)
    tmp.cleanup()
    return dict(rows=rows, summary=summary, paired_ttft=paired, workload=workload_info)


if __name__ == "__main__":
    main()
