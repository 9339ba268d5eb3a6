"""The command line: `python -m mini_vllm {generate, chat, bench, demo, serve}`.

Mirrors vLLM's `vllm` CLI (`vllm/entrypoints/cli/`: `vllm chat`, `vllm bench throughput`) and
its engine flags (`vllm/engine/arg_utils.py: EngineArgs.add_cli_args`, same names):

    python -m mini_vllm generate --prompt "The capital of France is" --max-tokens 32 --temperature 0
    python -m mini_vllm generate --prompts-file prompts.txt --chat          # one prompt per line
    python -m mini_vllm chat                                                # interactive, streaming
    python -m mini_vllm bench --num-requests 64 --input-len 256 --output-len 128
    python -m mini_vllm demo                                                # what `make demo` runs
    python -m mini_vllm serve --port 8000                                   # the OpenAI-compatible server

Every command takes the engine flags (--model, --max-num-seqs, --kv-cache-memory, ...) and
prints the KV cache size the engine chose at start-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import random
import sys
import time
from pathlib import Path

from scheduler import POLICIES

from mini_vllm.engine_config import CPU_KERNELS, GiB, EngineConfig
from mini_vllm.models.linear_method import CPU_GEMMS
from mini_vllm.sampler import LOGPROBS_MODES
from mini_vllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory that is paged.",
    "Explain in two sentences why batching makes a GPU faster.",
    "Give three tips for writing good unit tests.",
    "What is the difference between a list and a tuple in Python?",
    "Name the planets of the solar system.",
    "Translate 'good morning' into French, Spanish and German.",
    "Why is the sky blue? Answer briefly.",
]


# ------------------------------------------------------------------------------ arguments
def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF-format checkpoint directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton", "cuda", "reference"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV cache (CPU default: 2)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="this many KV blocks, whatever the memory (tests: a small pool)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU memory for swapped-out KV")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cpu-kernels", default="auto", choices=list(CPU_KERNELS),
                   help="the CPU fast paths (kernels_cpu/): where they build (auto), or none: torch ops alone (off)")
    g.add_argument("--cpu-gemm-backend", default="auto", choices=list(CPU_GEMMS),
                   help="CPU linears on prepacked weights: our C++ kernel (cpu), oneDNN (onednn), the first "
                        "that runs here (auto), or plain F.linear (torch)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(POLICIES))
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' "
                        "(none), or a directory holding a generation_config.json")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help="the most logprobs / prompt_logprobs a request may ask for (-1: no limit)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=list(LOGPROBS_MODES))
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule step N+1 while step N runs")
    g.add_argument("--structured-outputs-config", type=json_dict, default=None,
                   help='JSON (chapter 08), e.g. \'{"backend": "xgrammar"}\' (default backend: from_scratch)')
    g = p.add_argument_group("parallelism, speculative decoding, KV transfer")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="who runs the ranks (default: uni for one rank, mp for more)")
    g.add_argument("--speculative-config", type=json_dict, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    g.add_argument("--kv-transfer-config", type=json_dict, default=None,
                   help='JSON, e.g. \'{"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_producer", '
                        '"kv_connector_extra_config": {"metadata_server": "127.0.0.1:5555"}}\'')
    g = p.add_argument_group("LoRA adapters (chapter 09)")
    g.add_argument("--enable-lora", action="store_true", help="requests may run with a LoRA adapter")
    g.add_argument("--max-loras", type=int, default=1, help="adapters one step may use (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (slots are this wide)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached in host memory (default: max-loras)")
    g = p.add_argument_group("quantization (chapter 10)")
    g.add_argument("--quantization", "-q", default=None,
                   help="the checkpoint's quantization method (default: what its config.json says), e.g. compressed-tensors")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="what the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 (per-layer scales), "
                        "int8_per_token_head, fp8_per_token_head (a scale per token and KV head)")


def json_dict(text: str) -> dict:
    """A JSON object from the command line (vLLM's config flags take JSON)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=int(args.kv_cache_memory * GiB) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, preemption_mode=args.preemption_mode,
        swap_space=args.swap_space, enforce_eager=args.enforce_eager, cpu_kernels=args.cpu_kernels,
        cpu_gemm_backend=args.cpu_gemm_backend, seed=args.seed, num_gpu_blocks_override=args.num_gpu_blocks_override,
        tokenizer=args.tokenizer, scheduling_policy=args.scheduling_policy, generation_config=args.generation_config,
        max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, speculative_config=args.speculative_config,
        kv_transfer_config=args.kv_transfer_config, structured_outputs_config=args.structured_outputs_config,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)


def sampling_params(args, **overrides) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    min_p=args.min_p, max_tokens=args.max_tokens, stop=args.stop,
                                    ignore_eos=args.ignore_eos), **overrides})


def make_llm(args):
    from mini_vllm.llm import LLM

    return LLM(**vars(engine_config(args)))


def summary(outputs, seconds: float) -> str:
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    text = (f"{len(outputs)} requests, {n_in} prompt + {n_out} output tokens in {seconds:.2f} s: "
            f"{n_out / seconds:.1f} output tok/s, {(n_in + n_out) / seconds:.1f} total tok/s")
    if ttft:
        text += f"; mean TTFT {1000 * sum(ttft) / len(ttft):.0f} ms"
    return text


# ------------------------------------------------------------------------------ commands
def cmd_generate(args) -> None:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("give --prompt TEXT (repeatable) or --prompts-file FILE")
    llm = make_llm(args)
    params = sampling_params(args)
    t0 = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}   [{out.outputs[0].finish_reason}]")
    print("\n" + summary(outputs, seconds))


def cmd_chat(args, stdin=None) -> None:
    """Read a line, stream the reply token by token (DELTA outputs of LLMEngine.step)."""
    stdin = stdin or sys.stdin
    llm = make_llm(args)
    engine = llm.llm_engine
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the model; an empty line or Ctrl-D ends the session", flush=True)
    for turn in itertools.count():
        print("you> ", end="", flush=True)
        line = stdin.readline()
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        text, ids = engine.apply_chat_template(messages)
        engine.add_request(f"chat-{turn}", text, sampling_params(args, output_kind=RequestOutputKind.DELTA),
                           prompt_token_ids=ids)
        print("model> ", end="", flush=True)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.outputs[0].text, end="", flush=True)
                reply += out.outputs[0].text
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def cmd_bench(args) -> None:
    """Offline throughput on a synthetic workload: random token prompts, ignore_eos, greedy."""
    llm = make_llm(args)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False,
                             max_tokens=rng.randint(lo_out, hi_out)) for _ in prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)            # warm-up
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    print(f"workload: {args.num_requests} requests, random prompts of {lo_in}-{hi_in} tokens, "
          f"outputs of {lo_out}-{hi_out} tokens (ignore_eos, greedy)")
    print(summary(outputs, seconds))


def cmd_demo(args) -> None:
    """The default model on a fresh machine: a batch of chat questions, the answers, the speed."""
    t0 = time.perf_counter()
    llm = make_llm(args)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s ({llm.llm_engine.model_config.model.name}, "
          f"{llm.llm_engine.config.resolved_device}, attention backend {llm.llm_engine.config.resolved_attention_backend})")
    print(llm.llm_engine.kv_cache_report)
    questions = DEMO_QUESTIONS[:args.num_prompts]
    params = sampling_params(args)
    llm.chat([[{"role": "user", "content": q}] for q in questions[:1]], SamplingParams(max_tokens=2), use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    for q, out in zip(questions, outputs):
        print(f"\n>>> {q}\n{out.outputs[0].text.strip()}")
    print("\n" + summary(outputs, seconds) + " (all questions batched together)")


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete prompts (one batch) and print them")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_sampling_args(p)
    add_engine_args(p)

    p = sub.add_parser("chat", help="interactive chat, streaming the replies")
    p.add_argument("--system", default=None, help="a system prompt")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)

    p = sub.add_parser("bench", help="throughput on a synthetic workload")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    add_engine_args(p)

    p = sub.add_parser("serve", help="the OpenAI-compatible server (entrypoints/api_server.py)")
    from mini_vllm.entrypoints.cli_args import add_serve_args   # argparse only: fastapi loads in cmd_serve
    add_serve_args(p)
    add_engine_args(p)

    p = sub.add_parser("disagg-proxy", help="prefill/decode disaggregation: a proxy before a prefill and a decode "
                                           "server (entrypoints/disagg_proxy.py)")
    p.add_argument("--prefill", required=True, help="the prefill server's URL (kv_role kv_producer)")
    p.add_argument("--decode", required=True, help="the decode server's URL (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="warning")
    p = sub.add_parser("demo", help="the default model answers a batch of questions (make demo)")
    p.add_argument("--num-prompts", type=int, default=len(DEMO_QUESTIONS))
    add_sampling_args(p, max_tokens=96)
    add_engine_args(p)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "demo" and args.max_model_len is None:
        args.max_model_len = 2048           # SmolLM2's 8192 is not needed for a demo; smaller KV floor
    logging.basicConfig(level=logging.INFO, format="[mini_vllm] %(message)s")
    {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "demo": cmd_demo,
     "serve": cmd_serve, "disagg-proxy": cmd_disagg_proxy}[args.command](args)


def cmd_disagg_proxy(args) -> None:
    from mini_vllm.entrypoints.disagg_proxy import run_proxy

    run_proxy(args)


def cmd_serve(args) -> None:
    from mini_vllm.entrypoints.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    # A server warms up before it answers /health (vLLM's CPU worker does): see EngineConfig.cpu_warm_up.
    run_server(args, dataclasses.replace(engine_config(args), cpu_warm_up=True))
