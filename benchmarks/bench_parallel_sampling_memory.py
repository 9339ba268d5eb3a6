"""KV blocks saved by sharing among parallel samples and among beams, in the thesis' form.

    python -m benchmarks.bench_parallel_sampling_memory            # SmolLM2, ~5 min on 2 cores
    python -m benchmarks.bench_parallel_sampling_memory --quick    # tiny random model, 4 prompts, 8 tokens (tests)

[Kwon 2025, §3.6.3, Fig. 3.15] reports the memory saving of parallel sampling as the blocks saved
by sharing divided by the blocks used without sharing (6.1–9.8% on Alpaca, 16.2–30.5% on
ShareGPT, OPT-13B). Here: bench_engine's real-text prompts, each asked for n = 2, 4, 6 samples
(temperature 1, seeded, ignore_eos, fixed output length), run once as n > 1 requests (n child
requests whose prompt the prefix cache shares: parallel_sampling.py) and once as n independent
requests with the prefix cache off (nothing shared). Child i with seed s + i draws what the request
with seed s + i draws (tests/07_mini_vllm/test_parallel_sampling.py), and every completion has the
same fixed length, so both runs hold the same number of tokens per sequence and differ only in how
the K/V is stored (block use depends on lengths, not on token values). The tokens themselves agree
except where fp32 rounding moves a sample: the two runs' batches have different shapes, the logits
differ in the last bits, and at temperature 1 a draw that lands on the boundary between two tail
tokens (probabilities ~1e-6, as close as the rounding of the cumulative sum) takes the neighbour
(`identical_share` in the JSON: the share of completions that agree token for token). Blocks in use are summed over the
steps (block-steps: the integral of the KV footprint) and their peak recorded. One more row: n = 8
on one 1,000-token prompt (64 output tokens), the case the engine's design is judged by.

Beam search ([Kwon 2025, Fig. 3.15]: 37.6–55.2% on Alpaca, 44.3–66.3% on ShareGPT, OPT-13B) is measured
in one run per width W = 2, 4, 6 (ignore_eos, the same fixed output length): "shared" is what the
pool holds (each round's beam requests share their prefixes through the prefix cache: beam_search.py);
"unshared" is what the same requests would hold each with a private copy of its sequence — every
request's block table counted in full, a block shared by k requests k times — read from the same
steps, so the tokens are identical by construction.
Writes benchmarks/results/parallel_sampling_memory.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_result

BLOCK_SIZE = 16


class BlockMeter:
    """Blocks in use, read each step right after schedule() has allocated it (a one-token request's
    blocks are gone again by the end of its step): what the pool holds ("shared") and what the same
    requests would hold with a private copy each ("unshared": every block table counted in full).
    Wraps the engine's scheduler from outside; `close()` restores it."""

    def __init__(self, llm):
        self.scheduler = scheduler = llm.llm_engine.engine_core.scheduler
        self.kv = scheduler.kv_cache_manager
        self.block_steps_shared = self.block_steps_unshared = self.peak_shared = self.peak_unshared = 0
        schedule = scheduler.schedule

        def measured_schedule():
            output = schedule()
            pool = self.kv.block_pool
            shared = pool.num_blocks - pool.get_num_free_blocks()
            unshared = sum(len(blocks) for blocks in self.kv.req_to_blocks.values())
            self.block_steps_shared += shared
            self.block_steps_unshared += unshared
            self.peak_shared, self.peak_unshared = max(self.peak_shared, shared), max(self.peak_unshared, unshared)
            return output
        scheduler.schedule = measured_schedule

    def close(self) -> None:
        del self.scheduler.schedule                       # the class's schedule again


def check_same_lengths(shared: list[list[int]], unshared: list[list[int]], expected: list[int]) -> None:
    """Both runs produced every completion, each of the fixed length: the same workload."""
    assert [len(t) for t in shared] == [len(t) for t in unshared] == expected, "the two runs did different work"


def identical_share(shared: list[list[int]], unshared: list[list[int]]) -> float:
    return round(sum(a == b for a, b in zip(shared, unshared)) / len(shared), 4)


def footprint(llm, prompts: list[list[int]], params: list) -> tuple[int, int, list[list[int]]]:
    """(block-steps, peak blocks, the token ids of every completion) for one run."""
    meter = BlockMeter(llm)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        meter.close()
    return meter.block_steps_shared, meter.peak_shared, [list(c.token_ids) for o in outputs for c in o.outputs]


def beam_footprint(llm, prompts: list[list[int]], params) -> tuple[int, int, int, int]:
    """(block-steps shared, block-steps unshared, peak shared, peak unshared) for one run of
    beam searches."""
    meter = BlockMeter(llm)
    try:
        llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        meter.close()
    return meter.block_steps_shared, meter.block_steps_unshared, meter.peak_shared, meter.peak_unshared


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a tiny random model (SmolLM2's tokenizer), 4 prompts of 8 output tokens (tests)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.bench_engine import make_workload, tiny_model_dir
    from mini_vllm import LLM, BeamSearchParams, SamplingParams, default_model_path

    tmp = tempfile.TemporaryDirectory()
    # The sharing is the same whatever the weights: --quick checks the mechanics in seconds.
    model_dir = tiny_model_dir(Path(tmp.name)) if args.quick else default_model_path()
    num_prompts, output_len = (4, 8) if args.quick else (args.num_prompts, args.output_len)
    workload = make_workload(AutoTokenizer.from_pretrained(model_dir), num_prompts, (32, 512), (output_len, output_len), 0)
    prompts = [p for p, _ in workload]
    # A pool no run fills (no preemption: the footprints are what the requests hold, not what fits).
    common = dict(block_size=BLOCK_SIZE, max_model_len=1024 if args.quick else 1100, max_num_seqs=128,
                  kv_cache_memory=(1 << 30) if args.quick else (3 << 30))
    shared_llm = LLM(str(model_dir), **common)
    unshared_llm = LLM(str(model_dir), enable_prefix_caching=False, **common)
    pool_blocks = shared_llm.llm_engine.engine_core.kv_cache_manager.block_pool.num_blocks
    rows = []
    for n in (2, 4, 6):
        sample = dict(temperature=1.0, max_tokens=output_len, ignore_eos=True)
        shared = footprint(shared_llm, prompts, [SamplingParams(n=n, seed=1000 * i, **sample)
                                                 for i in range(len(prompts))])
        unshared = footprint(unshared_llm, [p for p in prompts for _ in range(n)],
                             [SamplingParams(seed=1000 * i + j, **sample) for i in range(len(prompts)) for j in range(n)])
        check_same_lengths(shared[2], unshared[2], num_prompts * n * [output_len])
        assert max(shared[1], unshared[1]) < pool_blocks, "the pool filled up: a preempted run measures the pool"
        shared_llm.reset_prefix_cache()
        rows.append(dict(kind="parallel_sampling", n=n, block_steps_shared=shared[0], block_steps_unshared=unshared[0],
                         peak_blocks_shared=shared[1], peak_blocks_unshared=unshared[1],
                         memory_saving=round(1 - shared[0] / unshared[0], 4),
                         peak_saving=round(1 - shared[1] / unshared[1], 4),
                         identical_share=identical_share(shared[2], unshared[2])))
        print(rows[-1], flush=True)
    shared_llm.reset_prefix_cache()
    long_prompt = [t for p in prompts for t in p][:1000]          # (--quick: what 4 prompts hold, >= 128)
    sample = dict(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    shared = footprint(shared_llm, [long_prompt], [SamplingParams(n=8, seed=0, **sample)])
    unshared = footprint(unshared_llm, [long_prompt] * 8, [SamplingParams(seed=j, **sample) for j in range(8)])
    check_same_lengths(shared[2], unshared[2], 8 * [output_len])
    rows.append(dict(kind="parallel_sampling", n=8, prompt_len=len(long_prompt), block_steps_shared=shared[0],
                     block_steps_unshared=unshared[0], peak_blocks_shared=shared[1], peak_blocks_unshared=unshared[1],
                     memory_saving=round(1 - shared[0] / unshared[0], 4), peak_saving=round(1 - shared[1] / unshared[1], 4),
                     identical_share=identical_share(shared[2], unshared[2])))
    print(rows[-1], flush=True)
    unshared_llm = None
    for width in (2, 4, 6):
        shared_llm.reset_prefix_cache()
        b = beam_footprint(shared_llm, prompts, BeamSearchParams(width, output_len, ignore_eos=True))
        assert b[3] < pool_blocks, "the pool filled up: a preempted run measures the pool"
        rows.append(dict(kind="beam_search", beam_width=width, block_steps_shared=b[0], block_steps_unshared=b[1],
                         peak_blocks_shared=b[2], peak_blocks_unshared=b[3],
                         memory_saving=round(1 - b[0] / b[1], 4), peak_saving=round(1 - b[2] / b[3], 4)))
        print(rows[-1], flush=True)
    workload_info = dict(model=Path(model_dir).name, dtype="float32", device="cpu", num_prompts=num_prompts,
                         prompt_len=[32, 512], output_len=output_len, block_size=BLOCK_SIZE, temperature=1.0,
                         same_lengths=True,
                         command=" ".join(["python -m benchmarks.bench_parallel_sampling_memory",
                                           *(argv if argv is not None else sys.argv[1:])]))
    name = "parallel_sampling_memory_quick" if args.quick else "parallel_sampling_memory"
    path = write_result(name, workload_info, rows, args.out_dir)
    tmp.cleanup()
    return dict(rows=rows, path=path)


if __name__ == "__main__":
    main()
