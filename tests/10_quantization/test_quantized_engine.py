"""The engine on quantized checkpoints: greedy tokens equal HF transformers' on the same checkpoint,
whatever kernel runs the integers, and bad checkpoints refused with the field they got wrong."""
import json
import shutil

import pytest
import torch
from paged_forward import paged_logits
from quant_cases import QUANT_CASES, hf_quantized

from mini_vllm import SamplingParams
from mini_vllm.config import ModelConfig
from mini_vllm.models.loader import get_model
from quantization.checkpoint import save_decompressed
from quantization.quantize import quantize_checkpoint_rtn
from quantization.reference import QuantScheme

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def hf_greedy_text(hf, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                      do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("case", ["w4a16_g32", "w8a16"])
def test_greedy_tokens_equal_hf_on_the_same_checkpoint(case, tiny_quantized, make_llm):
    from transformers import AutoTokenizer

    path = tiny_quantized[case]
    hf, tokenizer = hf_quantized(path), AutoTokenizer.from_pretrained(path)
    llm = make_llm(path)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == hf_greedy_text(hf, tokenizer, prompt), (case, prompt)


def test_asymmetric_greedy_equals_its_dequantized_float_copy(tiny_quantized, make_llm, tmp_path):
    """Asymmetric zero points: HF cannot load them packed (test_checkpoint.py), so the oracle is our
    unquantized engine on the float weights they decompress to (save_decompressed, equal to
    compressed-tensors' own decompressor: test_checkpoint.py)."""
    path = tiny_quantized["w4a16_asym_g64"]
    quantized = make_llm(path).generate(PROMPTS, GREEDY)
    reference = make_llm(save_decompressed(path, tmp_path / "float")).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in quantized] == [o.outputs[0].token_ids for o in reference]


def test_w8a8_logits_follow_hf_within_activation_rounding(tiny_quantized):
    """W8A8 rounds each token's activations to int8 at run time. vLLM's scale is max|x| / 127;
    compressed-tensors' fake quantization in HF uses max|x| / 127.5 (its symmetric grid) and rounds
    in its own order, so the two differ by a rounding of every activation: logits close (measured
    2.5 % of the largest logit on this model), not equal. A wrong scale or a lost zero point would be
    off by far more; the exact check of the arithmetic is test_reference.py / the kernel tests."""
    path = tiny_quantized["w8a8"]
    hf = hf_quantized(path)
    config = ModelConfig.from_pretrained(path)
    ours = get_model(config, cpu_gemm_backend="torch")
    prompt = list(range(1, 40))
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    mine = paged_logits(ours, config, [prompt])
    err = (mine - theirs).abs().max() / theirs.abs().max()
    agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean()
    assert float(err) < 0.05 and float(agree) > 0.85, f"relative logit error {float(err):.4f}, argmax agree {float(agree):.2f}"


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_every_kernel_backend_gives_the_same_tokens(case, tiny_quantized, make_llm):
    """cpu_gemm_backend="torch" runs the readable torch ops; the default runs the C++ kernels."""
    from quantization import cpu_ops
    if not cpu_ops.is_available():
        pytest.skip(f"the C++ kernels do not build here: {cpu_ops.unavailable_reason()}")
    path = tiny_quantized[case]
    plain = make_llm(path, cpu_gemm_backend="torch").generate(PROMPTS, GREEDY)
    fast = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]


# ----------------------------------------------------------------------------------------------
# Bad input: refused at load with the field and value that is not supported
# ----------------------------------------------------------------------------------------------

def rewrite_config(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BAD_CONFIGS = {
    "float weights": (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "type 'float'"),
    "static activations": (lambda q: q["config_groups"]["group_0"].update(
        input_activations=dict(num_bits=8, type="int", symmetric=True, dynamic=False, strategy="tensor")),
        "input_activations"),
    "actorder group": (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder 'group'"),
    "two bits": (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "num_bits 2"),
    "tensor strategy": (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy 'tensor'"),
    "kv cache scheme": (lambda q: q.update(kv_cache_scheme=dict(num_bits=8, type="float")), "kv_cache_scheme"),
    "unknown method": (lambda q: q.update(quant_method="bitsandbytes"), "'bitsandbytes' is not supported"),
}


@pytest.mark.parametrize("what", sorted(BAD_CONFIGS))
def test_unsupported_checkpoint_is_refused_naming_the_field(what, tiny_quantized, tmp_path):
    edit, words = BAD_CONFIGS[what]
    path = rewrite_config(tiny_quantized["w4a16_g32"], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        get_model(ModelConfig.from_pretrained(path), cpu_gemm_backend="torch")


def test_quantization_argument_must_match_the_checkpoint(tiny_quantized, tiny_float):
    with pytest.raises(ValueError, match=r"Unknown quantization method: gptq_marlin_24"):
        ModelConfig.from_pretrained(tiny_quantized["w8a8"], quantization="gptq_marlin_24")
    with pytest.raises(ValueError, match=r"needs a quantized checkpoint"):
        ModelConfig.from_pretrained(tiny_float[0], quantization="compressed-tensors")
    config = ModelConfig.from_pretrained(tiny_quantized["w8a8"], quantization="compressed-tensors")
    assert config.quantization == "compressed-tensors"


def test_a_group_cut_by_the_layer_is_refused(tiny_float, tmp_path):
    """hidden 128 with groups of 256: not a whole group per row (the writer refuses first)."""
    with pytest.raises(ValueError, match="not a multiple of group_size 256"):
        quantize_checkpoint_rtn(tiny_float[0], QuantScheme(4, True, 256))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_run_as_hf_runs_them(method, tiny_float, make_llm, tmp_path):
    """`python -m quantization.quantize --method gptq|awq` writes a checkpoint (AWQ: with its scales
    folded into the norms) that HF and our engine read to the same greedy tokens."""
    from transformers import AutoTokenizer

    from quantization.quantize import main as quantize

    out = tmp_path / method
    quantize(["--model", str(tiny_float[0]), "--out", str(out), "--scheme", "W4A16", "--group-size", "32",
              "--method", method, "--num-samples", "4", "--seq-len", "32"])
    hf, tokenizer = hf_quantized(out), AutoTokenizer.from_pretrained(out)
    for prompt, got in zip(PROMPTS[:2], make_llm(out).generate(PROMPTS[:2], GREEDY)):
        assert got.outputs[0].token_ids == hf_greedy_text(hf, tokenizer, prompt), (method, prompt)
