"""The committed, trained EAGLE head (04_spec_decode/eagle_smollm2) on chapter 01's layers.

Its file stores q/k/v and gate/up apart (HF's layout, as chapter 04's own layer stack had them);
the head now runs chapter 01's LlamaDecoderLayer, with merged qkv_proj / gate_up_proj, loaded
through the stacked-params mapping. These tests pin that it computes what it computed before the
move: the same outputs as the layers it had (from git, when the history is there), and outputs
recorded with them; that saving gives back the committed file's tensors; that loading is strict.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import spec_decode
from paged_attention.block_table import build_attention_metadata
from spec_decode.eagle import EagleConfig, EagleHead
from spec_decode.tree import TreeAttentionMetadata, tree_attention_mask, tree_positions

HEAD_DIR = pathlib.Path(spec_decode.__file__).parent / "eagle_smollm2"
REPO = pathlib.Path(spec_decode.__file__).resolve().parents[1]
BEFORE_THE_MOVE = "9c9e490"          # the last commit whose chapter 04 had its own layers.py
BLOCK = 4


def two_steps(head, seed: int = 0):
    """The head's outputs over two steps of its paged cache: a prefill of two requests (4 and 3
    rows), then request 0 checks a 3-node tree (root + two siblings, tree-masked) and request 1
    one more row. -> [11, H]."""
    g = torch.Generator().manual_seed(seed)
    H = head.config.hidden_size
    shape = (8, BLOCK, head.config.num_key_value_heads, head.config.head_dim)
    cache = (torch.zeros(shape), torch.zeros(shape))
    blocks, tree = [[5, 2], [0, 7]], [-1, 0, 0]
    prefill = build_attention_metadata(blocks, [0, 0], [4, 3], BLOCK)
    md = build_attention_metadata(blocks, [4, 3], [3, 1], BLOCK)
    tree_step = TreeAttentionMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)},
                                      tree_masks=(tree_attention_mask(tree), None))
    steps = [(prefill, torch.tensor([0, 1, 2, 3, 0, 1, 2])),
             (tree_step, torch.cat((tree_positions(tree, 4), torch.tensor([3]))))]
    outs = []
    for md, positions in steps:
        T = positions.numel()
        embeds, feats = torch.randn(T, H, generator=g) * 0.05, torch.randn(T, H, generator=g)
        with torch.no_grad():
            outs.append(head(embeds, feats, positions, cache, md))
    return torch.cat(outs)


# Recorded for the self-distilled head committed on 2026-12-06, fp32, one thread (chapter 04's layers before the
# move compute the same: the test below, when the history is there):
# per row of two_steps(head), the first four features and the sum of all 576.
RECORDED_FIRST4 = [
    [-1.28014, -0.191492, 1.55555, -2.78765], [1.45206, -1.38708, 1.54715, 0.471266],
    [1.54489, -2.61055, -1.49669, 0.866267], [-0.327844, -1.80025, 0.537883, 0.38447],
    [-1.20821, -1.76768, -3.95475, -1.16909], [1.80549, -1.04692, -1.85176, 0.0303895],
    [-0.723082, -2.1208, -0.324292, -0.555926], [1.76967, -2.63649, 0.143326, 1.04018],
    [0.736488, -1.08237, -0.372591, 1.33954], [0.916671, -1.90625, -0.317038, -1.23066],
    [-0.457062, -0.968177, 0.0441908, 0.316081]]
RECORDED_SUMS = [11.86563, -8.618396, -40.12029, -6.276652, 44.68196, 9.785699, 59.46861, -55.39652, -38.00224, -3.104123, 2.677672]


def test_the_trained_head_gives_the_recorded_outputs():
    head = EagleHead.from_pretrained(HEAD_DIR)
    out = two_steps(head)
    assert out.shape == (11, head.config.hidden_size) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :4], torch.tensor(RECORDED_FIRST4), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.sum(-1), torch.tensor(RECORDED_SUMS), atol=1e-3, rtol=1e-4)


def old_layers():
    """04_spec_decode/layers.py as it was before the move, imported from git (None without the history)."""
    try:
        text = subprocess.run(["git", "show", f"{BEFORE_THE_MOVE}:04_spec_decode/layers.py"], cwd=REPO,
                              capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    path = pathlib.Path(__file__).with_name("_layers_before_the_move.py")
    spec = importlib.util.spec_from_loader("layers_before_the_move", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


class HeadBeforeTheMove(nn.Module):
    """EagleHead as chapter 04 had it (eagle.py at BEFORE_THE_MOVE): separate q/k/v and gate/up
    linears, its own RMSNorm and RoPE; the state dict is the file's, name for name."""

    def __init__(self, layers, c: EagleConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layer = layers.DecoderLayer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                         c.intermediate_size, c.rms_norm_eps)
        self.norm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = layers.RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta)

    def forward(self, input_embeds, hidden_states, positions, kv_cache, attn_metadata):
        x = self.fc(torch.cat((input_embeds, hidden_states), dim=-1))
        x, residual = self.layer(x, None, self.rotary_emb.cos_sin(positions), kv_cache, attn_metadata)
        return self.norm(x, residual)[0]


def test_the_trained_head_computes_what_it_computed_before_the_move():
    layers = old_layers()
    if layers is None:
        pytest.skip(f"no git history with commit {BEFORE_THE_MOVE} (the recorded outputs still check it)")
    head = EagleHead.from_pretrained(HEAD_DIR)
    before = HeadBeforeTheMove(layers, head.config)
    # The decoder path (fc -> layer -> norm) only: the draft vocabulary's LM head came later.
    before.load_state_dict({k: v.float() for k, v in load_file(str(HEAD_DIR / "model.safetensors")).items()
                            if not k.startswith(("lm_head.", "d2t"))})
    assert torch.equal(two_steps(head), two_steps(before))


def test_saving_gives_back_the_committed_file():
    """Load, then save in bf16: the same tensor names, HF's pieces, bit for bit the committed ones."""
    committed = load_file(str(HEAD_DIR / "model.safetensors"))
    assert {"layer.self_attn.q_proj.weight", "layer.mlp.gate_proj.weight"} <= set(committed)
    saved = {k: v.to(torch.bfloat16) for k, v in EagleHead.from_pretrained(HEAD_DIR).checkpoint_tensors().items()}
    assert set(saved) == set(committed)
    assert all(torch.equal(saved[k], committed[k]) for k in committed)


def test_loading_is_strict(tmp_path):
    from safetensors.torch import save_file

    head = EagleHead(EagleConfig(hidden_size=16, vocab_size=10, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=8, intermediate_size=24))
    tensors = head.checkpoint_tensors()
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) of the EAGLE head: layer.self_attn.qkv_proj.weight "
                                         r"\(shard 'k'\)"):
        head.load_weights((k, v) for k, v in tensors.items() if k != "layer.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="'layer.extra.weight': no such parameter"):
        head.load_weights([*tensors.items(), ("layer.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shard 'v': checkpoint tensor has shape \(16, 16\), expected \(8, 16\)"):
        head.load_weights({**tensors, "layer.self_attn.v_proj.weight": torch.zeros(16, 16)}.items())
    head.save_pretrained(tmp_path, dtype=torch.float32)
    again = EagleHead.from_pretrained(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(head.state_dict().values(), again.state_dict().values()))
    save_file({**tensors, "norm.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(3,\)"):
        EagleHead.from_pretrained(tmp_path)
