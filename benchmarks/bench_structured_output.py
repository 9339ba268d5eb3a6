"""Structured output (chapter 08), the issue's performance items side by side in one run.

    python -m benchmarks.vllm_peer --setup                  # once, optional: real vLLM in .venv-vllm/
    python -m benchmarks.bench_structured_output            # ~10 min on 2 cores -> results/structured_output.json + .png
    python -m benchmarks.bench_structured_output --no-vllm  # without the real-vLLM peer
    python -m benchmarks.bench_structured_output --quick    # mask time only, one small schema, seconds (tests)

Part 1 — mask time, the same specs and the same token paths for three implementations:
  * ours      structured_output.backend.FromScratchBackend (regex -> DFA -> lazy TokenIndex; json_object: the PDA)
  * xgrammar  structured_output.backend_xgrammar.XgrammarBackend (the real library, vLLM's default backend)
  * outlines  outlines_core 0.2.14: `Index(regex, Vocabulary)` + `Guide.advance` / `write_mask_into`, as vLLM's
              backend_outlines.py drives it (JSON schemas through `json_schema.build_regex_from_schema`, its
              default `[ ]?` whitespace; its Vocabulary built here from SmolLM2's token bytes, as the tests do).
              It has no grammars: json_object is "n/a". Each Index is built in a worker process; one not built
              within --outlines-timeout seconds is killed and recorded as skipped.
Specs: four JSON schemas (flat; nested objects with arrays; enums and formats; bounded strings and arrays),
two regexes (a date, an email) and json_object. Ours and xgrammar compile with any_whitespace=False (the
compact ", " / ": " layout the engine part uses). Token path: a valid document for the spec, tokenized by
SmolLM2's tokenizer, then EOS. One step = fill_bitmask (the mask the engine would apply) + accept_tokens of
the path's next token, timed per step (the allowed bit of the next token is checked after each step, outside
the timing). Per spec and implementation, `--repeats` times: caches cleared, compile (cold), walk the path
(cold: ours fills its lazy index here), then a second request with the same spec: compile (warm: cache hit)
and walk (warm). Medians over repeats of the median and the mean time per step; ratio ours / xgrammar.

Part 2 — engine throughput (SmolLM2-135M-Instruct, fp32, CPU, greedy): 32 chat requests, each with a JSON
schema (the four above, eight requests each), max_tokens 64, `disable_any_whitespace=True`, stopping at
EOS. Sides: our engine with the from-scratch backend and with the xgrammar backend; the same engine on the
same prompts WITHOUT structured output, each request generating exactly as many tokens as it did
constrained (ignore_eos): the same batch shapes, so the time difference is the structured-output cost; and
real vLLM 0.32 CPU (xgrammar, what its default "auto" picks for these schemas, named because vLLM reads
disable_any_whitespace from its engine config only, and refuses it with "auto"; both cores bound) on the
same token prompts, constrained and unconstrained the same way. Its compact layout has no spaces at all
("," / ":"; ours and our xgrammar backend write ", " / ": "), so its documents take a few tokens less. The first constrained run of each engine is "cold"
(compiles, empty lazy index); then `--rounds` interleaved rounds (unconstrained, constrained from-scratch,
constrained xgrammar) are "warm". Output tok/s = output tokens / wall time of one generate over all 32.
Writes benchmarks/results/structured_output.json (+ .png).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import queue
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, try_plot, write_result

VOCAB_SIZE = 49152          # SmolLM2's embedding rows (= its tokenizer's length)

FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "active": {"type": "boolean"}},
        "required": ["name", "age", "active"]}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
                 "required": ["name", "email"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "customer", "items", "tags"]}
ENUMS = {"type": "object", "properties": {
    "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
    "priority": {"type": "integer", "enum": [1, 2, 3]},
    "carrier": {"type": "string", "enum": ["DHL", "UPS", "FedEx"]},
    "shipped_on": {"type": "string", "format": "date"},
    "tracking_id": {"type": "string", "format": "uuid"}},
    "required": ["status", "priority", "carrier", "shipped_on", "tracking_id"]}
BOUNDED = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 1, "maxLength": 40},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 5},
    "rating": {"type": "number"}},
    "required": ["title", "keywords", "rating"]}
ORDER = {"id": 1042, "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
         "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1, "price": 120.25}],
         "tags": ["gift", "express"]}
# name -> (kind, spec, a valid document). JSON documents in the compact layout of disable_any_whitespace
# (vLLM's: separators "," and ":").
SPECS = {
    "json flat": ("json", FLAT, {"name": "Ada Lovelace", "age": 36, "active": True}),
    "json nested + arrays": ("json", NESTED, ORDER),
    "json enums + formats": ("json", ENUMS, {"status": "shipped", "priority": 2, "carrier": "UPS",
                                             "shipped_on": "2024-02-29",
                                             "tracking_id": "123e4567-e89b-12d3-a456-426614174000"}),
    "json bounded strings/arrays": ("json", BOUNDED, {"title": "The Analytical Engine and its programs",
                                                      "keywords": ["computing", "history", "Babbage"], "rating": 4.5}),
    "regex date": ("regex", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "1969-07-20"),
    "regex email": ("regex", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}", "ada.lovelace@example.com"),
    "json_object": ("json_object", "", ORDER),
}
QUICK_SPECS = ["json flat"]
ENGINE_SCHEMAS = {"json flat": "Describe {name} as a JSON record.",
                  "json nested + arrays": "Write the JSON of an online order that {name} placed.",
                  "json enums + formats": "Write the JSON shipment record of a parcel sent to {name}.",
                  "json bounded strings/arrays": "Write a JSON record for a short article about {name}."}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton", "Katherine Johnson",
         "Niels Bohr", "Rosalind Franklin"]
IMPLS = ("ours", "xgrammar", "outlines")


def document_text(kind: str, doc) -> str:
    return doc if kind == "regex" else json.dumps(doc, separators=(",", ":"))


def spec_key(kind: str, spec):
    """(StructuredOutputOptions, spec text) as the engine's seam passes them to a backend."""
    from mini_vllm.structured_output_backend import StructuredOutputOptions as O
    if kind == "json":
        return O.JSON, json.dumps(spec)
    if kind == "regex":
        return O.REGEX, spec
    return O.JSON_OBJECT, ""


def is_allowed(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


# ---------------------------------------------------------------- part 1: mask time
def walk(grammar, path: list[int], bitmask) -> list[int]:
    """ns per step (fill_bitmask, then accept_tokens of the path's next token); raises if the grammar
    refuses a token of the path or its mask did not allow it."""
    times = []
    for i, token in enumerate(path):
        t0 = time.perf_counter_ns()
        grammar.fill_bitmask(bitmask, 0)
        ok = grammar.accept_tokens("r", [token])
        times.append(time.perf_counter_ns() - t0)
        if not ok or not is_allowed(bitmask[0], token):
            raise RuntimeError(f"step {i}: token {token} {'refused' if not ok else 'not in the mask'}")
    return times


def summarize(repeats: list[dict]) -> dict:
    """Medians over repeats: compile ms (cold, warm), per-step µs (median, mean; cold, warm)."""
    med = lambda key: statistics.median(r[key] for r in repeats)      # noqa: E731
    out = {}
    for phase in ("cold", "warm"):
        out[f"compile_{phase}_ms"] = round(med(f"compile_{phase}_ns") / 1e6, 3)
        out[f"per_token_median_{phase}_us"] = round(statistics.median(
            statistics.median(r[f"steps_{phase}_ns"]) for r in repeats) / 1e3, 2)
        out[f"per_token_mean_{phase}_us"] = round(statistics.median(
            statistics.fmean(r[f"steps_{phase}_ns"]) for r in repeats) / 1e3, 2)
        out[f"path_total_{phase}_ms"] = round(statistics.median(sum(r[f"steps_{phase}_ns"]) for r in repeats) / 1e6, 3)
    out["first_request_total_ms"] = round(out["compile_cold_ms"] + out["path_total_cold_ms"], 3)
    return out


def measure_backend(backend, kind: str, spec, path: list[int], repeats: int) -> dict:
    """Cold (caches cleared) and warm (second request, same spec) compile + walk, `repeats` times."""
    request_type, text = spec_key(kind, spec)
    bitmask = backend.allocate_token_bitmask(1)
    runs = []
    for _ in range(repeats):
        backend.destroy()                                   # both backends: clear the compile caches
        run = {}
        for phase in ("cold", "warm"):
            t0 = time.perf_counter_ns()
            grammar = backend.compile_grammar(request_type, text, any_whitespace=False)
            run[f"compile_{phase}_ns"] = time.perf_counter_ns() - t0
            run[f"steps_{phase}_ns"] = walk(grammar, path, bitmask)
            if not grammar.is_terminated():
                raise RuntimeError("the path ends with EOS, but the grammar did not terminate")
        runs.append(run)
    return summarize(runs)


def _outlines_worker(model_dir: str, eos: int, vocab_size: int, jobs, results) -> None:
    """A separate process (spawned) so that an Index that takes too long can be killed. Builds outlines'
    Vocabulary once, then per job: the regex, the Index (reported as soon as it is built), and the walks."""
    import numpy as np
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from transformers import AutoTokenizer

    from structured_output.vocabulary import token_bytes

    t0 = time.perf_counter_ns()
    tb = token_bytes(AutoTokenizer.from_pretrained(model_dir))
    by_bytes: dict[bytes, list[int]] = {}
    for i, data in enumerate(tb[:vocab_size]):
        if data:
            by_bytes.setdefault(data, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    results.put(("ready", time.perf_counter_ns() - t0))
    mask = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def fill(guide) -> None:
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)

    while (job := jobs.get()) is not None:
        kind, spec, path, repeats = job
        try:
            t0 = time.perf_counter_ns()
            regex = build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
            index = outlines_core.Index(regex, vocabulary)
            compile_cold = time.perf_counter_ns() - t0
            results.put(("compiled", compile_cold))
            runs = []
            for _ in range(repeats):                       # (the Index is eager: every visit is "warm")
                run = dict(compile_cold_ns=compile_cold)
                for phase in ("cold", "warm"):
                    t0 = time.perf_counter_ns()
                    guide = outlines_core.Guide(index, max_rollback=0)      # vLLM: the Index is cached per regex
                    run[f"compile_{phase}_ns"] = compile_cold if phase == "cold" else time.perf_counter_ns() - t0
                    times = []
                    for i, token in enumerate(path):
                        t0 = time.perf_counter_ns()
                        fill(guide)
                        if token == eos:                   # outlines never advances on EOS (vLLM checks is_finished)
                            ok = guide.is_finished()
                        else:
                            try:
                                guide.advance(token, return_tokens=False)
                                ok = True
                            except ValueError:
                                ok = False
                        times.append(time.perf_counter_ns() - t0)
                        if not ok or not is_allowed(mask, token):
                            raise RuntimeError(f"step {i}: token {token} {'refused' if not ok else 'not in the mask'}")
                    run[f"steps_{phase}_ns"] = times
                runs.append(run)
            results.put(("done", dict(summarize(runs), regex_chars=len(regex))))
        except Exception as error:     # noqa: BLE001 - reported in the row
            results.put(("error", f"{type(error).__name__}: {str(error)[:300]}"))


class OutlinesPeer:
    """The outlines worker process: restarted after a job it had to kill."""

    def __init__(self, model_dir, eos: int, timeout_s: float):
        import multiprocessing
        self.args, self.timeout_s = (str(model_dir), eos, VOCAB_SIZE), timeout_s
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = None
        self.vocabulary_ms = None

    def _start(self) -> None:
        self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=_outlines_worker, args=(*self.args, self.jobs, self.results), daemon=True)
        self.proc.start()
        tag, ns = self.results.get(timeout=300)
        assert tag == "ready", tag
        self.vocabulary_ms = round(ns / 1e6, 1)

    def measure(self, kind: str, spec, path: list[int], repeats: int) -> dict:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.jobs.put((kind, spec, path, repeats))
        try:
            tag, value = self.results.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            self.proc.join()
            self.proc = None
            return dict(skipped=f"outlines-core did not build the Index within {self.timeout_s:g} s (killed)")
        if tag == "error":
            return dict(error=value)
        tag, value = self.results.get(timeout=600)
        return dict(error=value) if tag == "error" else value

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.jobs.put(None)
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


def mask_time(tokenizer, model_dir, spec_names: list[str], repeats: int, outlines_timeout: float,
              with_outlines: bool = True) -> tuple[list[dict], dict]:
    from structured_output.backend import FromScratchBackend
    from structured_output.backend_xgrammar import XgrammarBackend
    from structured_output.token_index import shared_trie

    eos = tokenizer.eos_token_id
    setup = {}
    t0 = time.perf_counter()
    ours = FromScratchBackend(tokenizer, VOCAB_SIZE, {eos})
    shared_trie(tuple(ours.token_bytes), VOCAB_SIZE)                  # the vocabulary's byte trie, once per engine
    setup["ours (token bytes + byte trie)"] = round(1e3 * (time.perf_counter() - t0), 1)
    t0 = time.perf_counter()
    xgr_backend = XgrammarBackend(tokenizer, VOCAB_SIZE, {eos})
    setup["xgrammar (TokenizerInfo + GrammarCompiler)"] = round(1e3 * (time.perf_counter() - t0), 1)
    outlines = OutlinesPeer(model_dir, eos, outlines_timeout) if with_outlines else None
    rows = []
    try:
        for name in spec_names:
            kind, spec, doc = SPECS[name]
            text = document_text(kind, doc)
            path = tokenizer(text, add_special_tokens=False).input_ids + [eos]
            row = dict(part="mask", spec=name, kind=kind, document=text, path_tokens=len(path))
            for impl, measure in (("ours", lambda: measure_backend(ours, kind, spec, path, repeats)),
                                  ("xgrammar", lambda: measure_backend(xgr_backend, kind, spec, path, repeats))):
                try:
                    row[impl] = measure()
                except Exception as error:     # noqa: BLE001 - reported in the row
                    row[impl] = dict(error=f"{type(error).__name__}: {str(error)[:300]}")
            if outlines is None:
                row["outlines"] = dict(skipped="not run (--no-outlines)")
            elif kind == "json_object":
                row["outlines"] = "n/a (outlines-core has no grammars: regular languages only)"
            else:
                row["outlines"] = outlines.measure(kind, spec, path, repeats)
            for key in ("per_token_median_warm_us", "per_token_median_cold_us", "per_token_mean_cold_us",
                        "compile_cold_ms", "first_request_total_ms"):
                a, b = row["ours"], row["xgrammar"]
                if key in a and key in b and b[key]:
                    row[f"ours/xgrammar {key}"] = round(a[key] / b[key], 2)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "document"}), flush=True)
    finally:
        if outlines is not None:
            outlines.close()
            setup["outlines (token bytes + Vocabulary, in its worker)"] = outlines.vocabulary_ms
    return rows, setup


# ---------------------------------------------------------------- part 2: engine throughput
def engine_requests(tokenizer) -> list[tuple[list[int], dict, str]]:
    """32 (prompt ids, schema, spec name): every schema with every name, interleaved."""
    out = []
    for person in NAMES:
        for name, task in ENGINE_SCHEMAS.items():
            schema = SPECS[name][1]
            text = f"{task.format(name=person)} Answer with the JSON only, following this schema: {json.dumps(schema)}"
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), schema, name))
    return out


def run_ours(llm, prompts, params) -> tuple[float, list[list[int]], list[str]]:
    assert llm.reset_prefix_cache(), "requests still hold KV blocks"
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].finish_reason for o in outs]


def engine_throughput(model_dir, tokenizer, rounds: int, max_tokens: int, with_vllm: bool) -> tuple[list[dict], dict]:
    import jsonschema

    from mini_vllm import LLM, SamplingParams
    from mini_vllm.sampling_params import StructuredOutputsParams

    requests = engine_requests(tokenizer)
    prompts = [p for p, _, _ in requests]
    constrained = [SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                                  structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
                   for _, s, _ in requests]
    warmup = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
              for t in ("Hi!", "Name a colour.", "What is 2 + 2?", "Say yes.")]
    warmup = [list(w["input_ids"] if hasattr(w, "keys") else w) for w in warmup]
    max_model_len = max(len(p) for p in prompts) + max_tokens + 16
    engines = {b: LLM(str(model_dir), dtype="float32", max_model_len=max_model_len, max_num_seqs=len(prompts),
                      max_num_batched_tokens=4096, structured_outputs_config={"backend": b})
               for b in ("from_scratch", "xgrammar")}
    for llm in engines.values():
        run_ours(llm, warmup, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
    rows, tokens = [], {}

    def record(name: str, phase: str, seconds: float, toks: list[list[int]], finish: list[str] | None, rnd) -> dict:
        n = sum(len(t) for t in toks)
        row = dict(part="engine", name=name, phase=phase, round=rnd, seconds=round(seconds, 3), output_tokens=n,
                   output_tokens_per_s=round(n / seconds, 2))
        if finish is not None:
            row["finished_stop"] = sum(f == "stop" for f in finish)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    for backend, llm in engines.items():                                      # cold: compile + empty lazy index
        seconds, toks, finish = run_ours(llm, prompts, constrained)
        tokens[f"ours {backend} cold"] = toks
        record(f"ours, structured ({backend})", "cold", seconds, toks, finish, None)
    lengths = [len(t) for t in tokens["ours from_scratch cold"]]
    valid = 0
    for (_, schema, _), toks in zip(requests, tokens["ours from_scratch cold"]):
        try:
            jsonschema.validate(json.loads(tokenizer.decode(toks, skip_special_tokens=True)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    unconstrained = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    for rnd in range(rounds):                                                  # warm, interleaved
        seconds, toks, _ = run_ours(engines["from_scratch"], prompts, unconstrained)
        record("ours, unconstrained (same lengths)", "warm", seconds, toks, None, rnd)
        for backend, llm in engines.items():
            seconds, toks, finish = run_ours(llm, prompts, constrained)
            tokens[f"ours {backend} warm"] = toks
            record(f"ours, structured ({backend})", "warm", seconds, toks, finish, rnd)
    for llm in engines.values():
        llm.shutdown()
    del engines

    ref = tokens["ours from_scratch cold"]
    agree = lambda other: sum(a == b for a, b in zip(other, ref)) / len(ref)       # noqa: E731
    info = dict(requests=len(prompts), max_tokens=max_tokens, output_lengths=lengths,
                valid_json_documents=valid,
                agreement_xgrammar_backend_vs_from_scratch=agree(tokens["ours xgrammar warm"]),
                agreement_warm_vs_cold=agree(tokens["ours from_scratch warm"]))
    peer = run_vllm_peer(model_dir, prompts, [s for _, s, _ in requests], lengths, warmup, rounds, max_tokens) \
        if with_vllm else {"skipped": "not run (--no-vllm)"}
    info["vllm"] = peer.get("skipped") or peer.get("vllm")
    if "runs" in peer:
        info["vllm_env"] = peer.get("env")
        order = [r for r in peer["runs"]]
        for i, r in enumerate(order):
            structured = r["mode"] == "structured"
            phase = "cold" if structured and i == 0 else "warm"
            rnd = None if phase == "cold" else (i - 1) // 2
            record("vLLM, structured (xgrammar)" if structured else "vLLM, unconstrained (same lengths)",
                   phase, r["seconds"], r["tokens"], None, rnd)
            if structured:      # both write vLLM's compact layout: the same texts where the numerics agree
                norm = lambda toks: tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
                info["vllm_same_text"] = sum(
                    a.startswith(b) or b.startswith(a) for a, b in ((norm(x), norm(y)) for x, y in zip(r["tokens"], ref))) / len(ref)
    return rows, info


def run_vllm_peer(model_dir, prompts, schemas, lengths, warmup, rounds: int, max_tokens: int) -> dict:
    """Real vLLM 0.32 (CPU, both cores bound) on the same token prompts: the constrained run cold, then
    per round the unconstrained run (our constrained lengths, ignore_eos) and the constrained one."""
    from benchmarks import vllm_peer

    reason = vllm_peer.unavailable_reason()
    if reason:
        return {"skipped": reason}
    workload = dict(prompts=prompts, max_tokens=lengths, warmup_prompts=warmup, warmup_max_tokens=[8] * len(warmup),
                    modes=["structured"] + ["greedy", "structured"] * rounds,
                    structured_outputs=[{"json": s, "disable_any_whitespace": True} for s in schemas],
                    structured_max_tokens=[max_tokens] * len(prompts),
                    # vLLM 0.32 ignores the request's disable_any_whitespace; its engine config holds the flag,
                    # which "auto" (the default: xgrammar for these schemas) refuses: name xgrammar.
                    structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    try:
        return vllm_peer.call(model_dir, workload, "both cores", kvcache_gib=2)
    except Exception as error:     # noqa: BLE001 - the peer failing must not lose our numbers
        return {"skipped": f"vLLM failed: {str(error)[-600:]}"}


def engine_summary(rows: list[dict]) -> dict:
    def warm(name: str) -> list[dict]:
        return [r for r in rows if r.get("name") == name and r["phase"] == "warm"]

    def med(name: str) -> float | None:
        rs = warm(name)
        return round(statistics.median(r["output_tokens_per_s"] for r in rs), 2) if rs else None

    base, fs, xg = (med("ours, unconstrained (same lengths)"), med("ours, structured (from_scratch)"),
                    med("ours, structured (xgrammar)"))
    vllm_s, vllm_u = med("vLLM, structured (xgrammar)"), med("vLLM, unconstrained (same lengths)")
    cold = {r["name"]: r["output_tokens_per_s"] for r in rows if r.get("part") == "engine" and r["phase"] == "cold"}
    out = dict(tok_s_unconstrained=base, tok_s_from_scratch=fs, tok_s_xgrammar_backend=xg,
               overhead_from_scratch=round(base / fs - 1, 3), overhead_xgrammar_backend=round(base / xg - 1, 3),
               overhead_from_scratch_cold=round(base / cold["ours, structured (from_scratch)"] - 1, 3),
               overhead_xgrammar_backend_cold=round(base / cold["ours, structured (xgrammar)"] - 1, 3),
               overhead="unconstrained tok/s / structured tok/s - 1 (same output lengths; goal <= 0.10)")
    best = lambda name: max((r["output_tokens_per_s"] for r in warm(name)), default=None)     # noqa: E731
    if vllm_s:                    # (a shared VM only ever slows a run down: best-of-rounds is the noise-robust view)
        vb = best("vLLM, structured (xgrammar)")
        out.update(best_of_rounds=dict(
            from_scratch=best("ours, structured (from_scratch)"), unconstrained=best("ours, unconstrained (same lengths)"),
            vllm_structured=vb, vllm_unconstrained=best("vLLM, unconstrained (same lengths)"),
            ours_from_scratch_over_vllm=round(best("ours, structured (from_scratch)") / vb, 3)))
        out.update(tok_s_vllm_structured=vllm_s, tok_s_vllm_unconstrained=vllm_u,
                   overhead_vllm=round(vllm_u / vllm_s - 1, 3) if vllm_u else None,
                   ours_from_scratch_over_vllm=round(fs / vllm_s, 3), ours_xgrammar_backend_over_vllm=round(xg / vllm_s, 3),
                   ours_unconstrained_over_vllm_unconstrained=round(base / vllm_u, 3) if vllm_u else None)
    return out


def mask_summary(rows: list[dict]) -> dict:
    ratios = {r["spec"]: r.get("ours/xgrammar per_token_median_warm_us") for r in rows}
    cold = {r["spec"]: r.get("ours/xgrammar per_token_mean_cold_us") for r in rows}
    got = [v for v in ratios.values() if v is not None]
    return dict(ours_over_xgrammar_per_token_warm_median=ratios, ours_over_xgrammar_per_token_cold_mean=cold,
                worst_warm_ratio=max(got) if got else None, goal="per token within 2x of xgrammar (ratio <= 2)")


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="mask time only, one small schema, one repeat (seconds)")
    ap.add_argument("--repeats", type=int, default=3, help="mask time: cold + warm requests per spec")
    ap.add_argument("--rounds", type=int, default=3, help="engine: warm interleaved rounds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--outlines-timeout", type=float, default=20.0, help="s to build one outlines Index")
    ap.add_argument("--no-outlines", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.no_engine, args.no_vllm = 1, True, True
    model_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mask_rows, setup = mask_time(tokenizer, model_dir, QUICK_SPECS if args.quick else list(SPECS), args.repeats,
                                 args.outlines_timeout, with_outlines=not args.no_outlines)
    engine_rows, engine_info = ([], {}) if args.no_engine else \
        engine_throughput(model_dir, tokenizer, args.rounds, args.max_tokens, not args.no_vllm)
    rows = mask_rows + engine_rows
    summary = dict(mask=mask_summary(mask_rows))
    if engine_rows:
        summary["engine"] = engine_summary(engine_rows)
    versions = {m: importlib.metadata.version(m) for m in ("xgrammar", "outlines_core")}
    workload = dict(
        model="SmolLM2-135M-Instruct (tokenizer; the engine part: the model)", vocab_size=VOCAB_SIZE, dtype="float32",
        device="cpu (2 cores; other jobs may share it: compare ratios within the run)",
        mask=dict(specs={n: dict(kind=SPECS[n][0], spec=SPECS[n][1]) for n in [r["spec"] for r in mask_rows]},
                  repeats=args.repeats, any_whitespace=False, step="fill_bitmask + accept_tokens(next token of the path)",
                  path="the document tokenized by SmolLM2's tokenizer, then EOS",
                  cold="caches cleared: compile, then the first walk (ours fills its lazy index here)",
                  warm="a second request with the same spec: compile (cache hit), walk",
                  outlines=("outlines_core.Index(build_regex_from_schema(schema) | regex, Vocabulary from SmolLM2's "
                            "token bytes), Guide.advance + write_mask_into as vLLM's backend_outlines; its default "
                            f"whitespace [ ]?; an Index not built in {args.outlines_timeout:g} s is skipped"),
                  setup_ms=setup),
        engine=None if args.no_engine else dict(
            schemas=list(ENGINE_SCHEMAS), greedy=True, disable_any_whitespace=True, rounds=args.rounds, max_num_seqs=32, max_num_batched_tokens=4096,
            unconstrained="same prompts, each request's length from ours' constrained run, ignore_eos",
            vllm_config="both cores (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0), KV 2 GiB",
            **engine_info),
        versions=versions,
        command=" ".join(["python -m benchmarks.bench_structured_output", *(argv if argv is not None else sys.argv[1:])]))
    name = "structured_output_quick" if args.quick else "structured_output"
    path = write_result(name, workload, rows, args.out_dir, summary=summary)
    try_plot(plot, rows, args.out_dir / f"{name}.png")
    print(json.dumps(summary, indent=1))
    return dict(rows=rows, summary=summary, path=path, workload=workload)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mask = [r for r in rows if r["part"] == "mask"]
    engine = [r for r in rows if r["part"] == "engine"]
    fig, axes = plt.subplots(1, 2 if engine else 1, figsize=(12 if engine else 7, 3.6), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        values = [r[impl].get("per_token_median_warm_us", float("nan")) if isinstance(r[impl], dict) else float("nan")
                  for r in mask]
        ax.bar([i + j * width for i in range(len(mask))], values, width, label=impl)
    ax.set_yscale("log")
    ax.set_xticks([i + width for i in range(len(mask))], [r["spec"] for r in mask], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("µs per token (median, warm)")
    ax.set_title("fill_bitmask + accept_tokens per token (no bar: skipped / n/a)", fontsize=9)
    ax.legend(fontsize=8)
    if engine:
        ax = axes[0][1]
        names = list(dict.fromkeys(r["name"] for r in engine))
        for k, phase in enumerate(("warm", "cold")):
            vals = [statistics.median([r["output_tokens_per_s"] for r in engine if r["name"] == n and r["phase"] == phase]
                                      or [0]) for n in names]
            ax.barh([i + k * 0.4 for i in range(len(names))], vals, 0.4, label=phase)
        ax.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=7)
        ax.set_xlabel("output tok/s (32 requests, greedy)")
        ax.set_title("engine, SmolLM2 fp32 CPU", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
