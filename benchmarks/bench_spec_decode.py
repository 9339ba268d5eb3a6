"""Speculative decoding end to end: the engine with each drafter vs the same engine without one.

    python -m benchmarks.bench_spec_decode            # SmolLM2, ~12 min on 2 cores -> results/spec_decode_engine.json + .png
    python -m benchmarks.bench_spec_decode --vllm     # ... and real vLLM 0.32 (CPU) with and without n-gram drafts
    python -m benchmarks.bench_spec_decode --quick    # a tiny random model, seconds (CI)

Workload: SmolLM2-135M-Instruct, fp32, CPU, greedy, batch 1 — each request alone
(speculation pays where a step is bound by reading the weights: on 2 cores a few dozen rows
already make the linears compute-bound; `--batch 4` runs a set's requests together), each
answer up to its end of sequence or 256 tokens. Two prompt sets, chat template applied, the
same token prompts for every configuration:
  * grounded — copy tasks over the standard library's own text (repeat a docstring paragraph,
    comment or edit a function and print it whole): n-gram lookup's home ground;
  * open — open-ended questions, where the output shares little with the prompt.
Configurations (`speculative_config`): none; ngram (k = 4, lookup 2..4); layer_skip (the
target's first 8 of 30 layers + its LM head, k = 3); eagle (the head shipped for SmolLM2,
k = 4: it was trained for 4); eagle_tree (the same head drafting EAGLE-2 trees: 8 nodes, 4 deep,
3 expanded per depth); ngram_k8 (lookup with up to 8 drafts: copy tasks accept long runs).
`adaptive` stays at its default (on). Each configuration is a fresh engine, warmed up, then
timed `--repeats` times, configurations interleaved round by round (the VM's speed drifts), the
median kept. A throwaway engine is built first (the first engine of a process has run
slower than later ones) and measures what verification costs: one request's forward with 1 .. 16
new rows (`workload.verify_forward`).
Reported per configuration and prompt set: output tokens and tok/s, its ratio to no
speculation in the same round, acceptance rate (accepted / proposed drafts) and mean acceptance length (tokens
per verification step), and the share of requests whose tokens equal no speculation's
(greedy: must be 1.0). A draft checkpoint (method "draft_model") needs a smaller model with
SmolLM2's tokenizer; none ships with this project, so it is left out here (the engine tests
run it with a tiny random Llama).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, with_throwaway_engine, write_result

def _paragraph(doc: str, start: str) -> str:
    """The paragraph of a docstring that begins with `start`, its whitespace folded."""
    return next(" ".join(p.split()) for p in doc.split("\n\n") if p.strip().startswith(start))


def grounded_texts() -> list[str]:
    """Copy tasks over text nobody here wrote — two docstring paragraphs and two functions of this
    Python's standard library, read from it — whose answers copy their input to the end (a test
    keeps these passages out of the EAGLE head's training prompts, which quote the same library)."""
    import colorsys
    import inspect
    import shlex
    import socket
    import urllib.request

    repeat = "Repeat this paragraph exactly, word for word:\n\n"
    return [repeat + _paragraph(inspect.getdoc(socket.socket.sendfile), "Send a file until EOF"),
            repeat + _paragraph(urllib.request.__doc__, "The OpenerDirector manages"),
            "Add a one-line comment above each statement of this function and print the whole function:\n\n"
            + inspect.getsource(colorsys.rgb_to_hsv),
            "Rename the variable `s` to `text` in this function and print the whole function:\n\n"
            + inspect.getsource(shlex.quote)]


OPEN = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "What makes a good cup of tea?",
]
METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "layer_skip": {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle_tree": {"method": "eagle", "num_speculative_tokens": 8, "tree_depth": 4, "tree_top_k": 3},
    "ngram_k8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def chat_prompts(tokenizer, texts: list[str]) -> list[dict]:
    out = []
    for text in texts:
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        out.append({"prompt_token_ids": tokenizer(templated, add_special_tokens=False).input_ids})
    return out


def run(llm, prompts, max_tokens: int, batch: int = 1) -> tuple[float, list[list[int]]]:
    """Wall time of generating every prompt, `batch` requests at a time, and their tokens."""
    from mini_vllm import SamplingParams

    # Each answer ends where the model ends it: past its end of sequence a copy task is no longer
    # one (the model starts an imagined next conversation), and that is not what a drafter serves.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    assert llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outputs = [o for s in range(0, len(prompts), batch) for o in llm.generate(prompts[s:s + batch], params, use_tqdm=False)]
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outputs]


def verify_cost(llm, context: int = 300, rows=(1, 2, 3, 5, 9, 16), iters: int = 20) -> dict[int, float]:
    """What verifying k drafts costs at batch 1: one request's forward (+ its logits) with `rows` new
    tokens after `context` cached ones, median ms per forward. Speculation pays only if the tokens a
    step accepts outgrow this ratio to one row. Writes into blocks 1.. of `llm`'s cache: call it on
    an engine with nothing running and nothing cached that matters (the throwaway one)."""
    import torch

    from mini_vllm.model_inputs import prepare_inputs

    runner = llm.llm_engine.engine_core.model_runner
    blocks = [list(range(1, 2 + (context + max(rows)) // runner.block_size))]
    out = {}
    with torch.inference_mode():
        def forward(new_ids, computed):
            inputs = runner._with_attention_plan(prepare_inputs([new_ids], [computed], blocks, runner.block_size))
            return runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                                            inputs.attn_metadata))
        forward(list(range(100, 100 + context)), 0)                              # the context's K/V
        for n in rows:
            times = []
            for _ in range(iters + 3):
                t0 = time.perf_counter()
                forward(list(range(500, 500 + n)), context)
                times.append(time.perf_counter() - t0)
            out[n] = round(statistics.median(times[3:]) * 1e3, 2)
    return out


def run_vllm_peer(model_dir, prompt_sets: dict, max_tokens: int, repeats: int) -> dict:
    """Real vLLM 0.32 (CPU) on the same token prompts at batch 1, without and with n-gram drafts
    (its EAGLE path loads EAGLE checkpoints in the format its GPU kernels expect, and drafts on
    a GPU: not run here). -> rows like ours, or {"skipped": reason}."""
    from benchmarks import vllm_peer

    reason = vllm_peer.unavailable_reason()
    if reason:
        return {"skipped": reason}
    workload = dict(prompt_sets={k: [p["prompt_token_ids"] for p in v] for k, v in prompt_sets.items()},
                    max_tokens=max_tokens, ignore_eos=False, repeats=repeats,
                    speculative_configs={"none": None, "ngram": METHODS["ngram"]})
    try:
        return vllm_peer.call(model_dir, workload, "both cores", kvcache_gib=2)
    except Exception as error:     # noqa: BLE001 - the peer failing (or timing out) must not lose our numbers
        return {"skipped": f"vLLM failed: {str(error)[-400:]}"}


def spec_stats(llm) -> dict:
    """Lifetime drafting totals of this engine (the timed runs only: reset after warm-up)."""
    stats = llm.llm_engine.engine_core.spec_decoding_stats
    if stats is None:
        return {}
    s = stats.stats
    return dict(num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                acceptance_rate=round(s.acceptance_rate, 3) if s.num_draft_tokens else None,
                mean_acceptance_length=round(s.mean_acceptance_length, 3) if s.num_drafts else None)


def reset_spec_stats(llm) -> None:
    from spec_decode import SpecDecodingStats

    stats = llm.llm_engine.engine_core.spec_decoding_stats
    if stats is not None:
        stats.stats = SpecDecodingStats.new(stats.stats.num_spec_tokens)


def tiny_setup(root: Path):
    """--quick: a tiny random Llama with SmolLM2's tokenizer (eagle/layer_skip need real hidden
    states to accept anything, so only ngram and layer_skip are timed, for the plumbing)."""
    from benchmarks.bench_engine import tiny_model_dir
    return tiny_model_dir(root)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from mini_vllm import LLM, default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=256, help="at most this many tokens per answer")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--quick", action="store_true", help="tiny random model, 16 tokens, ngram + layer_skip")
    ap.add_argument("--batch", type=int, default=1, help="requests generated together (1: each alone)")
    ap.add_argument("--vllm", action="store_true", help="also real vLLM 0.32 (CPU), none and ngram, same prompts")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            from benchmarks.bench_engine import SMOKE_KV_CACHE_MEMORY
            model_dir, args.max_tokens, args.repeats = tiny_setup(Path(tmp)), 16, 1
            args.methods = ["none", "ngram", "layer_skip"]
            methods = dict(METHODS, layer_skip={"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3})
            pool = dict(kv_cache_memory=SMOKE_KV_CACHE_MEMORY)      # the CPU default's 2 GiB: seconds per engine
        else:
            model_dir, methods, pool = default_model_path(), METHODS, {}
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompt_sets = {"grounded": chat_prompts(tokenizer, grounded_texts()), "open": chat_prompts(tokenizer, OPEN)}
        def warm_and_verify_cost(llm):                       # on a throwaway engine: "none" is not the first
            run(llm, prompt_sets["open"][:1], 8, args.batch)
            return verify_cost(llm)
        forward_ms = with_throwaway_engine(lambda: LLM(str(model_dir), dtype="float32", max_model_len=1024,
                                                       max_num_seqs=16, **pool), warm_and_verify_cost)
        print({"verify forward ms by rows": forward_ms})
        engines = {}
        for name in args.methods:
            kwargs = {} if methods[name] is None else {"speculative_config": methods[name]}
            engines[name] = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=16, **kwargs, **pool)
            run(engines[name], prompt_sets["open"][:1], 8, args.batch)          # warm-up
        rows, tokens_none = [], {}
        for set_name, prompts in prompt_sets.items():
            times = {name: [] for name in engines}
            tokens: dict[str, list[list[int]]] = {}
            for name, llm in engines.items():
                reset_spec_stats(llm)
            for _ in range(args.repeats):                                       # interleaved rounds
                for name, llm in engines.items():
                    seconds, tokens[name] = run(llm, prompts, args.max_tokens, args.batch)
                    times[name].append(seconds)
            tokens_none[set_name] = tokens["none"]
            base = statistics.median(times["none"])
            for name, llm in engines.items():
                median = statistics.median(times[name])
                num_tokens = sum(map(len, tokens[name]))
                rows.append(dict(prompts=set_name, method=name, config=methods[name], seconds=round(median, 3),
                                 output_tokens=num_tokens, output_tokens_per_s=round(num_tokens / median, 1),
                                 speedup_vs_none=round(base / median, 3),
                                 agreement_with_none=sum(a == b for a, b in zip(tokens[name], tokens["none"])) / len(prompts),
                                 **spec_stats(llm)))
                print(rows[-1])
        for llm in engines.values():
            llm.shutdown()
        ours_none = {r["prompts"]: r for r in rows if r["method"] == "none"}
        peer = run_vllm_peer(model_dir, prompt_sets, args.max_tokens, args.repeats) if args.vllm else None
        for cfg_name, result in (peer or {}).get("configs", {}).items():
            for set_name, prompts in prompt_sets.items():
                row = dict(prompts=set_name, method=f"vLLM {cfg_name}", config=result["config"])
                if "error" in result:
                    rows.append(dict(row, error=result["error"]))
                    continue
                got, base = result["sets"][set_name], peer["configs"]["none"]["sets"][set_name]
                num_tokens = sum(map(len, got["tokens"]))
                rows.append(dict(row, seconds=round(got["seconds"], 3), output_tokens=num_tokens,
                                 output_tokens_per_s=round(num_tokens / got["seconds"], 1),
                                 speedup_vs_none=round(base["seconds"] / got["seconds"], 3),
                                 vs_ours_none=round(ours_none[set_name]["seconds"] / got["seconds"], 3),
                                 agreement_with_none=sum(a == b for a, b in zip(got["tokens"], tokens_none[set_name]))
                                 / len(prompts)))
                print(rows[-1])
    workload = dict(model="tiny random llama (quick)" if args.quick else "SmolLM2-135M-Instruct", dtype="float32",
                    device="cpu (2 cores; other jobs may share it: compare ratios within the run)",
                    requests_per_set=len(OPEN), batch=args.batch, max_tokens=args.max_tokens, greedy=True,
                    ignore_eos=False, vllm=None if peer is None else peer.get("skipped") or peer.get("vllm"),
                    repeats=args.repeats,
                    verify_forward=dict(context=300, ms_by_rows=forward_ms,
                                        ratio_to_one_row={n: round(ms / forward_ms[1], 3) for n, ms in forward_ms.items()}),
                    draft_model="left out: no smaller checkpoint with SmolLM2's tokenizer ships here",
                    command=" ".join(["python -m benchmarks.bench_spec_decode", *(argv if argv is not None else sys.argv[1:])]))
    name = "spec_decode_engine_quick" if args.quick else "spec_decode_engine"
    write_result(name, workload, rows, args.out_dir)
    plot(rows, args.out_dir / f"{name}.png")
    result = {"workload": workload, "rows": rows}
    return result


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "speedup_vs_none" in r]                 # (a configuration the peer refused: no bar)
    sets = list(dict.fromkeys(r["prompts"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        values = [next(r["speedup_vs_none"] for r in rows if r["prompts"] == s and r["method"] == method) for s in sets]
        bars = ax.bar([i + j * width for i in range(len(sets))], values, width, label=method)
        for bar, r in zip(bars, [next(r for r in rows if r["prompts"] == s and r["method"] == method) for s in sets]):
            rate = r.get("acceptance_rate")
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():.2f}"
                    + (f"\n{rate:.0%}" if rate is not None else ""), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("speed-up vs no speculation")
    ax.set_title("greedy, fp32, CPU; labels: speed-up and acceptance rate", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
