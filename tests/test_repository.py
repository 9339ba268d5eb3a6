"""A new reader's checks of the repository itself (docs/DESIGN.md):

  * the import graph docs/DESIGN.md draws is the one the code has, so chapters add rather than
    pre-contain: a chapter imports only earlier chapters and the infrastructure packages, and
    chapters 01-06 never reach chapter 07's engine (not even by a module name in a string);
  * chapter 03's scheduler is the core: no speculative drafts, no KV connectors in it;
  * every number in a README's results table is in the JSON that row links to.

(That the docs cite nothing outside the repository is tests/test_self_contained.py.)
"""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"01_paged_attention": "paged_attention", "02_kvcache": "kvcache", "03_scheduler": "scheduler",
            "04_spec_decode": "spec_decode", "05_chunked_prefill": "chunked_prefill",
            "06_global_prefix_cache": "global_prefix_cache", "07_mini_vllm": "mini_vllm",
            "08_structured_output": "structured_output", "09_lora": "lora", "10_quantization": "quantization",
            "kernels_cuda": "kernels_cuda", "kernels_cpu": "kernels_cpu", "processes": "processes",
            "model_executor": "model_executor"}
CHAPTERS = [package for folder, package in PACKAGES.items() if folder[0].isdigit()]


def python_files(folder: str):
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported_packages(path: Path, statements_only: bool = False) -> set[str]:
    """Top-level project packages `path` imports: import statements, and module names handed to
    importlib as string constants ("mini_vllm.x" in importlib.import_module / a preload list)
    unless `statements_only`."""
    names = set(PACKAGES.values())
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif (not statements_only and isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"[\w.]+", node.value)):
            if "." in node.value:
                modules = [node.value]
        found |= {m.split(".")[0] for m in modules if m.split(".")[0] in names}
    return found


def actual_graph(statements_only: bool = False) -> dict[str, set[str]]:
    graph = {}
    for folder, package in PACKAGES.items():
        deps = set()
        for path in python_files(folder):
            deps |= imported_packages(path, statements_only)
        graph[package] = deps - {package}
    return graph


def documented_graph() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    block = re.search(r"```imports\n(.*?)```", text, re.DOTALL)
    assert block, "docs/DESIGN.md has no ```imports block"
    graph = {}
    for line in block.group(1).strip().splitlines():
        package, _, deps = line.partition(":")
        graph[package.strip()] = {d.strip() for d in deps.split(",") if d.strip()}
    return graph


def test_the_import_graph_in_design_md_is_the_real_one():
    assert documented_graph() == actual_graph()


def test_chapters_only_import_earlier_chapters_and_the_kernel_packages():
    """Import statements only name earlier chapters; chapter 07 reaches the chapters after it
    (08: structured output) by NAME through its seams (importlib), never by an import statement."""
    order = CHAPTERS
    for package, deps in actual_graph(statements_only=True).items():
        if package in order:
            later = {d for d in deps if d in order and order.index(d) > order.index(package)}
            assert not later, f"{package} imports later chapters {sorted(later)}"
        else:
            assert not deps, f"the kernel package {package} is a leaf, but imports {sorted(deps)}"


def test_chapters_01_to_06_never_reach_the_engine():
    hits = [str(p.relative_to(ROOT)) for folder in list(PACKAGES)[:6] for p in python_files(folder)
            if "mini_vllm" in imported_packages(p)]
    assert not hits, f"chapters 01-06 must not import chapter 07: {hits}"


def test_chapter_03_scheduler_is_the_core():
    """Drafts are chapter 04's, connectors chapter 06's: they override chapter 03's hooks."""
    text = (ROOT / "03_scheduler" / "scheduler.py").read_text(encoding="utf-8")
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if re.search(r"draft|connector|kv_transfer|spec_token|remote", line, re.IGNORECASE)]
    assert not hits, "03_scheduler/scheduler.py mentions later chapters' mechanisms:\n" + "\n".join(hits)


# ---------------------------------------------------------------- results tables
RESULT_LINK = re.compile(r"\]\(([^)]*benchmarks/results/[^)]+\.json)\)")
NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?![\w])")


def readmes() -> list[Path]:
    return sorted([ROOT / "README.md", *ROOT.glob("*/README.md")])


def results_rows(readme: Path):
    """(line number, cells, linked JSON paths) of every table row that links a results JSON."""
    for lineno, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("|") and RESULT_LINK.search(line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            links = [(readme.parent / m).resolve() for m in RESULT_LINK.findall(line)]
            yield lineno, cells, links


def json_numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, dict):
        return [x for v in value.values() for x in json_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in json_numbers(v)]
    return []


def stated_in(number: str, values: list[float]) -> bool:
    """Does some value of the JSON, at the precision the README states it (and read as a
    percentage, or in another SI unit), give `number`?"""
    decimals = len(number.split(".")[1]) if "." in number else 0
    target = float(number.replace(",", ""))
    for v in values:
        for scale in (1, 100, 1e3, 1e-3, 1e6, 1e-6, 1e9):
            if round(v * scale, decimals) == target:
                return True
    return False


def test_every_results_table_number_is_in_its_json():
    """A README's results table states the latest measurement; its second column ("result")
    holds numbers the row's linked JSON contains (rounded as written)."""
    problems, rows = [], 0
    for readme in readmes():
        for lineno, cells, links in results_rows(readme):
            rows += 1
            missing = [p for p in links if not p.is_file()]
            if missing:
                problems.append(f"{readme.relative_to(ROOT)}:{lineno}: no such file {missing}")
                continue
            values = [x for p in links for x in json_numbers(json.loads(p.read_text()))]
            result = cells[1] if len(cells) > 1 else ""
            for number in NUMBER.findall(result):
                digits = number.replace(",", "").replace(".", "").lstrip("0")
                if len(digits) < 2:
                    continue                     # "1 row", "2 cores": too short to be a measurement
                if not stated_in(number, values):
                    problems.append(f"{readme.relative_to(ROOT)}:{lineno}: {number} is not in {[p.name for p in links]}")
    assert rows, "no README results table links a benchmarks/results JSON"
    assert not problems, "\n".join(problems)
