"""The engine writes an EAGLE head's training text: the target answers many instructions at batch.

    python -m mini_vllm.self_distill --out DATA.json [--num-prompts 6000] [--max-tokens 256] [--seed 0]

Self-distillation ([EAGLE 2024]; Medusa-2's recipe): the draft head learns from text its own
target wrote, so it learns the target's distribution rather than some dataset's. Chapter 04
builds the instructions (`spec_decode.distill_prompts`: the standard library's docstrings in a
few dozen templates) and trains the head (`spec_decode.train_eagle --data DATA.json`); this
module is the part that needs the engine — continuous batching writes the ~1M tokens an hour of
training wants in a fraction of the time one-at-a-time `generate` would take, and while it writes
them the engine computes every position's hidden state anyway: a `HiddenStatesTap` on the model
runner copies them out (and the greedy token at every sampled row), so training needs no second,
teacher-forced pass over the text (which would cost as much again).

Writes DATA.json (the token ids, statistics) and DATA.features.pt (per sequence, rows for positions
0 .. len - 2 — the last token is never fed back — as float16, and the target's greedy next token
at every answer position; prompt positions but the last have label -1).

Half of the answers are greedy (what greedy speculative decoding verifies against) and half
sampled at T = 0.7 / top-p 0.9 with a per-request seed (variety: a greedy 135M model repeats
itself). The output is a fixed function of (model, instructions, seed): re-running writes the
same file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from spec_decode.distill_prompts import instructions

import torch

from mini_vllm.hidden_states_tap import HiddenStatesTap
from mini_vllm.llm import LLM
from mini_vllm.sampling_params import SamplingParams


def features_path(data_path: str | Path) -> Path:
    """Where the hidden states of DATA.json go: DATA.features.pt beside it."""
    p = Path(data_path)
    return p.with_name(p.stem + ".features.pt")


def sampling_params(i: int, max_tokens: int, seed: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    return SamplingParams(temperature=0.7, top_p=0.9, seed=seed * 1_000_003 + i, max_tokens=max_tokens,
                          detokenize=False)


def self_distill(llm: LLM, prompts: list[str], max_tokens: int, seed: int, chunk: int = 256,
                 log=print) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """Each instruction through the chat template, answered by the engine with the tap on. ->
    per instruction {"prompt": ids, "answer": ids, "greedy": bool}, its hidden rows [len - 1, H]
    and its labels [len - 1]. `chunk` instructions are queued at a time (the engine batches up to
    max_num_seqs of them; chunks only bound the memory the tap holds for unfinished requests)."""
    runner = llm.llm_engine.engine_core.model_runner
    if runner is None or llm.llm_engine.config.enable_prefix_caching:
        raise ValueError("self_distill needs the engine core in this process and prefix caching off (a cache hit "
                         "skips positions, and their hidden states with them)")
    tap = runner.hidden_states_tap = HiddenStatesTap()
    tok = llm.get_tokenizer()
    rows, hidden, labels, t0, made = [], [], [], time.perf_counter(), 0
    for s in range(0, len(prompts), chunk):
        batch = prompts[s:s + chunk]
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in batch]
        ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
        params = [sampling_params(s + j, max_tokens, seed) for j in range(len(batch))]
        outputs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        for j, (x, out) in enumerate(zip(ids, outputs)):
            answer = list(out.outputs[0].token_ids)
            f, greedy = tap.pop(out.request_id)
            n = len(x) + len(answer) - 1                      # positions fed to the model
            if f.shape[0] != n:
                raise RuntimeError(f"request {out.request_id}: {f.shape[0]} hidden rows for {n} positions")
            lab = torch.full((n,), -1, dtype=torch.long)
            for pos, t in greedy.items():
                lab[pos] = t
            made += len(answer)
            rows.append({"prompt": x, "answer": answer, "greedy": (s + j) % 2 == 0})
            hidden.append(f)
            labels.append(lab)
        elapsed = time.perf_counter() - t0
        log(json.dumps({"instructions": len(rows), "answer_tokens": made, "seconds": round(elapsed, 1),
                        "tokens_per_s": round(made / elapsed, 1)}), flush=True)
    runner.hidden_states_tap = None
    return rows, hidden, labels


def main(argv: list[str] | None = None) -> None:
    from mini_vllm.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF-format target directory (default: SmolLM2-135M-Instruct, converted)")
    ap.add_argument("--out", required=True, help="where the JSON goes")
    ap.add_argument("--num-prompts", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=int, default=6, help="KV cache memory (256 sequences of ~400 tokens: ~5 GiB)")
    args = ap.parse_args(argv)
    model = args.model or str(default_model_path())
    prompts = instructions(args.num_prompts, args.seed)
    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096,
              seed=args.seed, max_model_len=2048, kv_cache_memory=args.kv_cache_gib << 30, enable_prefix_caching=False,
              multiprocess_mode=False)
    t0 = time.perf_counter()
    rows, hidden, labels = self_distill(llm, prompts, args.max_tokens, args.seed)
    seconds = time.perf_counter() - t0
    llm.shutdown()
    answer_tokens = sum(len(r["answer"]) for r in rows)
    # Greedy answers: the label at each answer position is the token the engine chose (a check).
    agree = [int(lab[len(r["prompt"]) - 1:].eq(torch.tensor(r["answer"][:lab.numel() - len(r["prompt"]) + 1])).all())
             for r, lab in zip(rows, labels) if r["greedy"]]
    stats = {"instructions": len(rows), "prompt_tokens": sum(len(r["prompt"]) for r in rows),
             "answer_tokens": answer_tokens, "greedy_share": 0.5, "max_tokens": args.max_tokens,
             "seed": args.seed, "model": Path(model).name, "dtype": args.dtype, "seconds": round(seconds, 1),
             "sampling": "even instructions greedy, odd T=0.7 top-p 0.9 seeded",
             "features_file": features_path(args.out).name,
             "greedy_answers_equal_their_labels": round(sum(agree) / max(len(agree), 1), 4),
             "command": " ".join(["python -m mini_vllm.self_distill", *(sys.argv[1:] if argv is None else argv)])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"stats": stats, "rows": rows}))
    starts = [0]
    for f in hidden:
        starts.append(starts[-1] + f.shape[0])
    torch.save({"hidden": torch.cat(hidden), "labels": torch.cat(labels), "starts": starts},
               features_path(args.out))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
