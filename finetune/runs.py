"""A finished run, opened for use: its recipe, its tokenizer, its model as trained, its eval records.

    from finetune.runs import open_run, load_trained
    run = open_run("runs/demo-cpu")          # RunDirError saying what is missing otherwise
    model, tokenizer = load_trained(run)     # 4-bit base + adapter when the run was QLoRA

A run directory (written by `finetune run`) holds recipe.yaml and adapter/ (LoRA)
or model/ (full fine-tuning). An adapter export (`finetune export`) holds
recipe.yaml with the adapter files beside it, and opens the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from finetune.config import RecipeConfig, build_recipe, resolve_path
from finetune.data import build_examples, held_out_records, load_records
from finetune.errors import ConfigError, DataError, HardwareError, RunDirError
from finetune.evaluate import Scores, score
from finetune.hardware import resolve_precision
from finetune.model import default_device, load_base_model, load_tokenizer

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class Run:
    path: Path
    cfg: RecipeConfig
    weights_dir: Path  # the adapter (PEFT format) or a whole model (full fine-tuning, merged export)
    has_recipe: bool = True  # False: a bare model directory; cfg then holds defaults around model.path

    @property
    def is_adapter(self) -> bool:
        return (self.weights_dir / "adapter_config.json").is_file()


def _weights_dir(path: Path) -> Path | None:
    for candidate in (path / "adapter", path / "model"):
        if (candidate / "adapter_config.json").is_file() or (candidate / "config.json").is_file():
            return candidate
    return path if (path / "adapter_config.json").is_file() else None


def _read_recipe(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        build_recipe(data, source=str(path))
    except (yaml.YAMLError, ConfigError) as exc:
        raise RunDirError(
            f"'{path}' is not a valid recipe: {exc}",
            hint="it is written by `finetune run`; restore it from the recipe the run was started with",
        ) from None
    return data


def open_run(path: str | Path, allow_model_dir: bool = False) -> Run:
    """The finished run (or adapter export) at `path`; RunDirError listing what is missing otherwise.

    allow_model_dir: also accept a standalone model directory (config.json + weights,
    e.g. a merged export); its recipe.yaml, when there is one, supplies data.format.
    """
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(
            f"'{path}' is not a directory",
            hint="pass the output_dir of a finished `finetune run` (it holds recipe.yaml and adapter/)",
        )
    if allow_model_dir and (path / "config.json").is_file():
        has_recipe = (path / "recipe.yaml").is_file()
        data = _read_recipe(path / "recipe.yaml") if has_recipe else {"data": {"path": str(path)}, "output_dir": str(path)}
        # The weights are the whole model: nothing to quantize as in training, no adapter on top.
        model = {**(data.get("model") or {}), "path": str(path), "tokenizer": None, "revision": None}
        data.update(model=model, quant={"bits": None}, lora=None)
        return Run(path=path, cfg=build_recipe(data, source=str(path)), weights_dir=path, has_recipe=has_recipe)
    missing = []
    if not (path / "recipe.yaml").is_file():
        missing.append("recipe.yaml (the resolved recipe, written when a run starts)")
    weights = _weights_dir(path)
    if weights is None:
        missing.append("adapter/ with adapter_config.json (the final adapter, written when training ends)")
    elif weights.name != "model":
        missing += [f"{weights.relative_to(path) / f}" for f in ADAPTER_FILES if not (weights / f).is_file()]
    if missing:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        unfinished = (path / "checkpoints").is_dir() and weights is None
        hint = (
            "the run did not finish: continue it with `finetune run RECIPE resume=auto`, then use its output_dir"
            if unfinished
            else "pass the output_dir of a finished `finetune run`, or a directory written by `finetune export`"
        )
        raise RunDirError(f"'{path}' is not a finished run: missing {'; '.join(missing)} (found: {found})", hint=hint)
    cfg = build_recipe(_read_recipe(path / "recipe.yaml"), source=str(path / "recipe.yaml"))
    return Run(path=path, cfg=cfg, weights_dir=weights)


def inference_precision(cfg: RecipeConfig) -> str:
    """The run's precision where this machine has it, else what it does have (e.g. a bf16 GPU run opened on a CPU)."""
    try:
        return resolve_precision(cfg.precision)
    except HardwareError:
        return resolve_precision("auto")


def run_tokenizer(run: Run):
    """The tokenizer saved with the run's weights (the one training used, chat template included)."""
    has_own = (run.weights_dir / "tokenizer_config.json").is_file()
    source = str(run.weights_dir) if has_own else run.cfg.model.tokenizer
    model = run.cfg.model.model_copy(update={"tokenizer": source})
    return load_tokenizer(run.cfg.model_copy(update={"model": model}))


def load_trained(run: Run, precision: str | None = None, device: torch.device | None = None):
    """(model, tokenizer) as the run left them, in eval mode: the base quantized as in training + the adapter."""
    from peft import PeftModel

    precision = precision or inference_precision(run.cfg)
    device = device or default_device()
    tokenizer = run_tokenizer(run)
    if run.is_adapter:
        base = load_base_model(run.cfg, precision=precision, device=device)
        model = PeftModel.from_pretrained(base, str(run.weights_dir))
    else:
        # Full fine-tuning saved every weight: load them unquantized, as they were trained.
        whole = run.cfg.model.model_copy(update={"path": str(run.weights_dir), "tokenizer": None})
        cfg = run.cfg.model_copy(update={"model": whole, "quant": run.cfg.quant.model_copy(update={"bits": None})})
        model = load_base_model(cfg, precision=precision, device=device)
    model.eval()
    model.config.use_cache = True  # load_base_model turns it off for training; generation wants it
    return model, tokenizer


def load_base(run: Run, precision: str | None = None, device: torch.device | None = None):
    """The run's base model as training loaded it (quantized per quant.bits), in eval mode."""
    model = load_base_model(run.cfg, precision=precision or inference_precision(run.cfg), device=device or default_device())
    model.eval()
    model.config.use_cache = True
    return model


# --------------------------------------------------------------------------- eval data


def eval_records(run: Run, data_path: str | None = None) -> tuple[list[dict], str]:
    """(records, where they came from) to score a run on.

    The first that exists: `data_path`, eval.exact_match_path, data.eval_path, the
    held-out split of data.path (the same records training held out).
    """
    cfg = run.cfg
    if data_path:
        return load_records(data_path, cfg.data, key="--data"), data_path
    if cfg.eval.exact_match_path:
        return load_records(resolve_path(cfg.eval.exact_match_path), cfg.data, key="eval.exact_match_path"), cfg.eval.exact_match_path
    if cfg.data.eval_path:
        return load_records(resolve_path(cfg.data.eval_path), cfg.data, key="data.eval_path"), cfg.data.eval_path
    if cfg.data.eval_fraction > 0:
        # Exactly the records training held out: all sources, bad rows skipped as training did.
        return held_out_records(cfg), f"{cfg.data.path} (held-out {cfg.data.eval_fraction:g})"
    raise DataError(
        f"the run at '{run.path}' has no eval data (no eval.exact_match_path, data.eval_path or data.eval_fraction)",
        hint="pass --data FILE (same format as the training data)",
    )


@dataclass
class RunEval:
    source: str
    records: int
    columns: dict[str, Scores]  # "base" and "fine-tuned"


def evaluate_run(
    run: Run, records: list[dict], source: str, limit: int | None = None, max_new_tokens: int | None = None, batch_size: int = 8
) -> RunEval:
    """Loss, perplexity, exact and contains match of the base model and of the fine-tuned one, on the same records."""
    records = records[:limit] if limit else records
    cfg = run.cfg
    max_new = max_new_tokens or cfg.eval.max_new_tokens
    model, tokenizer = load_trained(run)
    examples, _ = build_examples(records, cfg, tokenizer, key=source)
    args = (tokenizer, records, examples, cfg.data.format, max_new, batch_size)
    tuned = score(model, *args)
    if run.is_adapter:
        with model.disable_adapter():  # the same weights in memory minus the adapter: the base as trained
            base = score(model, *args)
    else:
        del model
        base = score(load_base(run), *args)
    return RunEval(source=source, records=len(records), columns={"base": base, "fine-tuned": tuned})
