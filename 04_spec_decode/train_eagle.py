"""Self-distil an EAGLE head from its target, on the CPU, within about an hour.

    python -m mini_vllm.self_distill --out build/eagle/distill.json        # the target writes ~1M tokens
    python -m spec_decode.train_eagle --model DIR --data build/eagle/distill.json
    make eagle-head                                                          # both, fixed seed

Recipe (EAGLE-1's head, trained with EAGLE-3's training-time test; [EAGLE 2024], [EAGLE-3 2025]):
  1. the TARGET writes the training text: our engine answers thousands of instructions built from
     the standard library's docstrings (`distill_prompts`), half greedy, half sampled — the head
     learns the target's feature dynamics on the target's own distribution;
  2. one teacher-forced pass over that text gives, per position p, the target's last hidden state
     f_p (what its LM head reads) and its greedy next token (`features`);
  3. the head (fc over [embed(x_{p+1}); f_p] -> one Llama decoder layer -> norm -> g_p) learns
        loss = SmoothL1(g_p, f_{p+1}) + w * CE(lm_head(g_p), the target's greedy token after x_{p+1})
     — EAGLE-1's feature regression plus token loss, over a reduced draft vocabulary (EAGLE-3's:
     the `draft_vocab_size` words the target writes most, its own LM head);
  4. ... and not only on the target's real features: drafting token j feeds the head its OWN
     prediction from token j-1. Trained on real features alone, the head never sees its errors
     and positions 2..k collapse (this chapter's first head: 0.156 / 0.013 / 0.002 / 0). So each
     batch is run `--unroll` times, step j's input at row p being step j-1's output at row p-1,
     each row attending to exactly what it would see when drafting (attention.UnrolledMetadata)
     — EAGLE-3's training-time test. We keep EAGLE-1's last-layer features (not EAGLE-3's fusion
     of three layers): the engine hands the head the hidden states vLLM's EAGLE-1 path hands it.
     The fusion does carry more: on one small data set (80 k answer tokens, 300 steps) a head fed
     layers 2, 15 and 27 reached held-out top-1 0.257 against 0.230 (benchmarks/HISTORY.md,
     2026-12-06) — a gain that needs the engine to hand over three layers' states;
  5. acceptance is measured on HELD-OUT instructions (`distill_prompts.HELD_OUT`): the target's
     greedy answers, its hidden states from HF, our paged `EagleProposer` drafting k tokens at a
     time exactly as greedy speculative decoding does (accepted = leading drafts equal to the
     target's greedy continuation) — during training too, for the acceptance-vs-tokens curve;
  6. saved as config.json + model.safetensors (bf16), with data statistics, settings, the curve
     and the held-out numbers in config.json's "extra".
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache import KVCacheManager
from spec_decode.attention import UnrolledMetadata
from spec_decode.distill_prompts import HELD_OUT
from spec_decode.eagle import EagleConfig, EagleHead, EagleProposer
from spec_decode.metrics import SpecDecodingStats
from spec_decode.ngram_proposer import NgramProposer
from spec_decode.proposer import DraftRequest


def load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def greedy_answers(model, tok, prompts: list[str], max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Prompt + the target's greedy answer per prompt (HF generate, one at a time: no padding to
    disturb the numbers); and the prompts' lengths."""
    seqs, lens = [], []
    for p in prompts:
        ids = chat_ids(tok, p)
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        seqs.append(out[0].tolist())
        lens.append(len(ids))
    return seqs, lens


@dataclass
class Features:
    """The target's hidden states over every sequence, flat: sequence i is rows starts[i] ..
    starts[i+1] of `hidden` (f_p for positions p = 0, 1, ...; fp16 to halve the memory) and `labels`
    (the target's greedy token after position p; -1 where unknown). From the engine as it wrote the
    text (mini_vllm.self_distill: every position but the last) or a teacher-forced pass (`features`)."""
    hidden: torch.Tensor        # [N, H] fp16
    labels: torch.Tensor        # [N] int64
    starts: list[int]

    def seq(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.hidden[a:b], self.labels[a:b]


@torch.no_grad()
def features(model, seqs: list[list[int]], batch_tokens: int = 8192, log=None) -> Features:
    """One forward per batch of similar-length sequences (right-padded; causal, so padding changes
    nothing before it), the LM head's argmax in chunks (49k logits per row add up)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    hidden: list = [None] * len(seqs)
    labels: list = [None] * len(seqs)
    lm = model.get_output_embeddings().weight
    i, t0 = 0, time.time()
    while i < len(order):
        width = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(batch_tokens, len(seqs[order[j]])):
            j += 1
        group = order[i:j]
        width = len(seqs[group[-1]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, s in enumerate(group):
            ids[r, :len(seqs[s])] = torch.tensor(seqs[s])
            mask[r, :len(seqs[s])] = 1
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state               # [B, W, H]
        for r, s in enumerate(group):
            f = h[r, :len(seqs[s])]
            hidden[s] = f.half()
            labels[s] = torch.cat([(c @ lm.T).argmax(-1) for c in f.split(4096)])
        if log is not None:
            log({"features": j, "of": len(seqs), "seconds": round(time.time() - t0, 1)})
        i = j
    starts = [0]
    for f in hidden:
        starts.append(starts[-1] + f.shape[0])
    return Features(torch.cat(hidden), torch.cat(labels), starts)


def draft_vocabulary(labels: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the target predicts most often (sorted by id) and the share of
    predictions they cover (EAGLE-3 picks its draft vocabulary the same way)."""
    counts = torch.bincount(labels)
    top = counts.argsort(descending=True)[:size]
    return top.sort().values, float(counts[top].sum() / counts.sum())


def head_for_target(model, intermediate_size: int | None, draft_vocab: torch.Tensor | None) -> EagleHead:
    """A fresh head. Its final norm starts as the target's (g then has the scale of the features it
    regresses to); with a draft vocabulary, its LM head starts as the target's rows for it."""
    config = EagleConfig.for_target(model.config, intermediate_size)
    config.draft_vocab_size = None if draft_vocab is None else int(draft_vocab.numel())
    head = EagleHead(config)
    head.norm.weight.data.copy_(model.model.norm.weight)
    if draft_vocab is not None:
        head.lm_head.weight.data.copy_(model.get_output_embeddings().weight[draft_vocab])
        head.d2t.copy_(draft_vocab - torch.arange(draft_vocab.numel()))
    return head


class Batches:
    """Training batches of whole sequences: each epoch a seeded shuffle, cut into batches of
    similar lengths (pools of 32 batches sorted by length: little padding), right-padded.
    A sequence longer than `window` rows contributes its last `window` rows (the answer)."""

    def __init__(self, seqs, prompt_lens, feats: Features, batch: int, window: int, seed: int):
        self.seqs, self.prompt_lens, self.feats = seqs, prompt_lens, feats
        self.batch, self.window, self.rng = batch, window, random.Random(seed)

    def epoch(self):
        order = list(range(len(self.seqs)))
        self.rng.shuffle(order)
        pool = 32 * self.batch
        for p in range(0, len(order), pool):
            chunk = sorted(order[p:p + pool], key=lambda i: len(self.seqs[i]))
            groups = [chunk[b:b + self.batch] for b in range(0, len(chunk), self.batch)]
            self.rng.shuffle(groups)
            yield from groups

    def tensors(self, group, embed, to_draft: torch.Tensor | None):
        """-> emb [B, T, H] (embed(x_{p+1})), f_in [B, T, H] (f_p), f_out [B, T, H] (f_{p+1}),
        labels [B, T] (the target's token after x_{p+1}, in draft ids; -100 = no loss: prompt rows,
        padding, a token outside the draft vocabulary)."""
        rows = []
        for i in group:
            s, p0 = self.seqs[i], self.prompt_lens[i]
            f, lab = self.feats.seq(i)
            n = f.shape[0] - 1                                 # rows p = 0 .. n-1: f_p -> f_{p+1}, reading x_{p+1}
            a = max(0, n - self.window)
            target = lab[a + 1:n + 1].clone()                  # row p: the token after x_{p+1}
            target[:max(p0 - 2 - a, 0)] = -100                 # ... an answer token only from row p0 - 2 on
            target[target < 0] = -100                          # (unknown: a prompt position)
            if to_draft is not None:
                target = torch.where(target >= 0, to_draft[target.clamp(min=0)], target)
            rows.append((torch.tensor(s[a + 1:n + 1]), f[a:n], f[a + 1:n + 1], target))
        T = max(r[0].numel() for r in rows)
        pad = lambda t, v=0: F.pad(t, (0, 0, 0, T - t.shape[0])) if t.dim() == 2 else F.pad(t, (0, T - t.shape[0]), value=v)  # noqa: E731
        with torch.no_grad():
            emb = torch.stack([pad(embed(r[0]).float()) for r in rows])
        f_in = torch.stack([pad(r[1].float()) for r in rows])
        f_out = torch.stack([pad(r[2].float()) for r in rows])
        labels = torch.stack([pad(r[3], -100) for r in rows])
        return emb, f_in, f_out, labels


def unrolled_outputs(head: EagleHead, emb: torch.Tensor, f_in: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The training-time test's forward: step 1 reads the real features f_in [B, T, H], step j >= 2
    reads step j-1's predictions shifted one row down (row p's input is step j-1's row p-1), each
    row attending to what drafting token j shows it. -> one [B, T, H] per step; rows of step j
    below j - 1 have no real counterpart (their input is padding)."""
    B, T, H = emb.shape
    md = UnrolledMetadata(B, T)
    positions = torch.arange(T).repeat(B)
    inp, outs = f_in, []
    for _ in range(unroll):
        outs.append(head(emb.reshape(B * T, H), inp.reshape(B * T, H), positions, None, md).view(B, T, H))
        inp = F.pad(outs[-1], (0, 0, 1, 0))[:, :T]
    return outs


def unrolled_loss(head: EagleHead, emb, f_in, f_out, labels, unroll: int, ce_weight: float, noise: float,
                  g: torch.Generator, lm_weight: torch.Tensor | None = None,
                  with_stats: bool = True) -> tuple[torch.Tensor, list[dict]]:
    """Every step of `unrolled_outputs` scored against the same targets (f_{p+1}, the target's next
    token), with EAGLE's uniform noise on the real features. -> mean loss over steps, per-step
    stats (regression, cross-entropy and top-1 agreement per step; [] unless `with_stats`)."""
    inp = f_in + (torch.rand(f_in.shape, generator=g) - 0.5) * 2 * noise
    losses, stats = [], []
    for step, out in enumerate(unrolled_outputs(head, emb, inp, unroll), 1):
        valid = labels != -100
        valid[:, :step - 1] = False
        reg = F.smooth_l1_loss(out[valid], f_out[valid])
        logits = head.lm_head(out[valid]) if head.has_draft_vocab else out[valid] @ lm_weight.T
        ce = F.cross_entropy(logits, labels[valid])
        losses.append(reg + ce_weight * ce)
        if with_stats:
            stats.append(dict(reg=round(reg.item(), 4), ce=round(ce.item(), 4),
                              top1=round(float((logits.argmax(-1) == labels[valid]).float().mean()), 3)))
    return torch.stack(losses).mean(), stats


def train(head: EagleHead, model, seqs, prompt_lens, feats: Features, steps: int, batch: int, lr: float,
          window: int, unroll: int, ce_weight: float, seed: int, noise: float = 0.05, log_every: int = 25,
          evaluate=None, eval_at: tuple[int, ...] = (), log=print, bf16: bool = False) -> tuple[list[dict], list[dict]]:
    """AdamW with one-cycle schedule over `steps` batches. `evaluate(head) -> dict` runs at the steps
    in `eval_at` (the acceptance-vs-tokens curve). `bf16`: matmuls in bfloat16 under autocast
    (weights and optimizer stay fp32; ~2x the GEMM speed on CPUs with AVX512-BF16). -> (log, curve)."""
    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings()
    to_draft = None
    if head.has_draft_vocab:
        d2t = head.d2t + torch.arange(head.config.draft_vocab_size)
        to_draft = torch.full((head.config.vocab_size,), -100, dtype=torch.long)
        to_draft[d2t] = torch.arange(d2t.numel())
    lm_weight = None if head.has_draft_vocab else model.get_output_embeddings().weight.detach()
    batches = Batches(seqs, prompt_lens, feats, batch, window, seed)
    head.train().requires_grad_(True)          # chapter 01's layers are built for serving: no gradients
    opt = torch.optim.AdamW([p for p in head.parameters() if p.is_floating_point()], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    log_rows, curve, t0, tokens, step = [], [], time.time(), 0, 0
    while step < steps:
        for group in batches.epoch():
            if step >= steps:
                break
            emb, f_in, f_out, labels = batches.tensors(group, embed, to_draft)
            logging = step % log_every == 0 or step == steps - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, per_step = unrolled_loss(head, emb, f_in, f_out, labels, unroll, ce_weight, noise, g, lm_weight,
                                               with_stats=logging)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            tokens += int((labels != -100).sum())
            if logging:
                row = dict(step=step, loss=round(loss.item(), 4), tokens=tokens, seconds=round(time.time() - t0, 1),
                           per_step=per_step)
                log_rows.append(row)
                log(json.dumps(row))
            step += 1
            if step in eval_at and evaluate is not None:
                head.eval()
                point = dict(step=step, training_tokens=tokens, **evaluate(head))
                curve.append(point)
                log(json.dumps({"curve": point}))
                head.train()
    head.eval()
    return log_rows, curve


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
                       block_size: int = 16, feats: Features | None = None) -> Replay:
    """Greedy speculative decoding replayed on the target's greedy answers: at each step the
    proposer sees the verified tokens and the target's hidden states of the new positions
    (computed by HF), drafts k tokens; accepted = the leading drafts that equal the answer."""
    feats = feats or features(model, seqs)
    num_blocks = sum(-(-(len(s) + k) // block_size) for s in seqs) + 4
    c = head.config
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    proposer = EagleProposer(head, model.get_input_embeddings(), lambda h: model.lm_head(h).float(),
                             (torch.zeros(shape), torch.zeros(shape)),
                             KVCacheManager(num_blocks, block_size, enable_caching=False), k, c.hidden_size,
                             c.vocab_size)
    stats, passes, tokens = SpecDecodingStats.new(k), 0, 0
    for r, (s, p0) in enumerate(zip(seqs, prompt_lens)):
        f = feats.seq(r)[0].float()
        m, given = p0 + 1, 0                                          # prompt + the first answer token verified
        tokens += len(s) - m
        while m < len(s):
            passes += 1
            drafts = proposer.propose([DraftRequest(f"r{r}", s[:m], f[given:m - 1], given)])[0]
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


def replay_ngram(seqs: list[list[int]], prompt_lens: list[int], k: int, lo: int = 2, hi: int = 4) -> Replay:
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


def summary(replay: Replay) -> dict:
    s = replay.stats
    return dict(acceptance_rate=round(s.acceptance_rate, 4), mean_acceptance_length=round(s.mean_acceptance_length, 3),
                per_position_acceptance=[round(r, 4) for r in s.per_position_acceptance_rate],
                mean_per_position=round(sum(s.per_position_acceptance_rate) / s.num_spec_tokens, 4),
                num_drafts=s.num_drafts, tokens_per_target_pass=round(replay.tokens_per_pass, 3))


def data_statistics(rows: list[dict], feats_labels: torch.Tensor, draft_vocab_size: int | None,
                    coverage: float | None) -> dict:
    answers = [len(r["answer"]) for r in rows]
    return dict(instructions=len(rows), answer_tokens=sum(answers), prompt_tokens=sum(len(r["prompt"]) for r in rows),
                greedy_answers=sum(r.get("greedy", False) for r in rows), mean_answer_tokens=round(sum(answers) / len(answers), 1),
                distinct_predicted_tokens=int(torch.unique(feats_labels).numel()),
                draft_vocab_size=draft_vocab_size, draft_vocab_coverage=None if coverage is None else round(coverage, 4))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help='HF-format target directory (SmolLM2: --model "$(python -m mini_vllm.default_model)")')
    ap.add_argument("--data", required=True, help="the target's text: JSON written by python -m mini_vllm.self_distill")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "eagle_smollm2"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--window", type=int, default=384, help="rows per sequence at most (its last ones)")
    ap.add_argument("--unroll", type=int, default=4, help="training-time-test steps (the drafts trained for)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--intermediate-size", type=int, default=1536)
    ap.add_argument("--draft-vocab-size", type=int, default=8192, help="0: the target's whole vocabulary")
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--curve-points", type=int, default=6)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 autocast for the matmuls)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    log = lambda obj: print(obj if isinstance(obj, str) else json.dumps(obj), flush=True)   # noqa: E731
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = load_tokenizer(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    data = json.loads(pathlib.Path(args.data).read_text())
    rows = data["rows"]
    seqs = [r["prompt"] + r["answer"] for r in rows]
    prompt_lens = [len(r["prompt"]) for r in rows]
    timings = {}

    t0 = time.time()
    feature_file = data.get("stats", {}).get("features_file")
    if feature_file:                                   # the engine kept them while it wrote the text
        feats = Features(**torch.load(pathlib.Path(args.data).with_name(feature_file)))
    else:                                              # a teacher-forced pass (as slow as writing the text)
        feats = features(model, seqs, log=log)
    timings["features_s"] = round(time.time() - t0, 1)

    held_seqs, held_lens = greedy_answers(model, tok, HELD_OUT, args.eval_tokens)
    held_feats = features(model, held_seqs)
    evaluate = lambda head: summary(measure_acceptance(head, model, held_seqs, held_lens, args.k, feats=held_feats))  # noqa: E731

    draft_vocab, coverage = None, None
    if args.draft_vocab_size:
        answer_labels = torch.cat([feats.seq(i)[1][max(p0 - 1, 0):] for i, p0 in enumerate(prompt_lens)])
        draft_vocab, coverage = draft_vocabulary(answer_labels, args.draft_vocab_size)
    torch.manual_seed(args.seed)
    head = head_for_target(model, args.intermediate_size, draft_vocab)
    stats = data_statistics(rows, feats.labels, args.draft_vocab_size or None, coverage)
    log({"data": stats})
    eval_at = tuple(sorted({max(1, round(args.steps * f)) for f in
                            [2 ** -i for i in range(args.curve_points - 1, -1, -1)]}))
    t1 = time.time()
    train_log, curve = train(head, model, seqs, prompt_lens, feats, args.steps, args.batch, args.lr, args.window,
                             args.unroll, args.ce_weight, args.seed, evaluate=evaluate, eval_at=eval_at, log=log,
                             bf16=not args.fp32)
    timings["train_s"] = round(time.time() - t1, 1)
    held = curve[-1] if curve and curve[-1]["step"] == args.steps else dict(evaluate(head))
    ngram = summary(replay_ngram(held_seqs, held_lens, args.k))
    config = head.config
    config.target_model = pathlib.Path(args.model).name
    config.extra = dict(
        recipe="EAGLE-1 head (last-layer features, feature regression + token loss) trained with EAGLE-3's "
               "training-time test (unrolled on its own predictions) and a reduced draft vocabulary",
        data=dict(stats, generation=data.get("stats", {})),
        training=dict(steps=args.steps, batch=args.batch, window=args.window, unroll=args.unroll, lr=args.lr,
                      ce_weight=args.ce_weight, bf16_autocast=not args.fp32, intermediate_size=args.intermediate_size, seed=args.seed,
                      training_tokens=train_log[-1]["tokens"], final=train_log[-1]),
        held_out=dict(held, k=args.k, prompts=len(HELD_OUT), max_new_tokens=args.eval_tokens,
                      eval="greedy answers of the target (HF generate) to distill_prompts.HELD_OUT, hidden states "
                           "from HF, drafts from spec_decode.eagle.EagleProposer"),
        ngram_2_4_same_answers=ngram, curve=curve, timings=timings,
        command=" ".join(["python -m spec_decode.train_eagle", *(sys.argv[1:] if argv is None else argv)]))
    head.save_pretrained(args.out)
    log(f"held-out: {json.dumps(held)}; n-gram on the same answers: {json.dumps(ngram)}")
    log(f"saved {args.out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters)")
    return held


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
