"""Writing the fitted recipe: the recipe keys a setup changes, set in place in the recipe's own text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import RecipeConfig, build_recipe, read_recipe_file
from finetune.declarations import techniques, zero_config
from finetune.declarations.splits import SPLITS
from finetune.declarations.strategies import of_recipe
from finetune.plan.fitting import KNOBS
from finetune.plan.inputs import Setup, describe_setup
from finetune.plan.memory import Estimate, gib

# The Setup fields of a layout and the recipe keys they are written as: each split's size (its grid dimension),
# a pipeline's schedule (and its split of layers: pipeline_layers, below).
LAYOUT_FIELDS = {
    **{split.dim: split.key for split in SPLITS},
    "pipeline_schedule": "distributed.pipeline_schedule",
    "virtual_stages": "distributed.virtual_stages",
    "sp": "distributed.sequence_parallel",
    "vp": "distributed.vocab_parallel",
}


def recipe_value(knob: str, value: Any) -> Any:
    """A Setup value as its recipe key takes it (checkpoint_every 1/0/k -> all/none/k)."""
    if knob == "checkpoint_every":
        return techniques.checkpointing_value(value)
    return value


def changes_of(best: Estimate, base: Setup, cfg: RecipeConfig | None = None) -> dict[str, Any]:
    """Recipe keys to write so a run uses `best` (grad_accum follows batch and GPUs)."""
    return setup_changes(best.setup, base, cfg)


def setup_changes(setup: Setup, base: Setup, cfg: RecipeConfig | None = None) -> dict[str, Any]:
    """Recipe keys to write so a run of `base`'s recipe (cfg, when given) uses `setup`.

    With cfg, also the keys a setup makes moot that the recipe's rules would still read
    (finetune/declarations/techniques.py): distributed.strategy=fsdp and cpu_offload for a setup that
    does not shard (one GPU: the Setup of such a recipe says ddp), memory.offload_dir for one
    that neither streams from disk nor parks activations there.
    """
    out: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.recipe_key and getattr(setup, knob.name) != getattr(base, knob.name):
            out[knob.recipe_key] = recipe_value(knob.name, getattr(setup, knob.name))
    if setup.grad_accum != base.grad_accum:
        out["train.grad_accum"] = setup.grad_accum
    for field, key in LAYOUT_FIELDS.items():  # the layout the search chose (fitting._laid_out): its stages, ranks, schedule
        if getattr(setup, field) != getattr(base, field):
            out[key] = getattr(setup, field)
    given = cfg.distributed.pipeline_layers if cfg is not None else "even"
    # The recipe's split where the search kept its stages (fitting._laid_out); auto balances any other
    # pipeline; counts for another number of stages, or any split without a pipeline, would be refused.
    if setup.pipeline_layers and setup.pp != base.pp:  # an uneven split the search chose (stages.near_even)
        out["distributed.pipeline_layers"] = list(setup.pipeline_layers)
    elif given != "even" and (
        (setup.pp != base.pp and (given != "auto" or setup.pp == 1)) or setup.virtual_stages > 1  # interleaved: even only
    ):
        out["distributed.pipeline_layers"] = "even"
    if cfg is not None:
        chosen = setup.strategy
        if of_recipe(cfg).wraps_layers and not (chosen.wraps_layers and setup.gpus > 1):
            out.setdefault("distributed.strategy", "auto" if setup.gpus == 1 else "ddp")
        if cfg.distributed.cpu_offload and not setup.cpu_offload:
            out["distributed.cpu_offload"] = False
        if of_recipe(cfg).deepspeed and not chosen.deepspeed:
            # The search tries DDP and FSDP (not ZeRO): ZeRO's keys would be refused without strategy=deepspeed.
            out.update({f"distributed.{k}": v for k, v in zero_config.DEFAULTS.items() if getattr(cfg.distributed, k) != v})
        if setup.pp * setup.tp > 1 and cfg.distributed.grad_compression != "none":
            out["distributed.grad_compression"] = "none"  # a hook of DDP's all-reduce, which a layout does not use
        if cfg.memory.offload_dir is not None and setup.base_weights != "disk" and setup.activation_offload != "disk":
            out["memory.offload_dir"] = None
    return out


def _yaml_value(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def rewrite_recipe(text: str, values: dict[str, Any], comments: dict[str, str], command: str, header: list[str]) -> str:
    """The recipe `text` with dotted `values` set in place, each changed line commented.

    Keys keep their position and their own comment unless `comments` has a new
    one; missing keys are added under their section (missing sections at the
    end). The first line becomes `# {command}`, followed by `header` lines.
    """
    lines = text.splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    for dotted, value in values.items():
        parts = dotted.split(".")
        comment = comments.get(dotted)
        start, indent = 0, ""
        if len(parts) == 2:
            sec = next((i for i, ln in enumerate(lines) if ln.rstrip().split("#")[0].rstrip() == f"{parts[0]}:"), None)
            if sec is None:
                lines += ["", f"{parts[0]}:"]
                sec = len(lines) - 1
            start, indent = sec + 1, "  "
        end = len(lines)
        if indent:  # the section's block ends at the next line that starts at column 0
            end = next((i for i in range(start, len(lines)) if lines[i].strip() and not lines[i][0].isspace()), len(lines))
        key = parts[-1]
        at = next((i for i in range(start, end) if lines[i].startswith(f"{indent}{key}:")), None)
        if at is None:  # insert at the end of the section's key lines
            last = max(
                (i for i in range(start, end) if lines[i].strip() and not lines[i].lstrip().startswith("#")), default=start - 1
            )
            at = last + 1
            lines.insert(at, "")
            old_comment = comment or "set by finetune plan"
        else:
            old_comment = lines[at].split("#", 1)[1].strip() if "#" in lines[at] else "set by finetune plan"
            # a block-style value (list items on the following lines) is replaced by a flow-style one
            while at + 1 < len(lines) and lines[at + 1].startswith(indent + "  - "):
                del lines[at + 1]
        body = f"{indent}{key}: {_yaml_value(value)}"
        lines[at] = f"{body:<32} # {comment or old_comment}"
    return "\n".join([f"# {command}", *[f"# {h}" for h in header], *lines]) + "\n"


def with_values(tree: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a recipe dict with dotted `values` set."""
    out = dict(tree)
    for dotted, value in values.items():
        node = out
        *parents, key = dotted.split(".")
        for part in parents:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[key] = value
    return out


@dataclass
class FittedRecipe:
    path: Path
    changes: dict[str, Any]  # recipe key -> value written
    command: str  # how to run it


def write_fitted_recipe(
    source: Path, out: Path, overrides: dict[str, Any], current: Estimate, best: Estimate, invocation: str
) -> FittedRecipe:
    """Write `source` with the command line's overrides and the keys `best` changes, each changed key
    commented with why, and check the file loads back as the setup chosen."""
    cfg = build_recipe(with_values(read_recipe_file(source), overrides), str(source))
    changes = changes_of(best, current.setup, cfg)
    n, gpu = best.setup.gpus, best.gpu
    assert gpu is not None, "a fitted setup is planned for a GPU"
    nodes = gpu.nodes_of(n)
    command = f"finetune run {out}" if n == 1 else f"finetune run {out} --nproc {n}"
    if nodes > 1:  # torchrun on each node: ranks fill node 0 first, as the plan placed them
        command = (
            f"finetune run {out} --nproc {gpu.gpus_per_node} --nnodes {nodes} --node-rank R --master-addr NODE0 (on each node R)"
        )
    why = f"finetune plan --fit: {describe_setup(best.setup)}"
    header = [
        f"Written by `{invocation}` from {source}:",
        f"{n} x {gpu.name}, predicted peak {gib(best.peak_bytes)} of {gib(gpu.memory_bytes)} per GPU, ~{best.step_time_s:.1f} s/step.",
        "#",
    ]
    text = rewrite_recipe(
        Path(source).read_text(encoding="utf-8"), {**overrides, **changes}, {k: why for k in changes}, command, header
    )
    out.write_text(text, encoding="utf-8")
    written = build_recipe(read_recipe_file(out), str(out))
    if (written.train.batch_size, written.train.grad_accum) != (best.setup.batch_size, best.setup.grad_accum):
        raise AssertionError(f"{out} does not load back as the setup chosen")  # a bug in rewrite_recipe, not the user's
    return FittedRecipe(out, changes, command)
