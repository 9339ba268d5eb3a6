"""Model drafters (separate draft model, LayerSkip self-draft, EAGLE head) on a toy target:
their paged, batched, rolled-back drafts == a dense from-scratch recomputation, and greedy
speculative decoding with ANY drafter == plain greedy decoding, token for token."""
import pytest
import torch

from kvcache import KVCacheManager
from paged_attention.block_table import build_attention_metadata
from spec_decode.draft_model import DraftModelProposer, LayerSkipDraftModel
from spec_decode.eagle import EagleConfig, EagleHead, EagleProposer
from spec_decode.ngram_proposer import NgramProposer
from spec_decode.proposer import DraftRequest, validate_draft_token_ids
from spec_decode.speculative_loop import SpeculativeLoop
from spec_decode.toy_model import ToyConfig, ToyForCausalLM, dense_logits, greedy_generate

V = 40
BLOCK = 4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 9, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7]]


def target_model():
    return ToyForCausalLM(ToyConfig(vocab_size=V), seed=0)


def draft_proposer(model, k, num_layers=None, num_blocks=64, **kw):
    layers = num_layers or len(model.model.layers) if not isinstance(model, LayerSkipDraftModel) else model.num_layers
    c = (model.target if isinstance(model, LayerSkipDraftModel) else model).config
    caches = [(torch.full((num_blocks, BLOCK, c.num_key_value_heads, c.head_dim), float("nan")),
               torch.full((num_blocks, BLOCK, c.num_key_value_heads, c.head_dim), float("nan"))) for _ in range(layers)]
    return DraftModelProposer(model, caches, KVCacheManager(num_blocks, BLOCK, enable_caching=False), k, V, **kw)


def eagle_proposer(target, k, num_blocks=64, seed=0):
    c = target.config
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig(hidden_size=c.hidden_size, vocab_size=V, num_attention_heads=c.num_attention_heads,
                                 num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=48,
                                 max_position_embeddings=512))
    shape = (num_blocks, BLOCK, c.num_key_value_heads, c.head_dim)
    return EagleProposer(head, target.model.embed_tokens, target.compute_logits,
                         (torch.full(shape, float("nan")), torch.full(shape, float("nan"))),
                         KVCacheManager(num_blocks, BLOCK, enable_caching=False), k, c.hidden_size, V)


def run_loop(target, proposer, max_tokens=14, **kw):
    loop = SpeculativeLoop(target, target.make_kv_caches(96, BLOCK), proposer, num_blocks=96, block_size=BLOCK)
    result = loop.generate(PROMPTS, max_tokens, **kw)
    loop.kv.check_invariants()
    assert loop.kv.num_free_blocks == 96                                 # every target block back
    return result


DRAFTERS = {
    "ngram": lambda t, k: NgramProposer(k, 1, 3),
    "draft_model": lambda t, k: draft_proposer(ToyForCausalLM(ToyConfig(vocab_size=V, num_hidden_layers=1), seed=5), k),
    "layerskip": lambda t, k: draft_proposer(LayerSkipDraftModel(t, 2), k),
    "eagle": lambda t, k: eagle_proposer(t, k),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculation_equals_greedy_decoding(name, k):
    target = target_model()
    proposer = DRAFTERS[name](target, k)
    result = run_loop(target, proposer)
    for prompt, out in zip(PROMPTS, result.outputs):
        assert out == greedy_generate(target, prompt, 14), name
    assert result.stats.num_drafts > 0
    if hasattr(proposer, "kv"):
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks and not proposer.requests


def test_layerskip_drafts_are_accepted_and_save_target_passes():
    """The self-draft (2 of 3 layers) agrees with the target often enough to save passes:
    20 tokens per request need 19 decode steps each without speculation, fewer with it."""
    target = target_model()
    result = run_loop(target, draft_proposer(LayerSkipDraftModel(target, 2), 3), max_tokens=20)
    assert all(len(o) == 20 for o in result.outputs)
    assert result.stats.num_accepted_tokens > 0
    assert len(result.trace) < len(PROMPTS) * 19                           # verification steps, all requests
    assert result.num_target_passes <= 20
    assert result.stats.num_accepted_tokens_per_pos[0] >= result.stats.num_accepted_tokens_per_pos[-1]


def dense_greedy_continuation(model, tokens, k):
    """The draft model's greedy continuation, recomputed from scratch (the oracle)."""
    layers = model.num_layers if isinstance(model, LayerSkipDraftModel) else len(model.model.layers)
    c = (model.target if isinstance(model, LayerSkipDraftModel) else model).config
    out, seq = [], list(tokens)
    for _ in range(k):
        nb = -(-len(seq) // 16)
        caches = [(torch.zeros(nb, 16, c.num_key_value_heads, c.head_dim),
                   torch.zeros(nb, 16, c.num_key_value_heads, c.head_dim)) for _ in range(layers)]
        md = build_attention_metadata([list(range(nb))], [0], [len(seq)], 16)
        with torch.no_grad():
            logits = model.compute_logits(model.forward(torch.tensor(seq), torch.arange(len(seq)), caches, md))
        out.append(int(logits[-1].argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("which", ["draft_model", "layerskip"])
def test_draft_model_drafts_equal_dense_oracle_across_rollbacks(which):
    target = target_model()
    model = ToyForCausalLM(ToyConfig(vocab_size=V, num_hidden_layers=2), seed=7) if which == "draft_model" \
        else LayerSkipDraftModel(target, 1)
    proposer = draft_proposer(model, 4)
    seqs = [list(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        drafts = proposer.propose([DraftRequest(f"r{i}", s) for i, s in enumerate(seqs)])
        for s, d in zip(seqs, drafts):
            assert d == dense_greedy_continuation(model, s, 4)
        # Accept a random prefix of each request's drafts, then a random "target" token.
        for s, d in zip(seqs, drafts):
            a = int(torch.randint(0, len(d) + 1, (1,), generator=g))
            s += d[:a] + [int(torch.randint(0, V, (1,), generator=g))]
    proposer.kv.check_invariants()
    proposer.remove_requests([f"r{i}" for i in range(len(seqs))])
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def eagle_dense_drafts(proposer, tokens, features, k):
    """EAGLE chain drafting recomputed densely: real rows (x_{i+1}, f_i), then its own guesses."""
    head, embed, lm = proposer.head, proposer.embed_tokens, proposer.compute_logits
    n = len(tokens) - 1
    row_tok, row_hid = list(tokens[1:n + 1]), [features[i] for i in range(n)]
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            g = head.forward_dense(embed(torch.tensor(row_tok))[None], torch.stack(row_hid)[None])[0]
            drafts.append(int(lm(g[-1:]).argmax()))
            row_tok.append(drafts[-1])
            row_hid.append(g[-1])
    return drafts


def test_eagle_drafts_equal_dense_oracle_across_rollbacks():
    """The paged EAGLE proposer over several steps, with accepted prefixes of every length,
    fed only the new target features each time == a dense recomputation from scratch."""
    target = target_model()
    proposer = eagle_proposer(target, 3, seed=2)
    seqs = [list(p) for p in PROMPTS]
    given = [0] * len(seqs)                     # features handed to the proposer so far
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        feats = []
        for s in seqs:
            with torch.no_grad():
                md = build_attention_metadata([list(range(-(-len(s) // 16)))], [0], [len(s)], 16)
                feats.append(target(torch.tensor(s), torch.arange(len(s)),
                                    target.make_kv_caches(-(-len(s) // 16), 16, fill=0.0), md))
        reqs = [DraftRequest(f"r{i}", s, feats[i][given[i]:len(s) - 1], given[i]) for i, s in enumerate(seqs)]
        drafts = proposer.propose(reqs)
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            torch.testing.assert_close(torch.tensor(d), torch.tensor(eagle_dense_drafts(proposer, s, feats[i], 3)))
            given[i] = len(s) - 1
            a = int(torch.randint(0, len(d) + 1, (1,), generator=g))
            s += d[:a] + [int(torch.randint(0, V, (1,), generator=g))]
    proposer.remove_requests([f"r{i}" for i in range(len(seqs))])
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_eagle_head_paged_equals_dense_and_checkpoint_roundtrip(tmp_path):
    target = target_model()
    proposer = eagle_proposer(target, 2)
    head = proposer.head
    x = torch.randint(0, V, (9,))
    f = torch.randn(9, target.config.hidden_size)
    md = build_attention_metadata([[3, 1, 0]], [0], [9], BLOCK)
    shape = (4, BLOCK, head.config.num_key_value_heads, head.config.head_dim)
    with torch.no_grad():
        paged = head(target.model.embed_tokens(x), f, torch.arange(9), (torch.zeros(shape), torch.zeros(shape)), md)
        dense = head.forward_dense(target.model.embed_tokens(x)[None], f[None])[0]
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)
    head.save_pretrained(tmp_path, dtype=torch.float32)
    again = EagleHead.from_pretrained(tmp_path)
    assert again.config == head.config
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_sampled_drafts_return_q():
    target = target_model()
    proposer = draft_proposer(LayerSkipDraftModel(target, 2), 3, temperature=0.8,
                              generator=torch.Generator().manual_seed(0))
    drafts, q = proposer.propose_with_probs([DraftRequest("a", PROMPTS[0]), DraftRequest("b", PROMPTS[1])])
    for d, p in zip(drafts, q):
        assert p.shape == (3, V) and torch.allclose(p.sum(-1), torch.ones(3))
        assert all(p[j, t] > 0 for j, t in enumerate(d))
    # And speculative sampling with those q runs end to end (distribution: test_distribution.py).
    result = run_loop(target, draft_proposer(LayerSkipDraftModel(target, 2), 3, temperature=0.8,
                                             generator=torch.Generator().manual_seed(1)), temperature=0.8)
    assert all(len(o) == 14 for o in result.outputs)


def test_draft_cache_full_means_no_drafts_not_an_error():
    target = target_model()
    proposer = draft_proposer(LayerSkipDraftModel(target, 2), 4, num_blocks=4)      # 16 slots in all
    drafts = proposer.propose([DraftRequest("a", list(range(10))), DraftRequest("b", list(range(12)))])
    assert drafts[0] and drafts[1] == []                                       # b does not fit after a
    proposer.kv.check_invariants()


class TestBadInput:
    def test_vocab_and_k(self):
        target = target_model()
        with pytest.raises(ValueError, match="must use the target's tokenizer"):
            draft_proposer(ToyForCausalLM(ToyConfig(vocab_size=V + 1)), 3)
        for k in (0, -1):
            with pytest.raises(ValueError, match="num_speculative_tokens"):
                draft_proposer(target, k)
        with pytest.raises(ValueError, match="enable_caching=False"):
            DraftModelProposer(target, [], KVCacheManager(8, BLOCK), 2, V)
        with pytest.raises(ValueError, match="num_layers"):
            LayerSkipDraftModel(target, 3)

    def test_tokenizer_mismatch(self):
        class Tok:
            def __init__(self, vocab, eos):
                self.vocab, self.eos_token_id = vocab, eos

            def get_vocab(self):
                return self.vocab
        a, b = Tok({"x": 0, "y": 1}, 1), Tok({"x": 1, "y": 0}, 1)
        with pytest.raises(ValueError, match="different ids"):
            draft_proposer(target_model(), 2, target_tokenizer=a, draft_tokenizer=b)
        with pytest.raises(ValueError, match="eos_token_id"):
            draft_proposer(target_model(), 2, target_tokenizer=a, draft_tokenizer=Tok(dict(a.vocab), 0))

    def test_eagle_errors(self):
        target = target_model()
        c = target.config
        head = EagleHead(EagleConfig(hidden_size=c.hidden_size * 2, vocab_size=V, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, intermediate_size=16))
        with pytest.raises(ValueError, match="built for hidden size 64"):
            EagleProposer(head, target.model.embed_tokens, target.compute_logits, (None, None),
                          KVCacheManager(8, BLOCK, enable_caching=False), 2, c.hidden_size, V)
        proposer = eagle_proposer(target, 2)
        with pytest.raises(ValueError, match="needs the target's hidden states"):
            proposer.propose([DraftRequest("a", [1, 2, 3])])
        with pytest.raises(ValueError, match="hidden states of size"):
            proposer.propose([DraftRequest("a", [1, 2, 3], torch.zeros(2, 7), 0)])

    def test_out_of_range_drafts(self):
        with pytest.raises(ValueError, match="outside the target's vocabulary"):
            validate_draft_token_ids([[1, 2], [V]], V, 3)
        with pytest.raises(ValueError, match="more than"):
            validate_draft_token_ids([[1, 2, 3, 4]], V, 3)
