"""The EAGLE training script's machinery on a tiny random HF Llama (no download, seconds):
a head trained on the target's own greedy text must then draft that text through the paged
EagleProposer — training rows (dense, windows) and serving rows (paged, chained on its own
guesses) line up. The real run on SmolLM2 is `python -m spec_decode.train_eagle`."""
import pytest
import torch

from spec_decode import train_eagle as te
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


def test_a_head_that_learned_the_text_drafts_it(tiny_target):
    model, seqs = tiny_target
    fs, labels = te.features(model, seqs)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, intermediate_size=64))
    log = te.train(head, model, fs, labels, seqs, [6] * len(seqs), steps=100, batch=6, lr=3e-3, window=32,
                   ce_weight=1.0, seed=0, log_every=1000)
    assert log[-1]["loss"] < log[0]["loss"]
    replay = te.measure_acceptance(head.eval(), model, seqs, [6] * len(seqs), k=3)
    assert replay.stats.acceptance_rate > 0.35, replay.stats           # measured 0.50; an untrained head: ~1/48
    assert replay.tokens_per_pass > 1.5
    untrained = te.measure_acceptance(EagleHead(head.config).eval(), model, seqs, [6] * len(seqs), k=3)
    assert untrained.stats.acceptance_rate < replay.stats.acceptance_rate


def test_config_for_target_and_ngram_replay(tiny_target):
    model, seqs = tiny_target
    c = EagleConfig.for_target(model.config)
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 48, 4, 2, 8)
    replay = te.replay_ngram(seqs, [6] * len(seqs), k=3)
    assert replay.passes >= 1 and replay.tokens == sum(len(s) - 7 for s in seqs)
    assert len(te.training_prompts(10, 0)) == 10
