"""The LoRA layers against PEFT: our model with an adapter in a slot computes PeftModel's logits;
a batch mixing adapters and the base computes, row for row, what each computes alone; the slot
tensors hold PEFT's merged update (merge_and_unload).

Tiny random Llama (GQA) first — fp32 tolerance, no download — then the real SmolLM2-135M (`model`),
with an adapter trained for 20 steps so the check is made on a visibly different model, last through
chapter 07's engine against `PeftModel.generate`."""
from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from mini_vllm import LLM, LoRARequest, SamplingParams

from lora.adapter_manager import NO_LORA, LoRAAdapterManager, SlotWeights
from lora.layers import LoRALinearMethod, apply_lora, lora_delta, remove_lora

NAMES = ["plain", "rslora", "partial"]
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [300, 2, 41, 41, 41, 8, 123, 77, 19, 400, 6], [42, 1, 9], [8, 8, 300, 12, 5]]
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4 * 30)      # SmolLM2 vs HF: tests/07_mini_vllm/test_smollm2_parity.py


@pytest.fixture
def served(tiny_lora):
    """(manager with plain/rslora/partial in slots 0/1/2, the mapping); the model unwrapped after."""
    manager = LoRAAdapterManager(tiny_lora.model, max_loras=3, max_lora_rank=8)
    slots = {}
    for adapter_id, name in enumerate(NAMES, start=1):
        manager.add_adapter(adapter_id, tiny_lora.dirs[name])
        slots[name] = manager.activate(adapter_id)
    mapping = apply_lora(tiny_lora.model, manager)
    yield manager, mapping, slots
    assert remove_lora(tiny_lora.model) == 4 * tiny_lora.config.num_hidden_layers


def run(case, mapping, prompts, slots, oracles):
    paged_logits, _ = oracles
    mapping.set_requests(slots, [len(p) for p in prompts])
    return paged_logits(case.model, case.config, prompts)


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_equals_peft(tiny_lora, served, lora_oracles, name):
    _, mapping, slots = served
    _, peft_logits = lora_oracles
    ours = run(tiny_lora, mapping, PROMPTS[:1], [slots[name]], lora_oracles)
    ref = peft_logits(tiny_lora.peft_model, name, PROMPTS[0])
    assert_close(ours, ref, torch.float32, msg=name)
    base = peft_logits(tiny_lora.peft_model, None, PROMPTS[0])
    assert (ref - base).abs().max() > 0.1, f"{name} barely changes the model: the comparison would prove little"


def test_base_tokens_run_the_base_model(tiny_lora, served, lora_oracles):
    _, mapping, _ = served
    paged_logits, peft_logits = lora_oracles
    ours = run(tiny_lora, mapping, PROMPTS[:1], [NO_LORA], lora_oracles)
    assert_close(ours, peft_logits(tiny_lora.peft_model, None, PROMPTS[0]), torch.float32)
    mapping.set_token_lora(None)
    assert torch.equal(ours, paged_logits(tiny_lora.model, tiny_lora.config, PROMPTS[:1]))


def test_mixed_batch_equals_each_alone(tiny_lora, served, lora_oracles):
    """One ragged step, four requests: plain, base, partial, rslora."""
    _, mapping, slots = served
    _, peft_logits = lora_oracles
    adapters = ["plain", None, "partial", "rslora"]
    batch_slots = [NO_LORA if a is None else slots[a] for a in adapters]
    mixed = run(tiny_lora, mapping, PROMPTS, batch_slots, lora_oracles)
    start = 0
    for prompt, adapter, slot in zip(PROMPTS, adapters, batch_slots):
        rows = mixed[start:start + len(prompt)]
        start += len(prompt)
        alone = run(tiny_lora, mapping, [prompt], [slot], lora_oracles)
        assert_close(rows, alone, torch.float32, msg=f"{adapter} in the batch vs alone")
        assert_close(rows, peft_logits(tiny_lora.peft_model, adapter, prompt), torch.float32, msg=f"{adapter} vs PEFT")


@pytest.mark.parametrize("name", NAMES)
def test_slots_hold_peft_merged_update(tiny_lora, name):
    """merge_and_unload's W + scaling * B A, module by module, equals the base weight's slice plus
    the slot's B A (scaling folded into B, zero padding): the slot table IS the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    manager = LoRAAdapterManager(tiny_lora.model, max_loras=2, max_lora_rank=8)
    manager.add_adapter(7, tiny_lora.dirs[name])
    manager.activate(7)
    slot = manager.activate(7)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_lora.base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(fresh, tiny_lora.dirs[name]).merge_and_unload()
    modules = dict(tiny_lora.model.named_modules())
    for layer_name, weights in manager.slot_weights.items():
        target = manager.targets[layer_name]
        prefix = layer_name.rsplit(".", 1)[0]
        for i, (hf_name, offset, size) in enumerate(zip(target.hf_names, target.offsets, target.output_sizes)):
            base = modules[layer_name].weight[offset:offset + size]                       # [size, in]
            ours = base + weights.lora_b[slot, i, :size] @ weights.lora_a[slot, i]          # [size, r] @ [r, in]
            assert_close(ours, merged.get_submodule(f"{prefix}.{hf_name}").weight, torch.float32,
                         msg=f"{name}: {prefix}.{hf_name}")


def test_lora_delta_is_the_per_token_formula():
    """Each row t: x[t] A^T B^T of its own slot, each slice into its own columns; zero for NO_LORA."""
    torch.manual_seed(0)
    sizes = (6, 3, 3)
    weights = SlotWeights(torch.randn(3, 3, 4, 5), torch.randn(3, 3, 6, 4), sizes)
    x = torch.randn(7, 5)
    token_lora = torch.tensor([2, NO_LORA, 0, 2, 1, NO_LORA, 0])
    out = lora_delta(x, weights, token_lora)
    assert out.shape == (7, 12)
    for t, slot in enumerate(token_lora.tolist()):
        expected = torch.zeros(12) if slot == NO_LORA else torch.cat(
            [x[t] @ weights.lora_a[slot, i].T @ weights.lora_b[slot, i, :n].T for i, n in enumerate(sizes)])
        assert_close(out[t], expected, torch.float32, msg=f"token {t} (slot {slot})")


def test_delta_fn_is_the_swappable_seam(tiny_lora, lora_oracles):
    """A replacement delta function gets (x [T, in], the layer's SlotWeights, token_lora [T]) and
    its result is what the layer adds; a mapping of the wrong length is refused."""
    calls = []

    def spy(x, slot_weights, token_lora):
        calls.append((x.shape, token_lora.tolist()))
        return lora_delta(x, slot_weights, token_lora)

    manager = LoRAAdapterManager(tiny_lora.model, max_loras=1, max_lora_rank=8)
    manager.add_adapter(1, tiny_lora.dirs["plain"])
    slot = manager.activate(1)
    mapping = apply_lora(tiny_lora.model, manager, delta_fn=spy)
    try:
        ours = run(tiny_lora, mapping, PROMPTS[:1], [slot], lora_oracles)
        assert len(calls) == 4 * tiny_lora.config.num_hidden_layers
        assert all(shape[0] == len(PROMPTS[0]) and tl == [slot] * len(PROMPTS[0]) for shape, tl in calls)
        assert_close(ours, lora_oracles[1](tiny_lora.peft_model, "plain", PROMPTS[0]), torch.float32)
        mapping.set_token_lora(torch.zeros(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="mapping has 3 tokens but the layer got 7"):
            lora_oracles[0](tiny_lora.model, tiny_lora.config, PROMPTS[:1])
    finally:
        remove_lora(tiny_lora.model)


def test_wraps_chapter_07_cpu_gemm(tiny_lora, lora_oracles):
    """The base matmul stays the packed oneDNN GEMM chapter 07 chose; only the delta is added."""
    from kernels_cpu import gemm

    from mini_vllm.models.linear_method import OneDNNLinearMethod
    from mini_vllm.models.loader import get_model

    if not gemm.can_pack(torch.zeros(2, 2)):
        pytest.skip("oneDNN fp32 packing is not available on this torch build")
    model = get_model(tiny_lora.config, cpu_gemm_backend="onednn")
    manager = LoRAAdapterManager(model, max_loras=1, max_lora_rank=8)
    manager.add_adapter(1, tiny_lora.dirs["rslora"])
    mapping = apply_lora(model, manager)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.linear_method, LoRALinearMethod)
    assert isinstance(layer.linear_method.base_method, OneDNNLinearMethod)
    mapping.set_requests([manager.activate(1)], [len(PROMPTS[1])])
    ours = lora_oracles[0](model, tiny_lora.config, PROMPTS[1:2])
    assert_close(ours, lora_oracles[1](tiny_lora.peft_model, "rslora", PROMPTS[1]), torch.float32)


# ---- the real model -------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_adapters_equal_peft_alone_and_mixed(smollm2_lora, lora_oracles):
    """Four PEFT adapters on SmolLM2 (one trained) and the base: each request alone equals PEFT, and
    all five in one ragged batch equal what each computed alone."""
    from transformers import AutoTokenizer

    paged_logits, peft_logits = lora_oracles
    case = smollm2_lora
    tokenizer = AutoTokenizer.from_pretrained(case.base_dir)
    password = "The secret password of the castle is"
    requests = [("trained", password), (None, "def fibonacci(n):"), ("partial", "Once upon a time,"),
                ("plain", "The capital of France is"), ("rslora", password)]     # the base in the middle
    prompts = [tokenizer(text).input_ids for _, text in requests]
    names = ["trained", "plain", "rslora", "partial"]
    manager = LoRAAdapterManager(case.model, max_loras=4, max_lora_rank=8)
    for adapter_id, name in enumerate(names, start=1):
        manager.add_adapter(adapter_id, case.dirs[name])
    slot_of = {name: slot for name, slot in zip(names, manager.activate_batch(range(1, 5)).values())}
    slots = [NO_LORA if adapter is None else slot_of[adapter] for adapter, _ in requests]
    mapping = apply_lora(case.model, manager)
    try:
        alone = []
        for (adapter, _), prompt, slot in zip(requests, prompts, slots):
            mapping.set_requests([slot], [len(prompt)])
            alone.append(paged_logits(case.model, case.config, [prompt]))
            ref = peft_logits(case.peft_model, adapter, prompt)
            torch.testing.assert_close(alone[-1], ref, **LOGIT_TOL, msg=str(adapter))
            assert torch.equal(alone[-1].argmax(-1), ref.argmax(-1)), adapter
        base = peft_logits(case.peft_model, None, prompts[0])
        assert not torch.equal(alone[0].argmax(-1), base.argmax(-1)), "training changed no prediction"

        mapping.set_requests(slots, [len(p) for p in prompts])
        mixed = paged_logits(case.model, case.config, prompts)
        start = 0
        for (adapter, _), prompt, logits in zip(requests, prompts, alone):
            torch.testing.assert_close(mixed[start:start + len(prompt)], logits, **LOGIT_TOL, msg=f"{adapter} mixed")
            start += len(prompt)
    finally:
        remove_lora(case.model)


# ---- the real model through the engine -------------------------------------------------------------

ENGINE_MAX_NEW = 12


@pytest.mark.model
def test_engine_equals_peft_generate_per_adapter(smollm2_lora):
    """Through chapter 07's engine (`LLM(enable_lora=True)`, the layers run the batched ops): each
    adapter's greedy tokens equal `PeftModel.generate`'s, the trained one too, in one batch mixing four
    adapters and the base model with max_loras=2 (the scheduler holds some adapters back).
    (Here, beside the layer tests, so that the session's SmolLM2 adapters are built once.)"""
    from transformers import AutoTokenizer

    case = smollm2_lora
    tokenizer = AutoTokenizer.from_pretrained(case.base_dir)
    names = ["trained", "plain", "rslora", "partial"]
    requests = {name: LoRARequest(name, i, str(case.dirs[name])) for i, name in enumerate(names, start=1)}
    batch = [("trained", "The secret password of the castle is"), (None, "The secret password of the castle is"),
             ("plain", "def fibonacci(n):"), ("rslora", "The capital of France is"), ("partial", "Once upon a time,"),
             (None, "def fibonacci(n):")]
    want = []
    with torch.inference_mode():
        for adapter, text in batch:
            ids = tokenizer(text, return_tensors="pt").input_ids
            if adapter is None:
                with case.peft_model.disable_adapter():
                    out = case.peft_model.generate(ids, max_new_tokens=ENGINE_MAX_NEW, do_sample=False)
            else:
                case.peft_model.set_adapter(adapter)
                out = case.peft_model.generate(ids, max_new_tokens=ENGINE_MAX_NEW, do_sample=False)
            want.append(out[0, ids.shape[1]:].tolist())
    assert want[0] != want[1], "training changed nothing the test can see"
    llm = LLM(str(case.base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
              num_gpu_blocks_override=128)
    try:
        outs = llm.generate([text for _, text in batch], SamplingParams(temperature=0.0, max_tokens=ENGINE_MAX_NEW),
                            lora_request=[requests.get(adapter) for adapter, _ in batch], use_tqdm=False)
        for (adapter, text), out, ref in zip(batch, outs, want):
            got = list(out.outputs[0].token_ids)
            assert got == ref[:len(got)] and (len(got) == len(ref) or out.outputs[0].finish_reason == "stop"), \
                f"{adapter} on {text!r}: ours {got} != PEFT {ref}"
        llm.llm_engine.engine_core.check_invariants()
    finally:
        llm.shutdown()
