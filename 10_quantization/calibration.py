"""Calibration text that ships with Python: the docstrings of the standard library.

GPTQ and AWQ do not look at weights alone: they ask which inputs each linear layer really sees
(GPTQ: the Hessian H = 2 X X^T of the layer's inputs; AWQ: the mean |x| of each input channel),
so they need a few hundred thousand tokens of ordinary text. The papers use C4 or the Pile; this
repository works offline, so it uses a corpus that every Python installation carries: the
docstrings of the standard library's modules. English prose about programs, with some code in
it, much like what an instruct model is asked about.

    documents       one per top-level stdlib module (`sys.stdlib_module_names` that have Python
                    source: `json` gathers json/__init__.py, json/decoder.py, ...), the module's,
                    classes' and functions' docstrings in source order. Read with `ast` from the
                    .py files, so nothing is imported (no side effects), sorted by module name.
    split           by a stable hash of the module name (sha256, not Python's salted hash()):
                    ~10% of the modules are HELD OUT, never calibrated on; the split is the same
                    on every machine and every run, and a module's submodules stay on its side.
    samples         each side's documents tokenized, joined by EOS into one stream, cut into
                    seq_len windows; `n` of them drawn without replacement by a seeded generator.

Statistics (CPython 3.11.7, the SmolLM2-135M tokenizer): 187 modules with source and
docstrings (the `test` package and tests/ folders skipped), 718 files, 1.80 M characters; 163
calibration modules with 430 k tokens and 24 held-out modules with 39 k tokens (154 windows of
256). Another Python version has other docstrings, so other (equally deterministic) samples:
`python -m quantization.calibration MODEL_DIR` prints what this interpreter gives.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import math
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Document", "calibration_samples", "corpus_statistics", "held_out_samples", "is_held_out",
           "perplexity", "split_documents", "stdlib_documents", "token_samples"]

HELD_OUT_PERCENT = 10
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages"})   # test suites, not prose


@dataclass(frozen=True)
class Document:
    module: str          # top-level module name, e.g. "json"
    text: str            # its docstrings, blank-line separated


def _docstrings(node: ast.AST):
    """Docstrings of node and everything under it, in source order (a pre-order walk; ast.walk
    is breadth-first, which would put every method's docstring after every class's)."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def _module_files(stdlib: Path, name: str) -> list[Path]:
    """The .py files of top-level module `name` (one file, or a package's files sorted)."""
    single = stdlib / f"{name}.py"
    if single.is_file():
        return [single]
    package = stdlib / name
    if not (package / "__init__.py").is_file():
        return []                                      # a C extension or a built-in: no source
    return sorted(p for p in package.rglob("*.py")
                  if not SKIPPED_PARTS.intersection(p.relative_to(package).parts))


@functools.lru_cache(maxsize=1)
def stdlib_documents() -> tuple[Document, ...]:
    """One Document per stdlib module with Python source and any docstring, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for name in sorted(sys.stdlib_module_names):
        if name in SKIPPED_PARTS:
            continue
        parts = []
        for path in _module_files(stdlib, name):
            with warnings.catch_warnings():            # old escape sequences in a few files
                warnings.simplefilter("ignore")
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue                           # e.g. lib2to3's deliberately broken data
            parts.extend(_docstrings(tree))
        if parts:
            documents.append(Document(name, "\n\n".join(parts)))
    return tuple(documents)


def is_held_out(module: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Stable across machines and runs (Python's hash() of a str is salted per process)."""
    digest = hashlib.sha256(module.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < percent


def split_documents(documents=None) -> tuple[list[Document], list[Document]]:
    """(calibration, held_out): disjoint by module name."""
    documents = stdlib_documents() if documents is None else documents
    calibration = [d for d in documents if not is_held_out(d.module)]
    held_out = [d for d in documents if is_held_out(d.module)]
    return calibration, held_out


def _token_stream(tokenizer, documents) -> list[int]:
    """Every document's tokens, EOS between documents (so no window glues two texts silently)."""
    stream: list[int] = []
    for doc in documents:
        stream.extend(tokenizer.encode(doc.text, add_special_tokens=False))
        stream.append(tokenizer.eos_token_id)
    return stream


def token_samples(tokenizer, documents, n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """n windows of seq_len tokens, int64 [n, seq_len]: the stream cut into whole windows, n of
    them drawn without replacement (so no two samples overlap) by a generator seeded with seed."""
    stream = torch.tensor(_token_stream(tokenizer, documents), dtype=torch.int64)
    windows = stream[: len(stream) // seq_len * seq_len].reshape(-1, seq_len)   # [W, seq_len]
    if n > len(windows):
        raise ValueError(f"asked for {n} samples of {seq_len} tokens, the text has {len(windows)}")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    return windows[order[:n]].clone()


def calibration_samples(tokenizer, n: int = 64, seq_len: int = 256, seed: int = 0) -> torch.Tensor:
    return token_samples(tokenizer, split_documents()[0], n, seq_len, seed)


def held_out_samples(tokenizer, n: int = 16, seq_len: int = 256, seed: int = 0) -> torch.Tensor:
    return token_samples(tokenizer, split_documents()[1], n, seq_len, seed)


def corpus_statistics(tokenizer=None) -> dict:
    """Counts of this interpreter's corpus (tokens only if a tokenizer is given)."""
    calibration, held_out = split_documents()
    stats = {"python": sys.version.split()[0], "modules": len(calibration) + len(held_out),
             "calibration_modules": len(calibration), "held_out_modules": len(held_out),
             "characters": sum(len(d.text) for d in calibration + held_out)}
    if tokenizer is not None:
        stats["calibration_tokens"] = len(_token_stream(tokenizer, calibration))
        stats["held_out_tokens"] = len(_token_stream(tokenizer, held_out))
    return stats


@torch.no_grad()
def perplexity(model_fn: Callable[[torch.Tensor], torch.Tensor], samples: torch.Tensor,
               batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over samples [n, T]; model_fn(input_ids [b, T]) -> logits
    [b, T, vocab]. Every position but the last predicts the next token: n * (T - 1) terms."""
    total, count = 0.0, 0
    for batch in samples.split(batch_size):
        logits = model_fn(batch).float()                                    # [b, T, V]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                batch[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


if __name__ == "__main__":       # python -m quantization.calibration MODEL_DIR: the statistics
    from transformers import AutoTokenizer
    print(corpus_statistics(AutoTokenizer.from_pretrained(sys.argv[1])))
