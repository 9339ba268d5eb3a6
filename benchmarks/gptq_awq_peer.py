"""GPTQ and AWQ checkpoints made here, run by real vLLM 0.32 CPU and by our engine on the same
token ids — in one run, here: does vLLM's own reader of these formats (gptq.py / awq.py) see the
integers ours sees?

    python -m benchmarks.gptq_awq_peer        # SmolLM2-135M, RTN int4 groups of 64, bf16

Checkpoints: `quantization.quantize` with --format gptq (symmetric) and --format awq (asymmetric),
and the compressed-tensors copy of each. Workload: 8 prompts (windows of the repo's corpus, 32
tokens) x 32 greedy tokens, bf16 (vLLM's CPU int4 kernels take bf16 / fp16 activations).
Reported per checkpoint: the share of requests whose tokens equal ours exactly, the mean share of
each answer before the first difference (bf16 rounding differs between the kernels), and
vLLM's own agreement between the format and its compressed-tensors copy.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.bench_engine import make_workload
from benchmarks.common import prefix_agreement, write_result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from mini_vllm import LLM, SamplingParams, default_model_path
    from quantization.checkpoint import save_compressed
    from quantization.quantize import quantize_checkpoint_rtn
    from quantization.reference import QuantScheme

    model = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [p for p, _ in make_workload(tokenizer, 8, (32, 32), (args.max_tokens, args.max_tokens))]
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for fmt, scheme in (("gptq", QuantScheme(4, True, 64)), ("awq", QuantScheme(4, False, 64))):
        weights = quantize_checkpoint_rtn(model, scheme)
        paths = {fmt: save_compressed(model, tmp / fmt, weights, checkpoint_format=fmt),
                 "compressed-tensors": save_compressed(model, tmp / f"{fmt}_ct", weights)}
        ours, theirs = {}, {}
        for kind, path in paths.items():
            llm = LLM(str(path), dtype="bfloat16", max_model_len=256, seed=0)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)
            ours[kind] = [list(o.outputs[0].token_ids) for o in outs]
            llm.shutdown()
            workload = dict(prompts=prompts, max_tokens=[args.max_tokens] * len(prompts), modes=["greedy"],
                            dtype="bfloat16", warmup_prompts=prompts[:1], warmup_max_tokens=[4])
            theirs[kind] = vllm_peer.call(path, workload, "default", 2)["runs"][0]["tokens"]
        rows.append(dict(
            format=fmt, scheme=str(scheme),
            ours_format_equals_ours_compressed_tensors=ours[fmt] == ours["compressed-tensors"],
            vllm_format_equals_vllm_compressed_tensors=theirs[fmt] == theirs["compressed-tensors"],
            vllm_equals_ours_requests=sum(a == b for a, b in zip(theirs[fmt], ours[fmt])) / len(prompts),
            vllm_vs_ours_prefix_share=prefix_agreement(theirs[fmt], ours[fmt])))
        print(rows[-1], flush=True)
    print(write_result("gptq_awq_peer", dict(model="SmolLM2-135M-Instruct", prompts=len(prompts), prompt_tokens=32,
                                             max_tokens=args.max_tokens, dtype="bfloat16", method="rtn"), rows))


if __name__ == "__main__":
    main()
