"""A quantized lm_head (`quantize --lm-head`; GPTQ's `"lm_head": true`): the one matrix a decode step
reads that the decoder linears leave in floats. HF transformers on the same checkpoint is the oracle;
a tied model is untied for it; vLLM's rule for which targets reach the lm_head is kept."""
import json
import shutil

import pytest
import torch
from quant_cases import TINY_QUANT, hf_quantized
from tiny_checkpoints import make_tiny_engine_checkpoint

from mini_vllm import SamplingParams
from quantization.checkpoint import save_compressed
from quantization.quantize import main as quantize_main
from quantization.quantize import quantize_checkpoint_rtn
from quantization.reference import QuantScheme, quantize_rtn

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
SCHEMES = {"w4a16_g32": QuantScheme(4, True, 32), "w8a16": QuantScheme(8, True, None)}


@pytest.fixture(scope="module")
def tied_float(tmp_path_factory):
    """A tiny tied checkpoint (SmolLM2's shape of the problem: one matrix for embedding and lm_head)."""
    path = tmp_path_factory.mktemp("tied") / "float"
    make_tiny_engine_checkpoint(path, "llama", seed=5, tie_word_embeddings=True, **TINY_QUANT)
    return path


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def hf_tokens(path):
    from transformers import AutoTokenizer

    hf, tokenizer = hf_quantized(path), AutoTokenizer.from_pretrained(path)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_a_quantized_lm_head_runs_as_hf_runs_it(case, tiny_float, make_llm, tmp_path):
    float_dir, _ = tiny_float
    weights = quantize_checkpoint_rtn(float_dir, SCHEMES[case], lm_head=True)
    path = save_compressed(float_dir, tmp_path / case, weights)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"] and config["ignore"] == []
    llm = make_llm(path)
    head = llm.llm_engine.engine_core.model_executor.model_runner.model.lm_head
    assert "weight" not in dict(head.named_parameters())             # integers only: no float copy kept
    assert tokens(llm) == hf_tokens(path)


def test_a_tied_lm_head_is_untied_and_quantized(tied_float, make_llm, tmp_path):
    """The embedding lookup keeps its float rows; the lm_head gets the embedding's matrix in integers."""
    from safetensors.torch import load_file

    scheme = SCHEMES["w4a16_g32"]
    path = tmp_path / "tied_w4"
    quantize_main(["--model", str(tied_float), "--out", str(path), "--scheme", "W4A16", "--group-size", "32",
                   "--lm-head"])
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    stored, source = load_file(str(path / "model.safetensors")), load_file(str(tied_float / "model.safetensors"))
    embedding = source["model.embed_tokens.weight"]
    assert torch.equal(stored["model.embed_tokens.weight"], embedding)
    assert torch.equal(stored["lm_head.weight_scale"], quantize_rtn(embedding, scheme).scale)
    assert "lm_head.weight" not in stored
    assert tokens(make_llm(path)) == hf_tokens(path)


def test_an_lm_head_with_a_scheme_of_its_own(tied_float, make_llm, tmp_path):
    """int4 decoder linears, an int8 lm_head: two config groups, the lm_head's naming it. HF and the
    engine give the same tokens, and so does the float engine on the dequantized copy."""
    from quantization.checkpoint import save_decompressed

    path = tmp_path / "mixed"
    quantize_main(["--model", str(tied_float), "--out", str(path), "--scheme", "W4A16", "--group-size", "32",
                   "--lm-head-scheme", "W8A16"])
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["Linear"], ["lm_head"]]
    assert [g["weights"]["num_bits"] for g in groups.values()] == [4, 8] and config["format"] == "mixed-precision"
    ours = tokens(make_llm(path))
    assert ours == hf_tokens(path)
    assert ours == tokens(make_llm(save_decompressed(path, tmp_path / "float")))


def test_gptq_lm_head_flag_loads_the_same_integers(tiny_float, make_llm, tmp_path):
    float_dir, _ = tiny_float
    weights = quantize_checkpoint_rtn(float_dir, SCHEMES["w4a16_g32"], lm_head=True)
    gptq = save_compressed(float_dir, tmp_path / "gptq", weights, checkpoint_format="gptq")
    assert json.loads((gptq / "config.json").read_text())["quantization_config"]["lm_head"] is True
    assert tokens(make_llm(gptq)) == tokens(make_llm(save_compressed(float_dir, tmp_path / "ct", weights)))


def test_tensor_parallel_shards_of_a_quantized_lm_head(tied_float, make_llm, tmp_path):
    """TP=2: each rank holds its rows of the vocabulary in integers; the gathered logits give TP=1's tokens."""
    path = save_compressed(tied_float, tmp_path / "w8",
                           quantize_checkpoint_rtn(tied_float, SCHEMES["w8a16"], lm_head=True))
    llm = make_llm(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert tokens(llm) == tokens(make_llm(path))
    finally:
        llm.shutdown()


def test_the_class_target_linear_does_not_reach_the_lm_head(tiny_float, make_llm, tmp_path):
    """vLLM 0.32: a ParallelLMHead is no LinearBase, so targets ["Linear"] leave it unquantized and its
    integers have no parameter to load into (vLLM: "There is no module or parameter named
    'lm_head.weight_packed'"). Refused here too, naming the tensor."""
    float_dir, _ = tiny_float
    path = save_compressed(float_dir, tmp_path / "w4",
                           quantize_checkpoint_rtn(float_dir, SCHEMES["w4a16_g32"], lm_head=True))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, KeyError), match="lm_head.weight_packed"):
        make_llm(path)


def test_gptq_quantizes_the_lm_head_on_the_final_norms_outputs(tied_float, make_llm, tmp_path):
    """GPTQ's lm_head: its error on what it calibrated on (the final norm's outputs of the quantized
    layers) is below round-to-nearest's on the same inputs; the checkpoint runs as HF runs it."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantization.calibration import calibration_samples
    from quantization.gptq import gptq_quantize_model

    scheme = SCHEMES["w4a16_g32"]
    hf = AutoModelForCausalLM.from_pretrained(tied_float, dtype=torch.float32).eval()
    samples = calibration_samples(AutoTokenizer.from_pretrained(tied_float), 4, 64)
    model = copy.deepcopy(hf)
    weights = gptq_quantize_model(model, samples, scheme, act_order=True, lm_head_scheme=scheme)
    w = hf.get_output_embeddings().weight.detach()
    assert torch.equal(model.get_output_embeddings().weight, w)                # the float (tied) matrix kept
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        model(samples)
    x = torch.cat(seen).reshape(-1, w.shape[1])                                # [tokens, hidden]

    def error(q):
        return float(((x @ (q.dequantize() - w).T) ** 2).sum())
    assert error(weights["lm_head"]) < error(quantize_rtn(w, scheme))

    path = tmp_path / "gptq_head"
    quantize_main(["--model", str(tied_float), "--out", str(path), "--scheme", "W4A16", "--group-size", "32",
                   "--method", "gptq", "--lm-head", "--num-samples", "4", "--seq-len", "64"])
    assert tokens(make_llm(path)) == hf_tokens(path)


def test_lm_head_with_awq_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        quantize_main(["--out", str(tmp_path / "x"), "--method", "awq", "--lm-head"])
    assert "--lm-head: with rtn or gptq" in capsys.readouterr().err


@pytest.mark.parametrize("fmt, w8a8", [("compressed-tensors", False), ("compressed-tensors", True), ("gptq", False)])
def test_tensor_parallel_per_channel_scales(tiny_float, make_llm, tmp_path, fmt, w8a8):
    """Per-channel int8 (one scale per output row) under TP=2: a row-parallel rank holds a slice of
    the inputs and the WHOLE [out, 1] scale column (was: split like the weight's columns, refused)."""
    float_dir, _ = tiny_float
    path = save_compressed(float_dir, tmp_path / "w8", quantize_checkpoint_rtn(float_dir, SCHEMES["w8a16"]),
                           w8a8=w8a8, checkpoint_format=fmt)
    llm = make_llm(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert tokens(llm) == tokens(make_llm(path))
    finally:
        llm.shutdown()


def test_engine_benchmark_smoke(tmp_path):
    """benchmarks/bench_quantization.py --smoke: every side on both workloads, the quantized-lm_head
    sides among them, a held-out perplexity for each weight-only checkpoint, the JSON written."""
    from benchmarks import bench_quantization as bench

    result = bench.main(["--smoke", "--rounds", "1", "--out-dir", str(tmp_path)])
    rows = result["rows"]
    sides = {(r["dtype"], r["weights"]) for r in rows}
    assert sides == {("float32", s) for s in bench.FP32_SIDES} | {("bfloat16", s) for s in bench.BF16_SIDES}
    assert all(len([r for r in rows if (r["dtype"], r["weights"]) == side]) == 2 for side in sides)
    assert all(r["held_out_perplexity"] > 1 for r in rows if r["weights"] in bench.WEIGHT_ONLY)
    assert json.loads(result["path"].read_text())["rows"] == rows
