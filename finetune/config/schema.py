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
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from finetune import adapters
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
from finetune.errors import ConfigError
from finetune.memory import techniques
from finetune.objectives import table as objectives
from finetune.parallel import compression, zero_config

# data.format: the formats of finetune/data/formats/, one module each (that package checks this
# list against its registry on import; config cannot import it: imports flow one way).
DataFormat = Literal["alpaca", "completion", "input_output", "messages", "preference", "sharegpt", "text"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(description="Hugging Face hub id or local directory of a causal LM")
    revision: str | None = None
    tokenizer: str | None = Field(None, description="tokenizer source; defaults to model.path")
    trust_remote_code: bool = False
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "varlen"] = Field(
        "auto",
        description="auto: the fastest the model supports (flash_attention_2 on a GPU when flash-attn is installed, "
        "varlen for packed rows on CUDA in 16-bit and of 1024+ tokens on a CPU, else sdpa, else eager), with a note "
        "when it falls back or "
        "picks varlen; varlen: finetune's own (finetune/model/varlen.py), packed "
        "examples attend each to itself with no T x T mask (torch's varlen flash kernel on CUDA in 16-bit)",
    )
    kernels: Literal["auto", "none", "liger"] = Field(
        "auto",
        description="fused kernels in the decoder layers (finetune/model/kernels.py): liger-kernel's RMSNorm, RoPE, SwiGLU; "
        "auto: liger on CUDA when installed (pip install 'finetune[gpu]') for the families it knows, never on a CPU",
    )


class MixSource(_Section):
    """One more dataset mixed into the training data (data.mix)."""

    path: str = Field(description="local file/folder or hub dataset name")
    weight: float = Field(1.0, gt=0, description="examples drawn per epoch = weight x its size (0.5: a seeded half)")
    format: DataFormat | None = None  # None: data.format
    columns: dict[str, str] | None = None  # None: data.columns
    split: str | None = None  # None: data.split
    subset: str | None = None  # hub dataset configuration name (load_dataset's second argument)


class DataConfig(_Section):
    path: str = Field(description="local JSON/JSONL/CSV/Parquet file or hub dataset name")
    format: DataFormat = "alpaca"
    split: str = "train"
    subset: str | None = Field(None, description="hub dataset configuration, e.g. 'main' for openai/gsm8k")
    weight: float = Field(1.0, gt=0, description="like data.mix[].weight, for data.path")
    mix: list[MixSource] = Field(default_factory=list, description="more datasets, each with its own weight")
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    max_seq_len: int = Field(2048, ge=8)
    columns: dict[str, str] = Field(
        default_factory=dict, description="map our column names to the dataset's, e.g. {output: answer}"
    )
    template: Literal["auto", "chatml", "llama3", "mistral", "alpaca"] = Field(
        "auto", description="chat template for chat data formats (messages, ...): auto = the tokenizer's own"
    )
    train_on: Literal["assistant", "last", "all"] = Field(
        "assistant", description="assistant: every reply; last: the last reply only; all: every token"
    )
    truncation: Literal["truncate", "drop"] = "truncate"
    skip_bad_rows: bool = Field(False, description="skip (and count) malformed rows instead of stopping")
    mask_check: Literal["error", "warn", "drop", "off"] = Field(
        "error", description="examples whose label mask looks wrong: error stops, warn trains them, drop leaves them out"
    )
    packing: bool = Field(False, description="concatenate examples into rows of max_seq_len (no cross-attention)")
    group_by_length: bool = Field(False, description="batch examples of similar length (less padding)")
    num_proc: int = Field(1, ge=1, description="processes that tokenize")
    cache: bool = Field(True, description="reuse tokenized data from an earlier run with the same inputs")
    cache_dir: str | None = None  # None: $FINETUNE_CACHE or ~/.cache/finetune
    shuffle: bool = True


class QuantConfig(_Section):
    bits: Literal[4, 8] | None = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True


# lora.method: the methods of finetune/adapters/, one module each.
AdapterName = Literal[adapters.NAMES]  # type: ignore[valid-type]


class LoraConfig(_Section):
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target: str | list[str] = "all-linear"
    dora: bool = Field(False, description="the older spelling of method=dora (still read; recipe.yaml writes method)")
    method: AdapterName = Field(
        adapters.DEFAULT, description=" | ".join(f"{m.name}: {m.summary}" for m in adapters.METHODS.values())
    )

    @model_validator(mode="before")
    @classmethod
    def _dora_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dora") is True:
            if data.get("method", "dora") != "dora":
                raise ValueError(
                    f"lora.dora=true and lora.method={data['method']} name two methods; remove lora.dora "
                    "(the older spelling of lora.method=dora)"
                )
            data = {**data, "method": "dora"}
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data.pop("dora", None)  # written as method: dora
        data["method"] = self.adapter.name
        return data

    @property
    def adapter(self) -> adapters.AdapterMethod:
        """The method trained (finetune.adapters): lora.method, or dora when lora.dora=true."""
        return adapters.method_of(self)

    @property
    def method_key(self) -> str:
        """The method as this recipe spells it, for messages."""
        return "lora.dora=true" if self.dora else f"lora.method={self.method}"


class TrainConfig(_Section):
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs")
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1, description="micro-batch (examples per forward)")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0)
    log_every_steps: int = Field(1, ge=1)
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="non-finite loss/grad: stop (checkpoint of the last good state + error) or skip the update"
    )
    loss_spike_factor: float = Field(3.0, gt=1.0, description="log a warning when loss > factor x its recent mean")
    objective: Literal["sft", "dpo", "orpo", "simpo"] = Field(
        "sft",
        description="sft: next-token loss on the responses; dpo, orpo, simpo: preference tuning on "
        "data.format=preference pairs (finetune/objectives/table.py)",
    )
    beta: float | None = Field(
        None, gt=0, description="preference strength; null: dpo 0.1 (KL to the reference), orpo 0.1, simpo 2.0"
    )
    simpo_gamma: float | None = Field(None, ge=0, description="simpo: target reward margin; null: beta / 2")
    precompute_reference: bool = Field(
        False,
        description="dpo: the reference log-probabilities computed in one pass before training and cached, "
        "instead of a forward with the adapter off at every step",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer: compiled during the first step (tens of seconds), the same "
        "results within float rounding; whether it is faster depends on the model and the GPU (measure: --profile)",
    )


class EvalConfig(_Section):
    every_steps: int | None = Field(None, ge=1, description="eval loss every N steps (needs eval data)")
    batch_size: int | None = Field(None, ge=1)
    max_batches: int | None = Field(None, ge=1)
    exact_match_path: str | None = Field(
        None, description="file of prompts+answers (same format as data) scored by greedy generation before and after training"
    )
    exact_match_limit: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(32, ge=1)


class CheckpointConfig(_Section):
    every_steps: int | None = Field(None, ge=1)
    keep_last: int | None = Field(2, ge=1)


class DistributedConfig(_Section):
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto",
        description="ddp: a replica per process; fsdp: weights and optimizer state sharded; deepspeed: ZeRO (parallel/zero_config.py)",
    )
    cpu_offload: bool = Field(False, description="fsdp: sharded parameters, gradients and optimizer state live in CPU RAM")
    reshard_after_forward: bool = Field(True, description="fsdp: free gathered layers after forward (less memory, more traffic)")
    zero_stage: Literal[2, 3] = Field(2, description="deepspeed: 2 partitions optimizer state and gradients; 3 the weights too")
    offload_optimizer: zero_config.Offload = Field(
        "none", description="deepspeed: the optimizer state and its step on cpu or nvme"
    )
    offload_params: zero_config.Offload = Field(
        "none", description="deepspeed zero_stage 3: the weight partitions wait on cpu or nvme"
    )
    nvme_dir: str | None = Field(None, description="deepspeed: folder on an NVMe disk for the offloads set to nvme")
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = Field(
        "none",
        description="ddp: how gradients travel in the all-reduce (slow links between nodes): none (fp32), "
        "bf16 | fp16 (half the bytes), powersgd (low-rank factors with error feedback: a fraction of them)",
    )
    powersgd_rank: int = Field(1, ge=1, description="powersgd: rank of the factors (torch: start at 1, then 2, 4 if loss lags)")
    powersgd_warmup_steps: int | None = Field(
        None,
        ge=2,  # torch: DDP regroups its buckets after step 1, which PowerSGD's memory must not straddle
        description="powersgd: optimizer steps of plain all-reduce first; null: train.warmup_steps, at least 10",
    )


class MemoryConfig(_Section):
    """Trade speed for memory: recompute activations, move them or the frozen weights off the GPU."""

    activation_checkpointing: Literal["all", "none"] | Annotated[int, Field(ge=1)] = Field(
        "all", description="recompute decoder-layer activations in backward: all layers, none, or every k-th layer (k)"
    )
    activation_offload: bool = Field(
        False,
        description="what autograd saves for backward waits in pinned CPU RAM (copied on a side stream): all the "
        "activations of layers that are not checkpointed, and the input of each checkpointed one (brought back one "
        "layer ahead of its recomputation); works with every activation_checkpointing setting",
    )
    base_weights: Literal["device", "cpu", "disk"] = Field(
        "device",
        description="where the frozen decoder-layer weights live: cpu RAM or a file on disk (NVMe) are streamed "
        "to the GPU one layer at a time",
    )
    offload_dir: str | None = Field(
        None, description="base_weights=disk: folder for the weight file (put it on an NVMe disk); null: the cache dir"
    )
    optimizer_offload: bool = Field(
        False, description="optimizer state and the fp32 step run in CPU RAM (large LoRA ranks, full fine-tuning)"
    )
    loss: Literal["auto", "full", "chunked", "liger"] = Field(
        "auto",
        description="how the LM head and the loss meet: chunked computes them over loss_chunk target positions at a "
        "time, never holding the whole logits (long context); full holds the logits of every target; auto: chunked "
        "when a batch has more targets than one chunk (full under FSDP); liger: liger-kernel's fused kernel (CUDA)",
    )
    loss_chunk: int = Field(256, ge=16, description="target positions per chunk of memory.loss=chunked|auto")
    embeddings: Literal["device", "cpu"] = Field(
        "device",
        description="cpu: the frozen input embedding table stays in host RAM (lookups there, only the rows cross) and "
        "the LM head visits the GPU for the loss only, not while the decoder runs backward (the peak)",
    )
    tiled_mlp: Literal["auto", "off"] | Annotated[int, Field(ge=1)] = Field(
        "auto",
        description="each decoder layer's MLP over N tiles of the sequence, each recomputed in backward: its "
        "intermediate (3 x seq x intermediate_size) never exists whole; auto: tiles of 4096 positions when longer",
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare off/on as false/true: tiled_mlp: off means "off".
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @property
    def checkpoint_every(self) -> int:
        """Every how many decoder layers one is checkpointed; 0: none."""
        return techniques.checkpoint_every(self.activation_checkpointing)


class ReportConfig(_Section):
    """Where metrics go besides metrics.jsonl. The extras are optional installs, checked by `finetune validate`."""

    tensorboard: bool = Field(False, description="event files in output_dir/tensorboard (pip install 'finetune[tensorboard]')")
    wandb: bool = Field(False, description="Weights & Biases run (pip install 'finetune[wandb]')")
    wandb_project: str = Field("finetune", min_length=1, description="W&B project the run is logged to")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline writes output_dir/wandb only (upload later with `wandb sync`)"
    )
    plot: bool = Field(True, description="output_dir/loss.png at the end of the run (pip install 'finetune[plot]')")


class ProfileConfig(_Section):
    steps: str | None = Field(None, description="steps to record, 5-7 or 5: trace in output_dir/profile/, op table in the log")
    memory_timeline: bool = Field(True, description="CUDA: also a memory snapshot of those steps, for pytorch.org/memory_viz")

    @field_validator("steps", mode="before")
    @classmethod
    def _range(cls, value: Any) -> Any:
        first, dash, last = str(value).replace(" ", "").partition("-")
        if value is not None and not (first.isdigit() and (last.isdigit() or not dash) and 0 < int(first) <= int(last or first)):
            raise ValueError("not a range of optimizer steps: write FIRST-LAST, 1 <= FIRST <= LAST (e.g. 5-7), or one step")
        return value if value is None else first + dash + last


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
    """What the memory.* and FSDP offload modes cannot run with (finetune/memory/techniques.py's table)."""
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
    out += compression.problems(cfg) + zero_config.problems(cfg)
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
