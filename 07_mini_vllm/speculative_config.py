"""SpeculativeConfig: the `speculative_config={...}` dict of `LLM(...)`, validated once.

Mirrors vLLM's `vllm/config/speculative.py: SpeculativeConfig` — same dict keys where vLLM has
them (`method`, `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`, `model`,
`disable_by_batch_size`), same defaults (n-gram lookup of 5..5 tokens when neither bound is
given; one bound given -> both) — plus the knobs of this engine's own pieces:

    method                 "ngram" | "draft_model" | "eagle" | "layer_skip"
    num_speculative_tokens k >= 1 drafts per request per step (required)
    prompt_lookup_min/max  n-gram lengths to match (ngram only)
    model                  draft_model: an HF-format checkpoint directory with the target's
                           tokenizer; eagle: an EAGLE head directory (default: the head for
                           SmolLM2-135M-Instruct shipped in spec_decode/eagle_smollm2)
    num_layers             layer_skip: how many of the target's first layers draft
                           (default: a quarter of them, at least 1)
    disable_by_batch_size  no drafts while more than this many requests run (None: never)
    adaptive               per-request draft length from the observed acceptance
                           (spec_decode.adaptive; False: always k)
    min_draft_acceptance   θ of the adaptive rule: draft j is proposed while the estimated
                           P(drafts 1..j accepted) >= θ, θ ~ what one draft costs as a share of
                           a target step (default: 0.1 for n-gram, whose drafts cost only a
                           verification row, and for EAGLE, a row plus one pass of a one-layer
                           head; 0.25 for a draft model and layer_skip, whose drafts run a
                           model or a quarter of the target's layers)
    rejection_sampler      rejection-sampling backend: "auto" (torch on a CPU, triton on a GPU)
                           | "reference" | "torch" | "triton" | "cuda"
    tree_depth, tree_top_k eagle only: draft EAGLE-2's dynamic tree instead of a chain
                           (spec_decode.eagle_tree) — at most tree_depth tokens deep, top_k
                           nodes expanded per depth with top_k children each, the best
                           num_speculative_tokens nodes verified in one pass (None: a chain)

Only what can be checked without loading anything is checked here (at EngineConfig
construction); the draft model's vocabulary and tokenizer, the EAGLE head's hidden size and
`num_layers` against the target are checked when the engine loads them (still inside
`LLM(...)`, before any request).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

METHODS = ("ngram", "draft_model", "eagle", "layer_skip")
REJECTION_SAMPLERS = ("auto", "reference", "torch", "triton", "cuda")
# EAGLE at 0.1: on this CPU a draft costs about a tenth of a step (benchmarks/HISTORY.md, 2026-12-06),
# and at 0.25 the rule switched SmolLM2's head off in most steps of open chat, where one draft a step pays.
DEFAULT_MIN_DRAFT_ACCEPTANCE = {"ngram": 0.1, "draft_model": 0.25, "eagle": 0.1, "layer_skip": 0.25}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    min_draft_acceptance: float | None = None
    rejection_sampler: str = "auto"
    tree_depth: int | None = None
    tree_top_k: int | None = None

    @property
    def uses_tree(self) -> bool:
        return self.tree_depth is not None

    @classmethod
    def from_dict(cls, config: "Mapping[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in config:
            raise ValueError(f"speculative_config needs a 'method', one of {METHODS}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (k >= 1 drafts per step)")
        return cls(**config)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or k <= 0:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method == "ngram":
            lo, hi = lookup
            if lo is None and hi is None:
                lo = hi = 5                      # vLLM's default
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
                raise ValueError(f"speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif lookup != (None, None):
            raise ValueError(f"speculative_config: prompt_lookup_min/max are for method 'ngram', not {self.method!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft checkpoint directory")
        if self.method in ("ngram", "layer_skip") and self.model is not None:
            raise ValueError(f"speculative_config: method {self.method!r} takes no 'model'")
        if self.model is not None:
            if not isinstance(self.model, (str, Path)):
                raise ValueError(f"speculative_config: model must be a path, got {self.model!r}")
            if not Path(self.model).expanduser().is_dir():
                raise ValueError(f"speculative_config: model {str(self.model)!r} is not a directory")
            object.__setattr__(self, "model", str(Path(self.model).expanduser()))
        if self.num_layers is not None and (self.method != "layer_skip" or not _is_int(self.num_layers)
                                            or self.num_layers < 1):
            raise ValueError(f"speculative_config: num_layers is a positive integer for method 'layer_skip', got "
                             f"{self.num_layers!r} with method {self.method!r}")
        if self.disable_by_batch_size is not None and (not _is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1 or None, "
                             f"got {self.disable_by_batch_size!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be a bool, got {self.adaptive!r}")
        theta = self.min_draft_acceptance
        if theta is None:
            object.__setattr__(self, "min_draft_acceptance", DEFAULT_MIN_DRAFT_ACCEPTANCE[self.method])
        elif isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 <= theta < 1:
            raise ValueError(f"speculative_config: min_draft_acceptance must be in [0, 1), got {theta!r}")
        if self.tree_depth is not None or self.tree_top_k is not None:
            if self.method != "eagle":
                raise ValueError(f"speculative_config: tree_depth/tree_top_k draft EAGLE-2 trees: method 'eagle' only, "
                                 f"not {self.method!r}")
            if self.tree_depth is None:
                raise ValueError("speculative_config: tree_top_k needs tree_depth (how deep the tree may grow)")
            top_k = 4 if self.tree_top_k is None else self.tree_top_k
            if not (_is_int(self.tree_depth) and _is_int(top_k) and self.tree_depth >= 1 and top_k >= 1):
                raise ValueError(f"speculative_config: tree_depth and tree_top_k must be integers >= 1, got "
                                 f"{self.tree_depth!r} and {self.tree_top_k!r}")
            object.__setattr__(self, "tree_top_k", top_k)
        if self.rejection_sampler not in REJECTION_SAMPLERS:
            raise ValueError(f"speculative_config: rejection_sampler must be one of {REJECTION_SAMPLERS}, "
                             f"got {self.rejection_sampler!r}")
