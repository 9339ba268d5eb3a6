"""Self-distil an EAGLE head from a target model, on the CPU, in minutes.

    python -m spec_decode.train_eagle --model "$(python -m mini_vllm.default_model)" [--out DIR] [--steps N] ...

Recipe ([EAGLE 2024], shrunk to a CPU budget):
  1. the TARGET writes the training text: HF `generate` (sampling, T=0.7) answers a set of
     instructions — the head learns the target's own feature dynamics on the target's own
     distribution (no external dataset);
  2. one teacher-forced pass over that text gives, per position i, the target's last hidden
     state f_i (what its LM head reads) and its greedy next token;
  3. the head learns  (embed(x_{i+1}), f_i + noise)  ->  f_{i+1}:
        loss = SmoothL1(g_i, f_{i+1}) + 0.1 * CE(lm_head(g_i), target's greedy token at i+1)
     (the uniform noise on f_i, as EAGLE does, teaches it to keep going on its own imperfect
     guesses; the CE runs over the words the target actually produced in the data, a
     sampled softmax — the 49k-word LM head would be the expensive part on a CPU);
  4. acceptance is measured honestly on HELD-OUT instructions: the target's greedy answers,
     its hidden states computed by HF, and our paged `EagleProposer` drafting k tokens at a
     time, exactly as in greedy speculative decoding (accepted = leading drafts equal to the
     target's greedy continuation);
  5. the head is saved as config.json + model.safetensors (bf16, a few MB), with the data,
     the training settings and the measured acceptance in config.json's "extra".

The target is any HF-format Llama-style checkpoint (`--model`): the project's head was trained
on the converted SmolLM2-135M-Instruct, whose directory `python -m mini_vllm.default_model`
prints (this chapter never imports the engine, so the caller names the directory).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache import KVCacheManager
from spec_decode.eagle import EagleConfig, EagleHead, EagleProposer
from spec_decode.metrics import SpecDecodingStats
from spec_decode.ngram_proposer import NgramProposer
from spec_decode.proposer import DraftRequest

TOPICS = ["rain", "the ocean", "a city at night", "coffee", "mountains", "a lost key", "friendship", "autumn",
          "trains", "the moon", "a library", "bicycles", "gardening", "winter mornings", "a old lighthouse",
          "music", "honey bees", "the desert", "a bakery", "snow", "robots", "rivers", "a market", "clocks"]
TASKS = ["Write a short poem about {}.", "Describe {} in three sentences.", "Tell a very short story about {}.",
         "Give three facts about {}.", "Explain why people like {}.", "Write a short product review about {}.",
         "List five words that remind you of {}.", "Write a haiku about {}."]
EVAL_PROMPTS = ["What is the capital of France, and what is it famous for?", "Explain how a rainbow forms.",
                "Write a limerick about a cat who loves cheese.", "Give me three tips for studying effectively.",
                "Describe the water cycle for a ten-year-old.", "What are the benefits of regular exercise?",
                "Write a short thank-you note to a teacher.", "How do I make a cup of green tea?"]


def training_prompts(n: int, seed: int) -> list[str]:
    pairs = [t.format(topic) for t in TASKS for topic in TOPICS]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, batch: int, sample: bool, seed: int) -> list[list[int]]:
    """Prompt + the target's answer, per prompt (left-padded batches; EOS ends an answer)."""
    torch.manual_seed(seed)
    out = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for s in range(0, len(prompts), batch):
        ids = [chat_ids(tok, p) for p in prompts[s:s + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        kw = dict(do_sample=True, temperature=0.7, top_p=0.9) if sample else dict(do_sample=False)
        gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             pad_token_id=pad, **kw)
        for x, row in zip(ids, gen[:, width:].tolist()):
            answer = []
            for t in row:
                answer.append(t)
                if t == tok.eos_token_id:
                    break
            out.append(x + answer)
    return out


@torch.no_grad()
def features(model, seqs: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the target's last hidden states f [L, H] and greedy next tokens [L]."""
    fs, labels = [], []
    for s in seqs:
        out = model(torch.tensor([s]), output_hidden_states=True)
        fs.append(out.hidden_states[-1][0].float())
        labels.append(out.logits[0].argmax(-1))
    return fs, labels


def train(head: EagleHead, model, fs, labels, seqs, prompt_lens, steps: int, batch: int, lr: float, window: int,
          ce_weight: float, seed: int, log_every: int = 25) -> list[dict]:
    """Random windows of `window` rows from random sequences (RoPE attention depends on
    relative positions only, so a window trains the same rows as the whole sequence would).
    The CE runs over the vocabulary the target actually produced in the data (a few thousand
    words instead of 49k: a sampled softmax; drafting still uses the full LM head). Losses
    count only rows that predict ANSWER tokens: the chat template's system prompt is the same
    in every sequence and would otherwise be memorised at the expense of everything else."""
    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings()
    vocab_subset = torch.unique(torch.cat([lab[1:] for lab in labels]))             # [S]
    to_subset = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    to_subset[vocab_subset] = torch.arange(vocab_subset.numel())
    lm_weight = model.get_output_embeddings().weight.detach()[vocab_subset]         # [S, H]
    rows = []                                                                       # per sequence: row tensors
    with torch.no_grad():
        for s, f, lab, p0 in zip(seqs, fs, labels, prompt_lens):
            target = to_subset[lab[1:]].clone()                  # row i predicts the target's token after x_{i+1}
            target[:max(p0 - 2, 0)] = -100                       # ... an answer token only from row p0 - 2 on
            rows.append((embed(torch.tensor(s[1:])).float(), f[:-1], f[1:], target))
    head.train().requires_grad_(True)              # chapter 01's layers are built for serving: no gradients
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    log, t0 = [], time.time()
    for step in range(steps):
        emb, f_in, f_out, lab = [], [], [], []
        for i in torch.randint(0, len(rows), (batch,), generator=g).tolist():
            n = rows[i][0].shape[0]
            w = min(window, n)
            a = int(torch.randint(0, n - w + 1, (1,), generator=g))
            pad = window - w                                                          # right-pad short sequences
            e_, fi, fo, lb = (r[a:a + w] for r in rows[i])
            emb.append(F.pad(e_, (0, 0, 0, pad)))
            f_in.append(F.pad(fi, (0, 0, 0, pad)))
            f_out.append(F.pad(fo, (0, 0, 0, pad)))
            lab.append(F.pad(lb, (0, pad), value=-100))
        emb, f_in, f_out, lab = torch.stack(emb), torch.stack(f_in), torch.stack(f_out), torch.stack(lab)
        valid = lab != -100                                                           # answer rows, not padding
        noise = (torch.rand(f_in.shape, generator=g) - 0.5) * 0.2     # U(-0.1, 0.1), EAGLE's augmentation
        pred = head.forward_dense(emb, f_in + noise)                 # [B, W, H], no cache, causal per window
        reg = F.smooth_l1_loss(pred[valid], f_out[valid])
        logits = pred[valid] @ lm_weight.T                           # [rows, S]
        target = lab[valid]
        ce = F.cross_entropy(logits, target, ignore_index=-100)
        loss = reg + ce_weight * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            top1 = float((logits.argmax(-1) == target).float().mean())
            entry = dict(step=step, loss=round(loss.item(), 4), reg=round(reg.item(), 4), ce=round(ce.item(), 4),
                         top1=round(top1, 3), seconds=round(time.time() - t0, 1))
            log.append(entry)
            print(json.dumps(entry), flush=True)
    return log


@dataclass
class Replay:
    stats: SpecDecodingStats
    passes: int            # target forward passes of the replayed greedy generation
    tokens: int            # answer tokens they produced

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes


@torch.no_grad()
def measure_acceptance(head: EagleHead, model, seqs: list[list[int]], prompt_lens: list[int], k: int,
                       block_size: int = 16) -> SpecDecodingStats:
    """Greedy speculative decoding replayed on the target's greedy answers: at each step the
    proposer sees the verified tokens and the target's hidden states of the new positions
    (computed by HF), drafts k tokens; accepted = the leading drafts that equal the answer."""
    fs, _ = features(model, seqs)
    num_blocks = sum(-(-(len(s) + k) // block_size) for s in seqs) + 4
    c = head.config
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    proposer = EagleProposer(head, model.get_input_embeddings(), lambda h: model.lm_head(h).float(),
                             (torch.zeros(shape), torch.zeros(shape)),
                             KVCacheManager(num_blocks, block_size, enable_caching=False), k, c.hidden_size,
                             c.vocab_size)
    stats, passes, tokens = SpecDecodingStats.new(k), 0, 0            # target passes, tokens they produced
    for r, (s, p0) in enumerate(zip(seqs, prompt_lens)):
        m, given = p0 + 1, 0                                          # prompt + the first answer token verified
        tokens += len(s) - m
        while m < len(s):
            passes += 1
            drafts = proposer.propose([DraftRequest(f"r{r}", s[:m], fs[r][given:m - 1], given)])[0]
            drafts = drafts[:len(s) - m]
            a = 0
            while a < len(drafts) and drafts[a] == s[m + a]:
                a += 1
            if drafts:
                stats.observe_draft(len(drafts), a)
            given = m - 1
            m += a + 1
        proposer.remove_requests([f"r{r}"])
    return Replay(stats, passes, tokens)


def replay_ngram(seqs: list[list[int]], prompt_lens: list[int], k: int, lo: int = 2, hi: int = 4) -> SpecDecodingStats:
    """The same replay with n-gram prompt lookup as the drafter: a model-free baseline."""
    ngram, stats, passes, tokens = NgramProposer(k, lo, hi), SpecDecodingStats.new(k), 0, 0
    for s, p0 in zip(seqs, prompt_lens):
        m = p0 + 1
        tokens += len(s) - m
        while m < len(s):
            passes += 1
            drafts = ngram.propose_one(s[:m])[:len(s) - m]
            a = 0
            while a < len(drafts) and drafts[a] == s[m + a]:
                a += 1
            if drafts:
                stats.observe_draft(len(drafts), a)
            m += a + 1
    return Replay(stats, passes, tokens)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help='HF-format target directory (SmolLM2: --model "$(python -m mini_vllm.default_model)")')
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "eagle_smollm2"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--intermediate-size", type=int, default=1024)
    ap.add_argument("--eval-prompts", type=int, default=len(EVAL_PROMPTS))
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--train-sampling", choices=("sample", "greedy"), default="sample",
                    help="how the target writes the training text: T=0.7 / top-p 0.9 sampling, or greedy")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--data-cache", help="JSON file keeping the generated text between runs (generation is the "
                                         "slow part on a CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model_dir = args.model
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    timings = {}

    prompts = training_prompts(args.num_prompts, args.seed)
    eval_prompts = EVAL_PROMPTS[:args.eval_prompts]
    cache = pathlib.Path(args.data_cache) if args.data_cache else None
    key = dict(model=pathlib.Path(model_dir).name, prompts=prompts, eval_prompts=eval_prompts,
               max_new_tokens=args.max_new_tokens, eval_tokens=args.eval_tokens, seed=args.seed,
               sampling=args.train_sampling)
    data = json.loads(cache.read_text()) if cache is not None and cache.exists() else None
    if data is None or data["key"] != key:
        seqs = generate(model, tok, prompts, args.max_new_tokens, args.gen_batch,
                        sample=args.train_sampling == "sample", seed=args.seed)
        eval_seqs = generate(model, tok, eval_prompts, args.eval_tokens, len(eval_prompts), sample=False, seed=args.seed)
        data = dict(key=key, train=seqs, eval=eval_seqs)
        if cache is not None:
            cache.write_text(json.dumps(data))
    seqs, eval_seqs = data["train"], data["eval"]
    timings["generate_s"] = round(time.time() - t0, 1)
    print(f"{sum(map(len, seqs))} training tokens ({len(seqs)} sequences) in {timings['generate_s']} s", flush=True)
    prompt_lens = [len(chat_ids(tok, p)) for p in prompts]
    fs, labels = features(model, seqs)

    torch.manual_seed(args.seed)
    config = EagleConfig.for_target(model.config, args.intermediate_size)
    config.target_model = pathlib.Path(model_dir).name
    head = EagleHead(config)
    t1 = time.time()
    log = train(head, model, fs, labels, seqs, prompt_lens, args.steps, args.batch, args.lr, args.window,
                args.ce_weight, args.seed)
    timings["train_s"] = round(time.time() - t1, 1)
    head.eval()

    t2 = time.time()
    eval_prompt_lens = [len(chat_ids(tok, p)) for p in eval_prompts]
    replay = measure_acceptance(head, model, eval_seqs, eval_prompt_lens, args.k)
    stats = replay.stats
    ngram = replay_ngram(eval_seqs, eval_prompt_lens, args.k)
    timings["eval_s"] = round(time.time() - t2, 1)
    result = dict(acceptance_rate=round(stats.acceptance_rate, 4),
                  mean_acceptance_length=round(stats.mean_acceptance_length, 3),
                  per_position_acceptance=[round(r, 4) for r in stats.per_position_acceptance_rate],
                  num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens, k=args.k,
                  tokens_per_target_pass=round(replay.tokens_per_pass, 3),
                  eval="greedy answers of the target to %d held-out instructions, %d new tokens max, hidden states "
                       "from HF transformers, drafts from spec_decode.eagle.EagleProposer" % (len(eval_prompts),
                                                                                              args.eval_tokens))
    result["ngram_2_4_same_answers"] = dict(acceptance_rate=round(ngram.stats.acceptance_rate, 4),
                                            mean_acceptance_length=round(ngram.stats.mean_acceptance_length, 3),
                                            steps_with_drafts=ngram.stats.num_drafts, steps=ngram.passes,
                                            tokens_per_target_pass=round(ngram.tokens_per_pass, 3))
    print(f"held-out acceptance: {stats}; {replay.tokens_per_pass:.3f} tokens per target pass", flush=True)
    print(f"n-gram (2..4) on the same answers: {ngram.stats}; {ngram.tokens_per_pass:.3f} tokens per target pass",
          flush=True)
    config.extra = dict(data=dict(train_prompts=len(prompts), train_tokens=sum(map(len, seqs)),
                                  sampling="temperature 0.7, top_p 0.9" if args.train_sampling == "sample"
                                  else "greedy", max_new_tokens=args.max_new_tokens),
                        training=dict(steps=args.steps, batch=args.batch, window=args.window, lr=args.lr, ce_weight=args.ce_weight,
                                      seed=args.seed, final=log[-1]),
                        held_out=result, timings=timings,
                        command="python -m spec_decode.train_eagle " + " ".join(argv or []))
    head.save_pretrained(args.out)
    print(f"saved {args.out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters)", flush=True)
    return result


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
