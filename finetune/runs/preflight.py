"""Everything that can be checked before loading weights, reported together.

    from finetune.runs.preflight import preflight
    report = preflight(cfg)      # report.problems: list[str]; report.notes: list[str]

Used by `finetune validate` and, before anything expensive, by `finetune run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.schema import RecipeConfig
from finetune.data import check_data_source, check_sample
from finetune.errors import ConfigError, FinetuneError
from finetune.hardware import resolve_precision
from finetune.memory.stream import stream_kept
from finetune.model.load import (
    check_model_source,
    load_tokenizer,
    looks_like_hub_id,
    model_config,
    model_source,
    tokenizer_source,
)
from finetune.model.targets import check_lora_targets
from finetune.plan import preflight_memory
from finetune.runs.checkpoint import output_dir_problem
from finetune.runs.report import missing_extras, plot_available


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    precision: str | None = None
    tokenizer: object | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _tokenizer_is_local(cfg: RecipeConfig) -> bool:
    return Path(tokenizer_source(cfg)).is_dir()


def kept_layers_problems(cfg: RecipeConfig) -> list[str]:
    """memory.device_layers against config.json's decoder layers, before a weight loads (a hub config that cannot be
    read now: loading says it)."""
    config = model_config(cfg, quiet=True)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    try:
        stream_kept(layers, cfg.memory.device_layers) if isinstance(layers, int) else None
    except ConfigError as exc:
        return exc.problems
    return []


def preflight(cfg: RecipeConfig, memory_check: bool = True, training: bool = True) -> PreflightReport:
    """Every check short of loading weights. memory_check=False turns a predicted out-of-memory into a note.

    training=False leaves out what only a training run needs (memory, output_dir, resume): for `finetune data`.
    """
    report = PreflightReport()
    try:
        report.precision = resolve_precision(cfg.precision)
    except FinetuneError as exc:
        report.problems.append(f"precision: {exc}")

    model_problems = check_model_source(cfg)
    report.problems += model_problems
    target_problems, target_notes = check_lora_targets(cfg)
    report.problems += [] if model_problems else target_problems
    report.notes += [] if model_problems else target_notes  # a damaged config.json is reported once, above
    report.problems += [] if model_problems or not cfg.memory.device_layers else kept_layers_problems(cfg)
    src = tokenizer_source(cfg)
    # A config.json that is there but damaged (reported above) fails the tokenizer of the same folder too: one problem, not two.
    damaged_config = bool(model_problems) and src == model_source(cfg) and (Path(src) / "config.json").is_file()
    if _tokenizer_is_local(cfg):
        try:
            report.tokenizer = None if damaged_config else load_tokenizer(cfg)
        except FinetuneError as exc:
            report.problems.append(str(exc))
    elif looks_like_hub_id(src):
        report.notes.append(f"model '{src}' is a hub id: its files are fetched (or read from the HF cache) at run time")
    elif cfg.model.tokenizer:
        report.problems.append(f"model.tokenizer: '{cfg.model.tokenizer}' is neither a local directory nor a hub id")

    data_problems = check_data_source(cfg)  # data.path, data.mix, data.eval_path, eval.exact_match_path
    report.problems += data_problems
    if report.tokenizer is not None and not data_problems and training:
        # Template and label masks of the first records: a wrong template fails here, not after loading 70B.
        report.problems += check_sample(cfg, report.tokenizer)

    if not training:
        return report
    problems, notes = preflight_memory(cfg, refuse=memory_check)  # an unreadable model is a note here, a problem above
    report.problems += problems
    report.notes += notes

    report.problems += missing_extras(cfg)  # report.tensorboard / report.wandb without their package
    if cfg.report.plot and not plot_available():
        report.notes.append("report.plot: matplotlib is not installed, so no loss.png (pip install 'finetune[plot]')")

    problem = output_dir_problem(cfg)
    if problem:
        report.problems.append(problem)
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_dir():
        report.problems.append(
            f"resume: checkpoint directory '{cfg.resume}' not found; use resume=auto or an existing checkpoints/step-N"
        )
    return report
