"""The EAGLE training script's machinery on a tiny random HF Llama (no download, seconds).

* the training-time test's rows are the drafting rows: step j at row p equals the head run
  causally over the real rows up to p - j + 1 and then its own chained predictions — computed
  here the slow way, one causal pass per row (the oracle does not use the unrolled mask);
* a head trained (unrolled, with a draft vocabulary) on the target's own greedy text drafts that
  text through the paged EagleProposer, and beats an untrained head;
* the smoke form of the real command (`main`, a tiny checkpoint, its self-distilled data) runs
  end to end and records what it measured.
The real run on SmolLM2 is `make eagle-head`."""
import json

import pytest
import torch

from spec_decode import train_eagle as te
from spec_decode.attention import CausalMetadata, unrolled_mask
from spec_decode.distill_prompts import HELD_OUT, instructions
from spec_decode.eagle import EagleConfig, EagleHead

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (6,), generator=g) for _ in range(6)]
    with torch.no_grad():
        seqs = [model.generate(p[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=40,
                               do_sample=False, pad_token_id=0)[0].tolist() for p in prompts]
    return model, seqs


def test_unrolled_mask_is_what_drafting_sees():
    m = unrolled_mask(5, 3)                          # step 3: real rows <= r - 2, step 2's row r - 1, own row r
    assert m.shape == (5, 15)
    row4 = m[4].nonzero().flatten().tolist()
    assert row4 == [0, 1, 2, 5 + 3, 10 + 4]
    assert unrolled_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_training_time_test_rows_equal_chained_drafting_rows(tiny_target):
    model, seqs = tiny_target
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.for_target(model.config, intermediate_size=64)).eval()
    embed = model.get_input_embeddings()
    feats = te.features(model, seqs[:2])
    T = 20
    emb = torch.stack([embed(torch.tensor(s[1:T + 1])) for s in seqs[:2]])            # [2, T, H] x_{p+1}
    f = torch.stack([feats.seq(i)[0][:T].float() for i in range(2)])                   # [2, T, H] f_p
    with torch.no_grad():
        outs = te.unrolled_outputs(head, emb, f, 4)

        def causal(e, h):                                                              # one sequence [L, H]
            return head(e, h, torch.arange(e.shape[0]), None, CausalMetadata.equal_lengths(1, e.shape[0]))

        for b in range(2):
            for step in range(1, 5):
                for p in (step - 1, 9, T - 1):
                    real = p - step + 1                                                # rows 0..real: real features
                    hid = f[b, :real + 1].clone()
                    for r in range(real + 1, p + 1):                                   # then the head's own guesses
                        hid = torch.cat([hid, causal(emb[b, :r], hid)[-1:]])
                    want = causal(emb[b, :p + 1], hid)[-1]
                    torch.testing.assert_close(outs[step - 1][b, p], want, atol=1e-5, rtol=1e-5)


def test_a_head_trained_unrolled_drafts_the_text(tiny_target):
    model, seqs = tiny_target
    feats = te.features(model, seqs)
    vocab, coverage = te.draft_vocabulary(feats.labels, 40)
    assert coverage > 0.9 and vocab.numel() == 40 and vocab.equal(vocab.sort().values)
    torch.manual_seed(0)
    head = te.head_for_target(model, 64, vocab)
    assert (head.d2t + torch.arange(40)).equal(vocab)
    log, curve = te.train(head, model, seqs, [6] * len(seqs), feats, steps=120, batch=6, lr=3e-3, window=64,
                          unroll=3, ce_weight=1.0, seed=0, log_every=1000,
                          evaluate=lambda h: te.summary(te.measure_acceptance(h, model, seqs, [6] * len(seqs), 3)),
                          eval_at=(10, 120), log=lambda _: None)
    assert log[-1]["loss"] < log[0]["loss"]
    assert [c["step"] for c in curve] == [10, 120] and curve[-1]["training_tokens"] > curve[0]["training_tokens"]
    replay = te.measure_acceptance(head, model, seqs, [6] * len(seqs), k=3)
    assert replay.stats.acceptance_rate > 0.35, replay.stats
    assert replay.stats.per_position_acceptance_rate[2] > 0.1, replay.stats     # drafts 2..k learned too
    untrained = te.measure_acceptance(te.head_for_target(model, 64, vocab).eval(), model, seqs, [6] * len(seqs), k=3)
    assert untrained.stats.acceptance_rate < replay.stats.acceptance_rate


def test_the_command_smoke_run(tiny_target, tmp_path, monkeypatch):
    """`main` on a saved tiny checkpoint and data in the self_distill format: a saved head whose
    config records data, training and held-out numbers, and which loads and drafts."""
    model, seqs = tiny_target
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    data = {"stats": {"answer_tokens": 240}, "rows": [{"prompt": s[:6], "answer": s[6:], "greedy": True} for s in seqs]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    held = [s for s in seqs[:2]]
    monkeypatch.setattr(te, "greedy_answers", lambda m, tok, prompts, n: (held, [6, 6]))
    monkeypatch.setattr(te, "load_tokenizer", lambda path: None)
    out = tmp_path / "head"
    result = te.main(["--model", str(model_dir), "--data", str(tmp_path / "data.json"), "--out", str(out),
                      "--steps", "6", "--batch", "3", "--intermediate-size", "64", "--draft-vocab-size", "32",
                      "--curve-points", "2", "--k", "3"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 32 and cfg["extra"]["data"]["answer_tokens"] == sum(len(s) - 6 for s in seqs)
    assert [c["step"] for c in cfg["extra"]["curve"]] == [3, 6]
    assert cfg["extra"]["held_out"]["per_position_acceptance"] == result["per_position_acceptance"]
    head = EagleHead.from_pretrained(out)
    assert head.has_draft_vocab and head.d2t.dtype == torch.long


def test_instructions_are_distinct_deterministic_and_never_held_out():
    a = instructions(300, seed=3)
    assert a == instructions(300, seed=3) and a != instructions(300, seed=4)
    assert len(set(a)) == 300 and not set(a) & set(HELD_OUT)


def test_the_heads_training_instructions_are_not_the_benchmarks_prompts():
    """`make eagle-head`'s 7,000 instructions (seed 0) never contain a prompt the engine benchmark
    times EAGLE on: its "open" set would otherwise measure text the head trained on (a template
    and an everyday topic can spell one out: "Write a short story about a lighthouse keeper."),
    and none quotes a passage its "grounded" copy tasks copy (both read the standard library)."""
    from benchmarks.bench_spec_decode import OPEN, grounded_texts
    training = instructions(7000, seed=0)
    assert not set(training) & set(OPEN + HELD_OUT)
    passages = [text.split("\n\n", 1)[1].strip() for text in grounded_texts()]
    assert all(len(p) > 200 for p in passages)
    assert not [p for p in passages if any(p in t or t.split("\n\n")[-1].strip() in p for t in training
                                            if "\n\n" in t)]


def test_ngram_replay_counts_every_answer_token(tiny_target):
    model, seqs = tiny_target
    c = EagleConfig.for_target(model.config)
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 48, 4, 2, 8)
    replay = te.replay_ngram(seqs, [6] * len(seqs), k=3)
    assert replay.passes >= 1 and replay.tokens == sum(len(s) - 7 for s in seqs)
