"""Recipe schema: the only place defaults live.

    from finetune import load_recipe
    cfg = load_recipe("recipes/demo-cpu.yaml", ["train.lr=1e-3", "lora.r=8"])

A recipe is YAML (read with yaml.safe_load) validated by the pydantic models
below. Unknown keys are errors with a "did you mean" hint; all problems of a
recipe are reported together in one ConfigError. Recipes never name Python
objects to import.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from finetune.config.files import (  # noqa: F401 - re-exported: the config API
    ASSET_PREFIX,
    ASSETS_DIR,
    find_recipe,
    read_recipe,
    read_recipe_file,
    recipe_description,
    resolve_path,
    shipped_recipes,
)
from finetune.config.messages import field_path, parse_overrides, schema_problems  # noqa: F401 - parse_overrides: the config API
from finetune.config.sections import (  # noqa: F401 - re-exported: the config API
    CheckpointConfig,
    DataConfig,
    DataFormat,
    DistributedConfig,
    EvalConfig,
    LoraConfig,
    MemoryConfig,
    MixSource,
    ModelConfig,
    ProfileConfig,
    QuantConfig,
    ReportConfig,
    TrainConfig,
    _Section,
)
from finetune.declarations import compression, objectives, splits, techniques, zero_config
from finetune.errors import ConfigError


class RecipeConfig(_Section):
    description: str = ""
    model: ModelConfig
    data: DataConfig
    output_dir: str
    seed: int = 42
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    quant: QuantConfig = Field(default_factory=QuantConfig)
    lora: LoraConfig | None = Field(default_factory=LoraConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)  # torch.profiler (trainer/profiling.py); results unchanged
    resume: str | None = Field(None, description="null | auto | path to a checkpoint directory")
    resume_ignore_changes: bool = Field(
        False, description="resume even though seed/batch/data/model/LoRA changed (the run is then not exact)"
    )
    overwrite: bool = False

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> RecipeConfig:
        if info.context and info.context.get("skip_cross_field"):
            return self
        problems = cross_field_problems(self)
        if problems:
            # Raised as ValueError so pydantic merges it with other problems.
            raise ValueError("\n".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def fsdp_problems(cfg: RecipeConfig, why: str) -> list[str]:
    """What FSDP cannot run with this recipe; `why` names what chose FSDP (the key, or auto's choice)."""
    return techniques.problems(techniques.recipe_settings(cfg, fsdp=True, fsdp_by=why), (techniques.FSDP,))


def resolve_offload_dir(cfg: RecipeConfig) -> str | None:
    return resolve_path(cfg.memory.offload_dir) if cfg.memory.offload_dir else None


def memory_problems(cfg: RecipeConfig) -> list[str]:
    """What the memory.* and FSDP offload modes cannot run with (finetune/declarations/techniques.py's table)."""
    return techniques.problems(techniques.recipe_settings(cfg))


def adapter_problems(cfg: RecipeConfig) -> list[str]:
    """What lora.method's method cannot run with (its rules in finetune/adapters/)."""
    return [] if cfg.lora is None else cfg.lora.adapter.problems(cfg, cfg.lora.method_key)


def cross_field_problems(cfg: RecipeConfig) -> list[str]:
    """Rules that involve more than one key. Each message names the keys and the fix."""
    out = []
    if cfg.quant.bits is not None and cfg.lora is None:
        out.append(
            f"quant.bits={cfg.quant.bits} needs an adapter: quantized weights cannot be trained. "
            "Set lora (e.g. remove 'lora: null') or set quant.bits=null for full fine-tuning."
        )
    if cfg.eval.every_steps is not None and cfg.data.eval_path is None and cfg.data.eval_fraction == 0:
        out.append(
            "eval.every_steps is set but there is no eval data. "
            "Set data.eval_path=FILE or data.eval_fraction=0.05, or eval.every_steps=null."
        )
    if cfg.train.max_steps is not None and cfg.train.warmup_steps > cfg.train.max_steps:
        out.append(
            f"train.warmup_steps={cfg.train.warmup_steps} exceeds train.max_steps={cfg.train.max_steps}; lower warmup_steps."
        )
    if cfg.eval.exact_match_path and cfg.data.format == "text":
        out.append(
            "eval.exact_match_path needs prompts and answers, but data.format=text has none. "
            "Use alpaca, completion or messages data, or set eval.exact_match_path=null."
        )
    if cfg.data.packing and cfg.data.group_by_length:
        out.append(
            "data.packing and data.group_by_length both set: packed rows have no padding to save. "
            "Set data.group_by_length=false (or packing=false)."
        )
    if cfg.data.train_on != "assistant" and cfg.data.format == "text":
        out.append("data.train_on applies to prompt/response data; data.format=text trains every token. Remove it.")
    out += memory_problems(cfg)
    if cfg.resume is not None and cfg.overwrite:
        out.append("resume and overwrite=true contradict each other: resume continues a run, overwrite deletes it. Set one.")
    out += adapter_problems(cfg)
    out += objectives.problems(cfg)
    out += compression.problems(cfg) + zero_config.problems(cfg) + splits.problems(cfg)
    return out


# --------------------------------------------------------------------------- loading


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return field_path(RecipeConfig, loc)


def format_validation_error(err: ValidationError) -> list[str]:
    """One line per problem of a recipe's schema check (finetune.config.messages)."""
    return schema_problems(RecipeConfig, err)


def build_recipe(data: dict[str, Any], source: str | None = None) -> RecipeConfig:
    """Validate a recipe dict. Raises ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError([f"the recipe must be a YAML mapping of keys, found {type(data).__name__}"], source)
    try:
        return RecipeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err), source) from None


def _drop(tree: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Remove the key (or list item) at loc from nested dicts and lists, if it is there."""
    node: Any = tree
    for part in loc[:-1]:
        if not _has(node, part):
            return
        node = node[part]
    if loc and _has(node, loc[-1]):
        del node[loc[-1]]


def _has(node: Any, part: Any) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def check_recipe_dict(data: dict[str, Any], source: str | None = None) -> tuple[RecipeConfig | None, list[str]]:
    """(config, problems): every schema problem, plus the cross-field ones.

    Pydantic skips cross-field rules when a field is invalid; to still list every
    problem at once, the invalid keys are dropped (defaults take their place) and
    the rest is validated again. The config returned then is that stand-in, good
    for further checks (files, tokenizer) but not for training.
    """
    if not isinstance(data, dict):
        build_recipe(data, source)  # raises the "must be a mapping" ConfigError
    try:
        return RecipeConfig.model_validate(data), []
    except ValidationError as err:
        problems = format_validation_error(err)
        pruned = json.loads(json.dumps(data, default=str))
        for e in err.errors():
            if not e["loc"]:
                continue  # a cross-field rule: nothing to drop, the stand-in is checked again below
            # An unknown key goes alone; dropping the section that holds it (what _field_path
            # names) would add a false "required key is missing" for model or data.
            field = tuple(e["loc"]) if e["type"] == "extra_forbidden" else _field_path(tuple(e["loc"]))
            if e["type"] == "missing" or not field:
                return None, problems  # nothing sensible to check the rest against
            _drop(pruned, field)
    try:
        stand_in = RecipeConfig.model_validate(pruned, context={"skip_cross_field": True})
    except ValidationError as err:
        extra = [p for p in format_validation_error(err) if p not in problems]
        return None, problems + extra
    return stand_in, problems + [p for p in cross_field_problems(stand_in) if p not in problems]


def load_recipe(path: str | os.PathLike[str], overrides: list[str] | None = None) -> RecipeConfig:
    """Read a recipe YAML, apply dotted key=value overrides, validate.

    `path` may also name a shipped recipe ('demo-cpu'); see `shipped_recipes()`.
    """
    data, source = read_recipe(path, overrides)
    return build_recipe(data, source=source)
