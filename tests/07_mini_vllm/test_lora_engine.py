"""Chapter 09's adapters in the engine: requests with a LoRARequest, through LLM, LLMEngine and AsyncLLM,
on a tiny random Llama with adapters that PEFT itself made and saved.

The oracle is PEFT: `PeftModel.generate` with the request's adapter set (or disabled, for the base
model) gives each request's greedy tokens. Then the features that compose with it — a mixed batch, the
scheduler's max_loras cap, prefix caching (two adapters never share K/V), chunked prefill, preemption,
n > 1, beam search (against HF's beam search through PEFT), n-gram drafts, async scheduling, the core in
its own process — each against the same tokens; adapters added and removed while requests run. Bad
adapters: refused before anything is queued, or (tensors that do not fit the model) failing their
request alone. The server serves adapters by name. The real SmolLM2 with trained
adapters is tests/09_lora/test_lora_layers.py; TP, PP, DP, the KV connectors and the server's
side of every pair are the composition matrix's (tests/integration).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from peft_adapters import peft_model_with, save_each

from mini_vllm import LLM, LoRARequest, SamplingParams
from mini_vllm.beam_search import BeamSearchParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {                       # name -> PEFT LoraConfig kwargs (init_lora_weights=False: B is not zero)
    "alpha": dict(r=8, lora_alpha=16, target_modules=ALL),
    "beta": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "gamma": dict(r=2, lora_alpha=5, target_modules=["k_proj", "up_proj"]),
}
PROMPTS = [[(37 * i + 11 * j) % 4000 + 200 for j in range(5 + 3 * i)] for i in range(3)]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
BASE = dict(max_lora_rank=8, max_loras=3, max_model_len=128, cpu_kernels="off")


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory, tiny_engine_checkpoint, hf_oracle):
    """(base dir, {name: LoRARequest}, {(name, prompt index): PEFT's greedy tokens}, PeftModel)."""
    root = tmp_path_factory.mktemp("lora-engine")
    hf = tiny_engine_checkpoint(root / "base", "llama", seed=11)       # our own copy: PEFT wraps it in place
    torch.manual_seed(0)
    peft_model = peft_model_with(hf, ADAPTERS).eval()
    dirs = save_each(peft_model, root / "adapters")
    requests = {name: LoRARequest(name, i, str(dirs[name])) for i, name in enumerate(ADAPTERS, 1)}
    hf_greedy, _ = hf_oracle
    want = {}
    for name in [*ADAPTERS, None]:
        for i, prompt in enumerate(PROMPTS):
            if name is None:
                with peft_model.disable_adapter():
                    want[None, i] = hf_greedy(peft_model, prompt, MAX_NEW)
            else:
                peft_model.set_adapter(name)
                want[name, i] = hf_greedy(peft_model, prompt, MAX_NEW)
    return root / "base", requests, want, peft_model


def mixed(requests):
    """Every adapter and the base model, each on every prompt: (prompt, LoRARequest or None, key)."""
    return [(p, requests.get(name), (name, i)) for name in [*ADAPTERS, None] for i, p in enumerate(PROMPTS)]


def generate(llm, batch, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in batch], params,
                        lora_request=[lora for _, lora, _ in batch], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def assert_peft(got, batch, want):
    for tokens, (_, _, key) in zip(got, batch):
        assert tokens == want[key], f"{key}: ours {tokens} != PEFT {want[key]}"


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])      # the ops: batched torch, or the C++ kernels
def test_mixed_batch_equals_peft_per_adapter(lora_case, make_llm, cpu_kernels):
    base, requests, want, _ = lora_case
    assert any(want[name, 0] != want[None, 0] for name in ADAPTERS), "the adapters change nothing: a vacuous test"
    llm = make_llm(base, enable_lora=True, **{**BASE, "cpu_kernels": cpu_kernels})
    from lora import cpu_ops
    from mini_vllm.lora_mixin import lora_backend
    built = cpu_ops.is_available()                 # (a machine without a compiler: the torch ops)
    assert lora_backend(llm.llm_engine.config) == ("cpu" if cpu_kernels == "auto" and built else "torch")
    batch = mixed(requests)
    got, outs = generate(llm, batch)
    assert_peft(got, batch, want)
    assert [o.lora_request for o in outs] == [lora for _, lora, _ in batch]      # vLLM's RequestOutput field
    alone = [generate(llm, [item])[0][0] for item in batch[::4]]                 # each run alone: the same
    assert alone == got[::4]


def write_peft_adapter(path: Path, base: Path, r: int, seed: int) -> Path:
    """An adapter directory in PEFT's format written by hand (the GPU machines have no PEFT): every
    linear of every layer, A and B random."""
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) / r ** 0.5
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=r, lora_alpha=2 * r, bias="none",
                                                              target_modules=ALL)))
    return path


@pytest.mark.gpu
def test_on_the_gpu_the_triton_ops_give_the_cpu_engines_tokens(offline_engine_models, make_llm, tmp_path):
    """device="cuda": the layers run chapter 09's Triton kernels (native); greedy tokens = the CPU engine's
    (whose tokens the tests above hold to PEFT's)."""
    base = offline_engine_models["llama"][0]
    loras = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(tmp_path / f"a{i}", base, 8, i))) for i in range(2)]
    prompts = [[t % 500 for t in p] for p in PROMPTS * 2]               # (this checkpoint's vocabulary: 512)
    batch = [(p, lora, None) for p, lora in zip(prompts, [loras[0], None, loras[1], loras[1], loras[0], None])]
    cpu = generate(make_llm(base, enable_lora=True, **BASE), batch)[0]
    gpu = generate(make_llm(base, enable_lora=True, device="cuda", **BASE), batch)[0]
    assert gpu == cpu and cpu[0] != cpu[1]                            # the adapter changes the tokens


def test_max_loras_caps_the_adapters_of_every_step(lora_case, make_llm, traced):
    base, requests, want, _ = lora_case
    llm = make_llm(base, enable_lora=True, **{**BASE, "max_loras": 1})
    batch = mixed(requests)
    lora_of = {f"t{i}": (lora.lora_int_id if lora else None) for i, (_, lora, _) in enumerate(batch)}
    engine = llm.llm_engine
    for i, (prompt, lora, _) in enumerate(batch):
        engine.add_request(f"t{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        scheduled = engine.last_step.scheduler_output.num_scheduled_tokens
        adapters = {lora_of[r] for r in scheduled} - {None}
        most = max(most, len(adapters))
        assert len(adapters) <= 1, f"a step ran adapters {adapters} with max_loras=1"
    assert most == 1
    assert_peft([outputs[f"t{i}"] for i in range(len(batch))], batch, want)
    engine.engine_core.check_invariants()


def test_prefix_cache_never_shares_kv_between_adapters(lora_case, make_llm):
    base, requests, want, _ = lora_case
    llm = make_llm(base, enable_lora=True, enable_prefix_caching=True, block_size=4, **BASE)
    prompt = PROMPTS[2]                                                          # 11 tokens: two full blocks
    first = generate(llm, [(prompt, requests["alpha"], ("alpha", 2))])[1][0]
    again = generate(llm, [(prompt, requests["alpha"], ("alpha", 2))])[1][0]
    other = generate(llm, [(prompt, requests["beta"], ("beta", 2))])[1][0]
    base_run = generate(llm, [(prompt, None, (None, 2))])[1][0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 8         # the same adapter hits
    assert other.num_cached_tokens == 0 and base_run.num_cached_tokens == 0      # another adapter, the base: never
    for out, key in ((again, ("alpha", 2)), (other, ("beta", 2)), (base_run, (None, 2))):
        assert list(out.outputs[0].token_ids) == want[key]


@pytest.mark.parametrize("feature", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4),  # prompts cut into chunks
    dict(num_gpu_blocks_override=12, block_size=4),                              # preemption (recompute)
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    dict(async_scheduling=True),
], ids=["chunked prefill", "preemption", "n-gram drafts", "async scheduling"])
def test_composes_with_engine_features(lora_case, make_llm, feature):
    base, requests, want, _ = lora_case
    llm = make_llm(base, enable_lora=True, **{**BASE, **feature})
    batch = mixed(requests)
    engine = llm.llm_engine
    for i, (prompt, lora, _) in enumerate(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    got, preempted = {}, 0
    while engine.has_unfinished_requests():
        got.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
        preempted += len(engine.last_step.scheduler_output.preempted_req_ids)
    assert_peft([got[f"r{i}"] for i in range(len(batch))], batch, want)
    if "num_gpu_blocks_override" in feature:
        assert preempted > 0, "nothing was preempted"
    engine.engine_core.check_invariants()


def test_core_process_and_async_llm(lora_case, make_llm):
    base, requests, want, _ = lora_case
    llm = make_llm(base, enable_lora=True, multiprocess_mode=True, **BASE)
    batch = mixed(requests)
    assert_peft(generate(llm, batch)[0], batch, want)

    from mini_vllm.async_llm import AsyncLLM
    from mini_vllm.engine_config import EngineConfig

    engine = AsyncLLM(EngineConfig(model=str(base), enable_lora=True, **BASE), log_stats_interval=None)

    async def run():
        async def one(i, prompt, lora):
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"r{i}", lora_request=lora):
                final = out
            return list(final.outputs[0].token_ids)
        got = await asyncio.gather(*(one(i, p, lora) for i, (p, lora, _) in enumerate(batch)))
        await engine.check_invariants()
        return got
    try:
        assert_peft(asyncio.run(run()), batch, want)
    finally:
        engine.shutdown()


def test_n_and_beam_search_with_an_adapter(lora_case, make_llm):
    base, requests, want, peft_model = lora_case
    llm = make_llm(base, enable_lora=True, **BASE)
    n = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=MAX_NEW,
                                                                      ignore_eos=True, seed=0),
                     lora_request=requests["beta"], use_tqdm=False)[0]
    assert [list(c.token_ids) for c in n.outputs] == [want["beta", 1]] * 3      # top_k=1: every child greedy
    # Beam search through the adapter = HF's beam search through PEFT with that adapter.
    peft_model.set_adapter("gamma")
    prompt = PROMPTS[0]
    with torch.inference_mode():
        hf = peft_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 num_beams=3, num_return_sequences=3, max_new_tokens=5, do_sample=False,
                                 early_stopping=True, length_penalty=1.0, pad_token_id=0)
    ours = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=5),
                           lora_request=requests["gamma"])[0]
    assert [s.tokens for s in ours.sequences] == hf.tolist()


def test_bad_adapters_are_refused_before_anything_is_queued(lora_case, make_llm, tmp_path):
    base, requests, want, _ = lora_case
    plain = make_llm(base, **{k: v for k, v in BASE.items() if not k.startswith("max_lora")})
    with pytest.raises(ValueError, match="but LoRA is not enabled!"):              # vLLM's message
        plain.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=requests["alpha"])
    small = make_llm(base, enable_lora=True, **{**BASE, "max_lora_rank": 1})
    with pytest.raises(ValueError, match="rank r=8 is above max_lora_rank=1"):
        small.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                       lora_request=[None, None, requests["alpha"]])            # the last one: nothing runs
    with pytest.raises(ValueError, match="not found"):
        small.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be an int > 0"):
        LoRARequest("zero", 0, str(tmp_path))
    assert not small.llm_engine.has_unfinished_requests()
    # One id is one adapter until it is removed; then it may name another.
    llm = make_llm(base, enable_lora=True, **BASE)
    other = LoRARequest("alpha-again", requests["gamma"].lora_int_id, requests["alpha"].lora_path)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=requests["gamma"], use_tqdm=False)
    with pytest.raises(ValueError, match="remove_lora"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=other)
    assert llm.llm_engine.remove_lora(requests["gamma"].lora_int_id)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=other, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want["alpha", 0] != want["gamma", 0]   # the runner's slot re-written


def test_an_adapter_that_does_not_fit_fails_its_request_alone(lora_case, make_llm, tmp_path):
    """adapter_config.json is fine, the tensors are not (wrong shapes; a corrupt file): the cheap check
    passes, the model runner's load fails that request with the reason, the others finish."""
    base, requests, want, _ = lora_case
    good = requests["alpha"]
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "adapter_config.json").write_text((Path(good.lora_path) / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file
    tensors = load_file(f"{good.lora_path}/adapter_model.safetensors")
    save_file({k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in tensors.items()},
              str(shapes / "adapter_model.safetensors"))                        # A [r, 2 * hidden]: wrong
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((shapes / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    llm = make_llm(base, enable_lora=True, **BASE)
    batch = [(PROMPTS[0], good, ("alpha", 0)), (PROMPTS[1], LoRARequest("shapes", 7, str(shapes)), None),
             (PROMPTS[2], LoRARequest("corrupt", 8, str(corrupt)), None), (PROMPTS[2], None, (None, 2))]
    got, outs = generate(llm, batch)
    assert got[0] == want["alpha", 0] and got[3] == want[None, 2]
    for out, what in ((outs[1], "has shape"), (outs[2], "not a readable safetensors file")):
        assert out.outputs[0].finish_reason == "error" and what in str(out.outputs[0].stop_reason)
    llm.llm_engine.engine_core.check_invariants()


def test_remove_lora_refuses_an_adapter_in_use(lora_case, make_llm):
    base, requests, _, _ = lora_case
    llm = make_llm(base, enable_lora=True, **BASE)
    engine = llm.llm_engine
    assert engine.add_lora(requests["beta"]) and engine.list_loras() == {requests["beta"].lora_int_id}
    engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=requests["beta"])
    with pytest.raises(ValueError, match="in use by a running request"):
        engine.remove_lora(requests["beta"].lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(requests["beta"].lora_int_id) and not engine.remove_lora(99)
    assert engine.list_loras() == set()


def test_lora_flags_reach_the_engine():
    from mini_vllm.cli import build_parser, engine_config

    args = build_parser().parse_args(["generate", "--prompt", "x", "--enable-lora", "--max-loras", "4",
                                      "--max-lora-rank", "32", "--max-cpu-loras", "6"])
    config = engine_config(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 32, 6)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LLM(enable_lora=True, max_lora_rank=7)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM(enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_the_server_serves_adapters_by_name(lora_case, monkeypatch):
    """--lora-modules, /v1/models, the adapter as a completion's `model` (404 for an unknown name), and
    vLLM's runtime routes /v1/load_lora_adapter and /v1/unload_lora_adapter, which exist only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=true."""
    import httpx2 as httpx

    from openai_server_thread import API_KEY, NAME, ServerThread

    base, requests, want, _ = lora_case
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(url, route, **body):
        return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)

    def complete(url, model, i):
        r = post(url, "completions", model=model, prompt=PROMPTS[i], max_tokens=MAX_NEW, temperature=0.0,
                 ignore_eos=True, return_token_ids=True)
        return r.status_code, r.json()

    fixed = ServerThread(base, lora_modules=[("alpha", requests["alpha"].lora_path)], enable_lora=True, **BASE)
    try:
        models = httpx.get(f"{fixed.url}/v1/models", headers=headers).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(NAME, None), ("alpha", NAME)]
        status, body = complete(fixed.url, "alpha", 1)
        assert status == 200 and body["model"] == "alpha" and body["choices"][0]["token_ids"] == want["alpha", 1]
        status, body = complete(fixed.url, NAME, 1)
        assert body["model"] == NAME and body["choices"][0]["token_ids"] == want[None, 1]
        status, body = complete(fixed.url, "beta", 1)
        assert status == 404 and "does not exist" in body["error"]["message"]
        assert post(fixed.url, "load_lora_adapter", lora_name="beta", lora_path="x").status_code == 404   # no route
        fixed.wait_idle()
    finally:
        fixed.stop()

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    runtime = ServerThread(base, enable_lora=True, **BASE)
    try:
        url, beta = runtime.url, requests["beta"].lora_path
        r = post(url, "load_lora_adapter", lora_name="beta", lora_path=beta)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'beta' added successfully."
        assert post(url, "load_lora_adapter", lora_name="beta", lora_path=beta).status_code == 400   # already loaded
        r = post(url, "load_lora_adapter", lora_name="ghost", lora_path=str(base / "no-such-adapter"))
        assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
        status, body = complete(url, "beta", 2)
        assert status == 200 and body["choices"][0]["token_ids"] == want["beta", 2]
        assert post(url, "unload_lora_adapter", lora_name="beta").status_code == 200
        assert post(url, "unload_lora_adapter", lora_name="beta").status_code == 404
        assert complete(url, "beta", 2)[0] == 404
        # Loaded again, it is a new adapter to the engine (a new id) and gives the same tokens.
        assert post(url, "load_lora_adapter", lora_name="beta", lora_path=beta).status_code == 200
        assert complete(url, "beta", 2)[1]["choices"][0]["token_ids"] == want["beta", 2]
        runtime.wait_idle()
    finally:
        runtime.stop()


def test_adapters_added_and_removed_under_load_lose_no_request(lora_case, make_llm):
    """While requests of one adapter decode, another is added and used, a third removed: every request
    finishes with PEFT's tokens; the adapter in use could not be removed."""
    base, requests, want, _ = lora_case
    llm = make_llm(base, enable_lora=True, **{**BASE, "max_loras": 2})
    engine = llm.llm_engine
    engine.add_lora(requests["gamma"])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"alpha{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=requests["alpha"])
    done, step = {}, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
        step += 1
        if step == 2:
            assert engine.remove_lora(requests["gamma"].lora_int_id)               # unused: gone at once
            with pytest.raises(ValueError, match="in use"):
                engine.remove_lora(requests["alpha"].lora_int_id)
            engine.add_lora(requests["beta"])
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"beta{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=requests["beta"])
    assert step > 2
    for name in ("alpha", "beta"):
        assert [done[f"{name}{i}"] for i in range(len(PROMPTS))] == [want[name, i] for i in range(len(PROMPTS))]
    assert engine.list_loras() == {requests["alpha"].lora_int_id, requests["beta"].lora_int_id}
    engine.engine_core.check_invariants()
