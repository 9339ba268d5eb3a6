"""Read a PEFT LoRA adapter directory into our model's layout: per merged layer, per slice, A and B.

Mirrors vLLM's `vllm/lora/peft_helper.py: PEFTHelper` (adapter_config.json: rank, alpha, rsLoRA,
and the options vLLM refuses) and `vllm/lora/lora_model.py: LoRAModel.from_local_checkpoint`
(adapter_model.safetensors -> one `LoRALayerWeights` per targeted module).

What `PeftModel.save_pretrained` writes:

    adapter_config.json            {"r": 8, "lora_alpha": 16, "use_rslora": false, "target_modules": [...], ...}
    adapter_model.safetensors      base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                                   base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]

and PEFT computes, for each targeted HF module, y = x W^T + scaling * (x A^T) B^T with
scaling = alpha / r (rsLoRA: alpha / sqrt(r), which keeps the update's size independent of r).

Why a mapping: HF adapters target HF's separate projections, but our model merges them (chapter 07's
loader, STACKED_PARAMS_MAPPING): q_proj/k_proj/v_proj are slices 0/1/2 of `qkv_proj`, gate_proj/up_proj
slices 0/1 of `gate_up_proj`; o_proj and down_proj are one slice each (vLLM: `packed_modules_mapping`).
Each slice keeps its own A and B: a LoRA on q does not touch k's rows (a block-diagonal update).

Strict on purpose, like the base loader: an adapter we cannot reproduce exactly (DoRA, LoRA biases,
fan_in_fan_out, per-module ranks, ...) or a tensor that would not land where PEFT applies it is a
ValueError naming the file and the key, never a silently different model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from model_executor.linear import Linear
from model_executor.parallel_linear import RowParallelLinear
from paged_attention.model.llama import STACKED_PARAMS_MAPPING

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."                        # PeftModel wraps the HF model: keys start with this
LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # our layers that can take a LoRA

# adapter_config.json options we cannot reproduce, with the value(s) meaning "not used".
# (vLLM's PEFTHelper refuses DoRA, biases and modules_to_save the same way.)
UNSUPPORTED_OPTIONS = {
    "use_dora": (False, None),                 # DoRA rescales each column of W + BA: not a low-rank delta
    "bias": ("none", None),                    # trained biases change the base layer
    "lora_bias": (False, None),
    "modules_to_save": (None, []),             # full copies of other modules (lm_head, embeddings)
    "fan_in_fan_out": (False, None),           # Conv1D-style transposed weights (GPT-2)
    "rank_pattern": (None, {}),                # a different rank or alpha per module
    "alpha_pattern": (None, {}),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "alora_invocation_tokens": (None, []),
}


@dataclass(frozen=True)
class LoRATarget:
    """One of our layers that can take a LoRA, as THIS rank holds it: input size, and per slice its HF
    name and output size. With tensor parallelism a rank holds a shard of the layer, and so of its
    LoRA (vLLM: `ColumnParallelLinearWithLoRA` / `RowParallelLinearWithLoRA`):

        column-parallel (qkv, gate_up)  W_r = rows of W      -> B_r = the same rows of B, A whole
        row-parallel (o, down)          W_r = columns of W   -> A_r = the same columns of A, B whole

    so a rank's delta is (x A^T) B_r^T (its output rows), or (x_r A_r^T) B^T (a partial sum that the
    layer's all-reduce adds up with the base product's: sum_r x_r A_r^T = x A^T). The checkpoint
    holds the whole A and B; `checkpoint_*` are their shapes and where this rank's shard starts."""
    input_size: int
    output_sizes: tuple[int, ...]                # rows of each slice in the merged output (q | k | v)
    hf_names: tuple[str, ...]                    # ("q_proj", "k_proj", "v_proj")
    checkpoint_input_size: int | None = None     # A's columns in the checkpoint (None: input_size)
    input_offset: int = 0                        # row-parallel: this rank's first column of A
    checkpoint_output_sizes: tuple[int, ...] | None = None   # B's rows per slice in the checkpoint
    output_offsets: tuple[int, ...] | None = None            # column-parallel: this rank's first row of each B
    local: bool = True                           # False: a layer another pipeline stage holds (checked, not kept)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First output row of each slice."""
        return tuple(sum(self.output_sizes[:i]) for i in range(len(self.output_sizes)))

    def checkpoint_shapes(self, index: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The whole A [r, in] and B [out_i, r] of slice `index` as a checkpoint stores them."""
        full_in = self.checkpoint_input_size or self.input_size
        full_out = (self.checkpoint_output_sizes or self.output_sizes)[index]
        return (r, full_in), (full_out, r)

    def shard(self, index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of slice `index`, cut from the checkpoint's (views; no shard: as they are)."""
        if self.checkpoint_input_size not in (None, self.input_size):
            lora_a = lora_a.narrow(1, self.input_offset, self.input_size)
        if self.output_offsets is not None:
            lora_b = lora_b.narrow(0, self.output_offsets[index], self.output_sizes[index])
        return lora_a, lora_b


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Every layer of `model` a LoRA can target, by module name ("model.layers.0.self_attn.qkv_proj"),
    with this rank's shard of it under tensor parallelism (model_executor/parallel_linear.py)."""
    mapping = getattr(model, "stacked_params_mapping", STACKED_PARAMS_MAPPING)
    targets = {}
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if not isinstance(module, Linear) or short not in LORA_LAYERS:
            continue
        tp_size = getattr(module, "tp_size", 1)
        if hasattr(module, "shard_ids"):                       # merged: one slice per checkpoint piece
            piece_of = {sid: piece.lstrip(".") for merged, piece, sid in mapping if merged.lstrip(".") == short}
            hf_names = tuple(piece_of[sid] for sid in module.shard_ids)
            sizes = tuple(module.output_sizes)
        else:
            hf_names, sizes = (short,), (module.output_size,)
        target = LoRATarget(module.input_size, sizes, hf_names)
        if tp_size > 1 and hasattr(module, "checkpoint_rows"):         # column-parallel: rows of each B
            target = dataclasses.replace(
                target, checkpoint_output_sizes=tuple(module.checkpoint_rows(s) for s in module.shard_ids),
                output_offsets=tuple(module.shard_offset_in_checkpoint(s) for s in module.shard_ids))
        elif tp_size > 1 and isinstance(module, RowParallelLinear):     # row-parallel: columns of A
            target = dataclasses.replace(target, checkpoint_input_size=module.input_size * tp_size,
                                         input_offset=module.tp_rank * module.input_size)
        elif tp_size > 1:
            raise ValueError(f"{name}: a tensor-parallel layer of type {type(module).__name__} cannot take a LoRA")
        targets[name] = target
    return targets


def checkpoint_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """lora_targets(model), plus the layers another pipeline stage holds (chapter 07's `PPMissingLayer`
    placeholders, found by name: this chapter also runs on models without them) as `local=False`
    copies of this stage's layers of the same kind -- every decoder layer has the same shapes. Every
    stage then checks an adapter's WHOLE file and reaches the same verdict, though it keeps only its
    own layers (a stage that refused a request the others ran would desynchronise the pipeline)."""
    targets = lora_targets(model)
    layer_of = re.compile(r"(.*\.layers\.)(\d+)(\..*)")
    template: dict[str, LoRATarget] = {}                          # ".self_attn.qkv_proj" -> a local target
    for name, target in targets.items():
        hit = layer_of.fullmatch(name)
        if hit:
            template.setdefault(hit.group(3), target)
    missing = [name for name, module in model.named_modules()
               if type(module).__name__ == "PPMissingLayer" and re.fullmatch(r".*\.layers\.\d+", name)]
    for layer in missing:
        for suffix, target in template.items():
            targets[f"{layer}{suffix}"] = dataclasses.replace(target, local=False)
    return targets


def hf_module_map(targets: dict[str, LoRATarget]) -> dict[str, tuple[str, int]]:
    """HF module name -> (our layer name, slice): "model.layers.0.self_attn.k_proj" -> ("...qkv_proj", 1)."""
    out = {}
    for name, target in targets.items():
        prefix = name.rsplit(".", 1)[0]
        for index, hf_name in enumerate(target.hf_names):
            out[f"{prefix}.{hf_name}"] = (name, index)
    return out


@dataclass(frozen=True)
class PEFTConfig:
    """The parts of adapter_config.json that change the computation (vLLM: PEFTHelper)."""
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str        # a list of names/suffixes, or one regex (PEFT's two forms)
    layers_to_transform: tuple[int, ...] | None
    exclude_modules: tuple[str, ...] | str | None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_file(cls, path: Path, max_lora_rank: int) -> "PEFTConfig":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read the adapter config ({e})") from e
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not a LoRA adapter")
        for key, unused in UNSUPPORTED_OPTIONS.items():
            if raw.get(key) not in unused:
                raise ValueError(f"{path}: unsupported PEFT option {key}={raw[key]!r} (only plain LoRA is served)")
        r = raw.get("r")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
        if r > max_lora_rank:
            raise ValueError(f"{path}: LoRA rank r={r} is above max_lora_rank={max_lora_rank}")
        alpha = raw.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)):
            raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
        targets = raw.get("target_modules")
        if not targets:
            raise ValueError(f"{path}: no target_modules")
        layers = raw.get("layers_to_transform")
        exclude = raw.get("exclude_modules")
        return cls(r, float(alpha), bool(raw.get("use_rslora", False)),
                   targets if isinstance(targets, str) else tuple(targets),
                   None if layers is None else tuple([layers] if isinstance(layers, int) else layers),
                   exclude if exclude is None or isinstance(exclude, str) else tuple(exclude))


def _peft_matches(module_name: str, spec: tuple[str, ...] | str) -> bool:
    """PEFT's rule: a string is a regex over the full name; a list matches a name or a dotted suffix."""
    if isinstance(spec, str):
        return re.fullmatch(spec, module_name) is not None
    return any(module_name == s or module_name.endswith("." + s) for s in spec)


def expected_modules(config: PEFTConfig, hf_modules: list[str], where: Path) -> set[str]:
    """The HF modules PEFT put a LoRA on: targeted, in a transformed layer, not excluded. A target
    naming nothing our model can take a LoRA on (lm_head, embed_tokens, a typo) is an error."""
    supported = sorted({m.rsplit(".", 1)[-1] for m in hf_modules})
    if config.target_modules == "all-linear":                     # PEFT's shorthand (lm_head excluded)
        targeted = set(hf_modules)
    elif isinstance(config.target_modules, str):
        targeted = {m for m in hf_modules if _peft_matches(m, config.target_modules)}
        if not targeted:
            raise ValueError(f"{where}: target_modules regex {config.target_modules!r} matches no layer this "
                             f"model can take a LoRA on (supported: {supported})")
    else:
        for spec in config.target_modules:
            if not any(_peft_matches(m, (spec,)) for m in hf_modules):
                raise ValueError(f"{where}: target module {spec!r} is not a layer this model can take a LoRA "
                                 f"on (supported: {supported})")
        targeted = {m for m in hf_modules if _peft_matches(m, config.target_modules)}
    if config.layers_to_transform is not None:
        targeted = {m for m in targeted
                    if (hit := re.search(r"\.layers\.(\d+)\.", m)) and int(hit.group(1)) in config.layers_to_transform}
    if config.exclude_modules:
        targeted = {m for m in targeted if not _peft_matches(m, config.exclude_modules)}
    return targeted


@dataclass
class LoRALayerWeights:
    """One slice's low-rank pair, as stored (vLLM: lora/lora_weights.py LoRALayerWeights)."""
    lora_a: torch.Tensor                         # [r, in]
    lora_b: torch.Tensor                         # [out_slice, r]   (scaling NOT folded in)


@dataclass
class LoRAModel:
    """A loaded adapter in our layout (vLLM: LoRAModel): layers[our layer name][slice] -> A, B."""
    path: Path
    config: PEFTConfig
    layers: dict[str, dict[int, LoRALayerWeights]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.r

    @property
    def scaling(self) -> float:
        return self.config.scaling


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not path.is_file():
        hint = " (found adapter_model.bin: only safetensors adapters are loaded)" \
            if (path.parent / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{path}: adapter weights not found{hint}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:                       # safetensors raises its own SafetensorError (and others)
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def load_peft_adapter(adapter_dir: str | Path, targets: dict[str, LoRATarget], max_lora_rank: int) -> LoRAModel:
    """Read `adapter_dir` (as PeftModel.save_pretrained wrote it) for a model whose LoRA-able layers
    are `targets` (lora_targets(model), or checkpoint_targets(model) under pipeline parallelism): each
    tensor checked against the checkpoint's shape, then cut to this rank's shard; tensors of layers
    that are not `local` are checked and dropped. Tensors stay in their stored dtype, on the CPU."""
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
    if not config_path.is_file():
        raise ValueError(f"{config_path}: not found (expected a PEFT adapter directory)")
    config = PEFTConfig.from_file(config_path, max_lora_rank)
    module_map = hf_module_map(targets)
    modules = expected_modules(config, list(module_map), config_path)
    tensors = _read_tensors(weights_path)

    lora = LoRAModel(adapter_dir, config)
    for module in sorted(modules):
        layer_name, index = module_map[module]
        target = targets[layer_name]
        keys = (f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight")
        pair = []
        for key, shape in zip(keys, target.checkpoint_shapes(index, config.r)):
            if key not in tensors:
                raise ValueError(f"{weights_path}: missing tensor {key!r} (target module {module} per {CONFIG_FILE})")
            tensor = tensors.pop(key)
            if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise ValueError(f"{weights_path}: tensor {key!r} has shape {tuple(tensor.shape)} "
                                 f"({tensor.dtype}), expected {shape} (floating point)")
            pair.append(tensor)
        if target.local:
            lora.layers.setdefault(layer_name, {})[index] = LoRALayerWeights(*target.shard(index, *pair))
    if tensors:                                  # a tensor PEFT would apply somewhere we would not
        raise ValueError(f"{weights_path}: unexpected tensor {sorted(tensors)[0]!r} "
                         f"({len(tensors)} in all): not a LoRA A/B of a module {CONFIG_FILE} targets")
    return lora
