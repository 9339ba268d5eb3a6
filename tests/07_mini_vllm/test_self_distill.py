"""The engine writes an EAGLE head's training data (self_distill.py, hidden_states_tap.py).

Oracle: HF transformers' teacher-forced pass over the same text — every hidden row the tap kept
equals HF's last hidden state at that position, and every label HF's argmax there, for greedy
and sampled answers, whole prefills and chunked ones (a small token budget), and a request
whose prefix another request cached (refused: the tap would miss positions)."""
import json

import pytest
import torch

from mini_vllm import LLM
from mini_vllm.hidden_states_tap import HiddenStatesTap
from mini_vllm.self_distill import features_path, main, self_distill

PROMPTS = ["Write a haiku about the sea.", "Explain what a queue is, in one sentence.",
           "Summarize: the scheduler keeps two counters per request."]


def hf_features(hf, seq):
    with torch.no_grad():
        h = hf.model(torch.tensor([seq[:-1]])).last_hidden_state[0]        # positions 0 .. len - 2
    return h, (h @ hf.lm_head.weight.T).argmax(-1)


@pytest.mark.parametrize("budget", [2048, 24])                              # whole prefills; 24-token chunks
def test_tap_rows_and_labels_equal_hf(smollm2_dir, smollm2_hf, budget):
    llm = LLM(str(smollm2_dir), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=budget,
              max_num_seqs=4, multiprocess_mode=False, kv_cache_memory=1 << 28, max_model_len=512)
    try:
        rows, hidden, labels = self_distill(llm, PROMPTS, max_tokens=12, seed=0, chunk=2, log=lambda *a, **k: None)
    finally:
        llm.shutdown()
    assert [r["greedy"] for r in rows] == [True, False, True]
    for r, f, lab in zip(rows, hidden, labels):
        seq, p0 = r["prompt"] + r["answer"], len(r["prompt"])
        h, want = hf_features(smollm2_hf, seq)
        assert f.shape == h.shape and f.dtype == torch.float16
        torch.testing.assert_close(f.float(), h, atol=0.05, rtol=2e-3)        # fp16 storage of values up to ~50
        assert (lab[:p0 - 1] == -1).all()                                     # no labels inside the prompt ...
        assert lab[p0 - 1:].equal(want[p0 - 1:])                              # ... the target's argmax after it
        if r["greedy"]:
            assert lab[p0 - 1:].tolist() == r["answer"][:len(seq) - p0]


def test_prefix_caching_is_refused(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", max_num_seqs=2, multiprocess_mode=False, kv_cache_memory=1 << 27,
              max_model_len=256)
    try:
        with pytest.raises(ValueError, match="prefix caching off"):
            self_distill(llm, PROMPTS[:1], max_tokens=4, seed=0)
    finally:
        llm.shutdown()


def test_tap_pop_refuses_a_gap():
    tap = HiddenStatesTap()
    import numpy as np
    tap.observe_hidden(["a"], np.array([0]), np.array([3]), torch.zeros(3, 4))
    tap.observe_hidden(["a"], np.array([5]), np.array([1]), torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"positions \[3, 5\)"):
        tap.pop("a")


def test_the_command_writes_data_and_features(smollm2_dir, tmp_path):
    out = tmp_path / "d.json"
    main(["--model", str(smollm2_dir), "--out", str(out), "--num-prompts", "3", "--max-tokens", "6",
          "--max-num-seqs", "4", "--kv-cache-gib", "1"])
    data = json.loads(out.read_text())
    feats = torch.load(features_path(out))
    assert data["stats"]["features_file"] == features_path(out).name and data["stats"]["instructions"] == 3
    assert data["stats"]["greedy_answers_equal_their_labels"] == 1.0
    lengths = [len(r["prompt"]) + len(r["answer"]) - 1 for r in data["rows"]]
    assert feats["starts"] == [sum(lengths[:i]) for i in range(4)] and feats["hidden"].shape[0] == sum(lengths)
