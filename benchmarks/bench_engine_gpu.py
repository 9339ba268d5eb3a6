"""End-to-end throughput on a GPU: our engine vs HF transformers, and the decode step against
the memory-bandwidth limit.

    python -m benchmarks.bench_engine_gpu            # on an H100: the README's GPU numbers
    python -m benchmarks.bench_engine_gpu --smoke    # tiny model on the CPU: checks the code path only

Workload: nano-vllm's `bench.py` — 256 sequences, prompt lengths uniform in [100, 1024] (random
token ids < 10000), output lengths uniform in [100, 1024], ignore_eos, temperature 0.6 — on a
randomly initialised model shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 query / 8 KV heads,
head_dim 128, tied vocab 151936), bf16. Random weights are fine for speed: the work per token
does not depend on the values.

Peers on the same weights and device, same run:
  * HF `generate`, static batches of --hf-batch-size (each batch runs to its longest request);
  * HF continuous batching (`continuous_batching_context_manager`, per-request max_new_tokens),
    when this transformers version has it.
Then the decode step: pure decode steps at batch sizes 1..256 (context ~1k) timed inside our
engine, next to the bandwidth limit = (weight bytes + KV bytes read) / HBM bandwidth.
Writes benchmarks/results/engine_gpu.json + .png (engine_gpu_smoke.* with --smoke).
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, environment, sync, write_result

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=151645)
SMOKE = dict(QWEN3_0_6B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2)
# HBM bandwidth by device name (bytes/s): the denominator of the decode-step limit.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}


def hbm_bandwidth(name: str) -> float | None:
    for key, value in HBM_BANDWIDTH.items():      # most specific first (dict order)
        if key in name:
            return value
    return None


def make_model_dir(root: Path, config_kwargs: dict, dtype: torch.dtype) -> Path:
    """A random Qwen3 of the given shape, saved with SmolLM2's tokenizer (prompts are token ids;
    the tokenizer is only loaded, never used: detokenize=False)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mini_vllm import default_model_path

    path = root / "qwen3-random"
    config = AutoConfig.for_model("qwen3", **config_kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return path


def nano_vllm_workload(num_seqs: int, min_len: int, max_len: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return list(zip(prompts, outputs))


def run_ours(llm, workload, temperature: float):
    from mini_vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False)
              for _, n in workload]
    llm.reset_prefix_cache()
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in workload]
    return seconds


@torch.inference_mode()
def run_hf_static(model, workload, batch_size: int, temperature: float) -> float:
    sync()
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(n for _, n in batch)
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n,
                       do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                       pad_token_id=0, eos_token_id=None)
    sync()
    return time.perf_counter() - t0


@torch.inference_mode()
def run_hf_cb(model, workload, temperature: float) -> float:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                           max_new_tokens=max(n for _, n in workload), eos_token_id=-1, pad_token_id=0)
    done = 0
    sync()
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=60) as manager:
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while done < len(workload):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
    sync()
    return time.perf_counter() - t0


def decode_steps(llm, batch_sizes: list[int], context: int, steps: int = 12) -> list[dict]:
    """Median time of pure decode steps at each batch size (prompts of `context` tokens), with the
    bytes such a step must read: all weights once, and every request's KV."""
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    mc = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.engine_core.model_runner.model.parameters())
    kv_bytes_per_token = engine.engine_core.model_runner.kv_cache_spec.bytes_per_block // engine.config.block_size
    rows = []
    rng = random.Random(1)
    for b in batch_sizes:
        for i in range(b):
            engine.add_request(f"dec{b}-{i}", [rng.randrange(10000) for _ in range(context)],
                               SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True, detokenize=False))
        times, kv_tokens = [], []
        while engine.has_unfinished_requests():
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            so = engine.last_step.scheduler_output
            if so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) == b:    # pure decode, full batch
                times.append(time.perf_counter() - t0)
                kv_tokens.append(int(engine.last_step.model_inputs.attn_metadata.seq_lens.sum()))
        step_s = statistics.median(times)
        read = weight_bytes + statistics.median(kv_tokens) * kv_bytes_per_token
        rows.append(dict(batch_size=b, context=context, decode_step_ms=round(1000 * step_s, 3),
                         bytes_read=read, weight_bytes=weight_bytes, tokens_per_s=round(b / step_s, 1),
                         dtype=str(mc.dtype)))
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    tp = result["throughput"]
    axes[0].barh([r["name"] for r in tp], [r["output_tokens_per_s"] for r in tp],
                 color=["tab:green" if r["name"].startswith("ours") else "tab:gray" for r in tp])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens / s")
    axes[0].set_title("nano-vllm workload (256 seqs, 100-1024 in/out)", fontsize=9)
    dec = result["decode"]
    xs = [r["batch_size"] for r in dec]
    axes[1].plot(xs, [r["decode_step_ms"] for r in dec], "o-", label="ours: decode step")
    if dec and dec[0].get("bandwidth_limit_ms") is not None:
        axes[1].plot(xs, [r["bandwidth_limit_ms"] for r in dec], "k--", label="bandwidth limit")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("decode batch size")
    axes[1].set_ylabel("ms / step")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--no-cb", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--hbm-bandwidth", type=float, default=None, help="bytes/s (default: from the device name)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny workload, runs on a CPU")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from mini_vllm import LLM

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.num_seqs, args.min_len, args.max_len, args.hf_batch_size = 6, 8, 32, 4
        args.decode_batch_sizes, args.decode_context = [1, 4], 16
        shape, dtype = SMOKE, (torch.bfloat16 if cuda else torch.float32)
    elif not cuda:
        raise SystemExit("this benchmark needs a GPU (use --smoke to check its code path on a CPU)")
    else:
        shape, dtype = QWEN3_0_6B, torch.bfloat16
    device = "cuda" if cuda else "cpu"
    tmp = tempfile.TemporaryDirectory()
    model_dir = make_model_dir(Path(tmp.name), shape, dtype)
    workload = nano_vllm_workload(args.num_seqs, args.min_len, args.max_len)
    total_out = sum(n for _, n in workload)
    max_model_len = 2 * args.max_len + 16

    llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), device=device, max_model_len=max_model_len,
              max_num_seqs=min(256, args.num_seqs) if not args.smoke else 8, max_num_batched_tokens=16384,
              **({} if cuda else dict(kv_cache_memory=64 << 20)))
    print(llm.llm_engine.kv_cache_report, flush=True)
    warm = nano_vllm_workload(4, args.min_len // 2, args.min_len)
    run_ours(llm, warm, args.temperature)
    throughput = []

    def record(name, seconds, **extra):
        throughput.append(dict(name=name, seconds=round(seconds, 3), output_tokens=total_out,
                               output_tokens_per_s=round(total_out / seconds, 1), **extra))
        print(f"{name:<36} {seconds:8.1f} s {total_out / seconds:10.1f} output tok/s", flush=True)

    record("ours (mini_vllm)", run_ours(llm, workload, args.temperature))
    if not args.no_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        run_hf_static(hf, warm, 4, args.temperature)
        try:
            record(f"HF generate, static batch {args.hf_batch_size}",
                   run_hf_static(hf, workload, args.hf_batch_size, args.temperature), batch_size=args.hf_batch_size)
        except torch.OutOfMemoryError as e:
            print(f"HF static batching ran out of memory: {e}")
        if not args.no_cb and hasattr(hf, "continuous_batching_context_manager"):
            try:
                record("HF continuous batching", run_hf_cb(hf, workload, args.temperature))
            except Exception as e:        # report, do not lose the other numbers
                print(f"HF continuous batching failed: {type(e).__name__}: {e}")
        del hf
        if cuda:
            torch.cuda.empty_cache()

    decode = decode_steps(llm, args.decode_batch_sizes, args.decode_context)
    bandwidth = args.hbm_bandwidth or (hbm_bandwidth(torch.cuda.get_device_name()) if cuda else None)
    for row in decode:
        row["bandwidth_limit_ms"] = round(1000 * row["bytes_read"] / bandwidth, 3) if bandwidth else None
        row["fraction_of_limit"] = round(row["bandwidth_limit_ms"] / row["decode_step_ms"], 3) if bandwidth else None
        print(f"decode batch {row['batch_size']:4d}: {row['decode_step_ms']:8.2f} ms/step"
              + (f", limit {row['bandwidth_limit_ms']:.2f} ms ({row['fraction_of_limit']:.0%})" if bandwidth else ""))
    ours = throughput[0]["output_tokens_per_s"]
    summary = {f"ratio_vs_{r['name']}": round(ours / r["output_tokens_per_s"], 2) for r in throughput[1:]}
    print(summary)
    result = dict(throughput=throughput, decode=decode, summary=summary, hbm_bandwidth=bandwidth)
    name = "engine_gpu_smoke" if args.smoke else "engine_gpu"
    workload_info = dict(model="random Qwen3-0.6B-shaped" if not args.smoke else "random tiny Qwen3", dtype=str(dtype),
                         device=environment()["device"], num_seqs=args.num_seqs, input_len=[args.min_len, args.max_len],
                         output_len=[args.min_len, args.max_len], temperature=args.temperature, ignore_eos=True,
                         total_output_tokens=total_out, attention_backend=llm.llm_engine.config.resolved_attention_backend,
                         cuda_graphs=llm.llm_engine.engine_core.model_runner.cuda_graph_runner is not None,
                         summary=summary, decode=decode, hbm_bandwidth=bandwidth)
    path = write_result(name, workload_info, throughput, args.out_dir)
    plot(result, path.with_suffix(".png"))
    tmp.cleanup()
    return dict(result, path=path)


if __name__ == "__main__":
    main()
