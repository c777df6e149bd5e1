"""A finished run, opened for use: its recipe, its tokenizer, its model as trained, its eval records.

    from finetune.runs.open import open_run, load_trained
    run = open_run("runs/demo-cpu")          # RunDirError saying what is missing otherwise
    model, tokenizer = load_trained(run)     # 4-bit base + adapter when the run was QLoRA

Code in the model's folder runs only with open_run(..., trust_remote_code=True), the
user's choice: a run's recipe.yaml may come from anyone. On a GPU, a model whose
weights exceed its free memory is refused before loading (load_trained(run, device=cpu)).

A run directory (written by `finetune run`) holds recipe.yaml and adapter/ (LoRA)
or model/ (full fine-tuning). An adapter export (`finetune export`) holds
recipe.yaml with the adapter files beside it, and opens the same way.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from finetune.config.schema import RecipeConfig, build_recipe, resolve_path
from finetune.data import build_examples, held_out_records, load_records
from finetune.declarations import objectives
from finetune.errors import ConfigError, DataError, FinetuneError, HardwareError, ModelError, RunDirError
from finetune.hardware import cpu_device, device_free_bytes, resolve_precision
from finetune.metrics import human_bytes
from finetune.model.load import default_device, load_base_model, load_tokenizer, model_source, peft_arguments
from finetune.plan import loaded_weight_bytes
from finetune.runs.evaluate import Scores, score

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class Run:
    path: Path
    cfg: RecipeConfig
    weights_dir: Path  # the adapter (PEFT format) or a whole model (full fine-tuning, merged export)
    has_recipe: bool = True  # False: a bare model directory; cfg then holds defaults around model.path
    # recipe.yaml says model.trust_remote_code=true but the user did not pass --trust-remote-code:
    # cfg has it false, and the model loads without the code in its folder.
    remote_code_refused: bool = False

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


def _trusting(data: dict, trust_remote_code: bool) -> tuple[dict, bool]:
    """(recipe with model.trust_remote_code set to the user's choice, whether the recipe asked for true in vain).

    A run or export may come from anywhere; its recipe.yaml must not be able to make
    `finetune generate/eval/export` execute Python files that sit beside the model.
    """
    model = dict(data.get("model") or {})
    refused = bool(model.get("trust_remote_code")) and not trust_remote_code
    model["trust_remote_code"] = trust_remote_code
    return {**data, "model": model}, refused


def open_run(path: str | Path, allow_model_dir: bool = False, trust_remote_code: bool = False) -> Run:
    """The finished run (or adapter export) at `path`; RunDirError listing what is missing otherwise.

    allow_model_dir: also accept a standalone model directory (config.json + weights,
    e.g. a merged export); its recipe.yaml, when there is one, supplies data.format.
    trust_remote_code: the user's own opt-in to running code from the model's folder;
    the run's recipe.yaml setting is never obeyed (Run.remote_code_refused says it was set).
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
        data, refused = _trusting(data, trust_remote_code)
        # The weights are the whole model: nothing to quantize as in training, no adapter on top.
        model = {**data["model"], "path": str(path), "tokenizer": None, "revision": None}
        data.update(model=model, quant={"bits": None}, lora=None)
        cfg = build_recipe(data, source=str(path))
        return Run(path=path, cfg=cfg, weights_dir=path, has_recipe=has_recipe, remote_code_refused=refused)
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
    assert weights is not None  # (missing lists it otherwise)
    data, refused = _trusting(_read_recipe(path / "recipe.yaml"), trust_remote_code)
    cfg = build_recipe(data, source=str(path / "recipe.yaml"))
    return Run(path=path, cfg=cfg, weights_dir=weights, remote_code_refused=refused)


def remote_code_notice(run: Run) -> str | None:
    """One line saying that the run's recipe.yaml asked for trust_remote_code and was not obeyed; None if it did not."""
    if not run.remote_code_refused:
        return None
    return (
        f"note: {run.path / 'recipe.yaml'} sets model.trust_remote_code=true; not obeyed: code from the model folder "
        f"runs only when you pass --trust-remote-code (do so only if you trust '{model_source(run.cfg)}')"
    )


# Keys peft fills with its own defaults when they are missing (r=8, lora_alpha=8): an adapter
# config that lost them would load with the wrong rank and fail on its weights, or scale them wrongly.
ADAPTER_KEYS = {"peft_type": "the adapter type", "r": "the LoRA rank", "lora_alpha": "the LoRA alpha"}


def check_adapter_config(run: Run) -> None:
    """RunDirError when the run's adapter_config.json is not JSON or lacks a key the adapter cannot be loaded without."""
    path = run.weights_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(
            f"'{path}' is not valid JSON ({exc})",
            hint="the adapter is damaged: restore adapter_config.json from a copy of the run or its export",
        ) from None
    missing = [key for key in ADAPTER_KEYS if not isinstance(config, dict) or key not in config]
    if not missing:
        return
    from_recipe = {"peft_type": '"LORA"', **(peft_arguments(run.cfg) if run.cfg.lora else {})}
    fix = ", ".join(f'"{key}": {from_recipe[key]}' for key in missing if from_recipe.get(key) is not None)
    raise RunDirError(
        f"'{path}' lacks {', '.join(f'{key!r} ({ADAPTER_KEYS[key]})' for key in missing)}: the adapter cannot be loaded as trained",
        hint="restore adapter_config.json from a copy of the run or its export"
        + (f", or add {fix} (from the run's recipe.yaml)" if fix else ""),
    )


def inference_precision(cfg: RecipeConfig, device: torch.device | None = None) -> str:
    """The run's precision where `device` (default: this machine's) has it, else what it does have
    (e.g. a bf16 GPU run opened on a CPU)."""
    dev = cpu_device() if device is not None and device.type == "cpu" else None
    try:
        return resolve_precision(cfg.precision, dev)
    except HardwareError:
        return resolve_precision("auto", dev)


# --------------------------------------------------------------------------- loading on a device that may be too small


def exceeds_free_memory(needed: int, free: int | None, device_type: str) -> bool:
    """Whether loading `needed` bytes onto a device with `free` bytes must fail (the decision, kept pure for tests).

    Only a CUDA device is judged: a CPU's RAM is the fallback (--device cpu), where the
    OS pages and loaders stream; free None means the device did not say.
    """
    return device_type == "cuda" and free is not None and needed > free


def check_device_memory(cfg: RecipeConfig, precision: str, device: torch.device, what: str, fix: str) -> None:
    """HardwareError, before anything is loaded, when the weights of `cfg`'s model exceed what `device` has free."""
    if device.type != "cuda":
        return
    try:
        needed = loaded_weight_bytes(cfg, precision)
    except FinetuneError:  # the planner cannot read this model (offline hub id, custom code): loading says why
        return
    free = device_free_bytes(device)
    if free is not None and exceeds_free_memory(needed, free, device.type):
        raise HardwareError(
            f"{what} needs {human_bytes(needed)} on {device} for its weights alone ({precision}, "
            f"{f'{cfg.quant.bits}-bit' if cfg.quant.bits else 'unquantized'}), and {human_bytes(free)} is free there; nothing was loaded",
            hint=fix,
        )


CPU_FIX = "pass --device cpu to run it from CPU RAM instead (slower), or free memory on the GPU / use a larger one"


@contextmanager
def _remote_code_hint(run: Run):
    """A load that fails after the run's trust_remote_code was refused says how to opt in, not to edit the recipe
    (which already says true)."""
    try:
        yield
    except ModelError as exc:
        about_code = any("trust_remote_code" in text or "custom code" in text for text in (exc.message, exc.hint or ""))
        if not (run.remote_code_refused and about_code):
            raise
        raise ModelError(
            exc.message,
            hint=f"the model may need the code in its folder, which recipe.yaml asks for (model.trust_remote_code=true): "
            f"pass --trust-remote-code if you trust '{model_source(run.cfg)}'",
        ) from None


def _load(run: Run, cfg: RecipeConfig, precision: str, device: torch.device):
    check_device_memory(cfg, precision, device, f"the model of '{run.path}'", CPU_FIX)
    with _remote_code_hint(run):
        return load_base_model(cfg, precision=precision, device=device)


def run_tokenizer(run: Run):
    """The tokenizer saved with the run's weights (the one training used, chat template included)."""
    has_own = (run.weights_dir / "tokenizer_config.json").is_file()
    source = str(run.weights_dir) if has_own else run.cfg.model.tokenizer
    model = run.cfg.model.model_copy(update={"tokenizer": source})
    return load_tokenizer(run.cfg.model_copy(update={"model": model}))


def load_trained(run: Run, precision: str | None = None, device: torch.device | None = None):
    """(model, tokenizer) as the run left them, in eval mode: the base quantized as in training + the adapter."""
    from peft import PeftModel

    device = device or default_device()
    precision = precision or inference_precision(run.cfg, device)
    with _remote_code_hint(run):
        tokenizer = run_tokenizer(run)
    if run.is_adapter:
        check_adapter_config(run)
        base = _load(run, run.cfg, precision, device)
        model = PeftModel.from_pretrained(base, str(run.weights_dir))
    else:
        # Full fine-tuning saved every weight: load them unquantized, as they were trained.
        whole = run.cfg.model.model_copy(update={"path": str(run.weights_dir), "tokenizer": None})
        cfg = run.cfg.model_copy(update={"model": whole, "quant": run.cfg.quant.model_copy(update={"bits": None})})
        model = _load(run, cfg, precision, device)
    model.eval()
    model.config.use_cache = True  # load_base_model turns it off for training; generation wants it
    return model, tokenizer


def load_base(run: Run, precision: str | None = None, device: torch.device | None = None):
    """The run's base model as training loaded it (quantized per quant.bits), in eval mode."""
    device = device or default_device()
    model = _load(run, run.cfg, precision or inference_precision(run.cfg, device), device)
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
        return load_records(
            resolve_path(cfg.eval.exact_match_path), cfg.data, key="eval.exact_match_path"
        ), cfg.eval.exact_match_path
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
    run: Run,
    records: list[dict],
    source: str,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    device: torch.device | None = None,
) -> RunEval:
    """Loss, perplexity, exact and contains match of the base model and of the fine-tuned one, on the same records."""
    records = records[:limit] if limit else records
    cfg = run.cfg
    max_new = max_new_tokens or cfg.eval.max_new_tokens
    model, tokenizer = load_trained(run, device=device)
    examples, _ = build_examples(records, cfg, tokenizer, key=source)

    def scored(m) -> Scores:
        per_token = objectives.get(cfg.train.objective).per_token
        return score(m, tokenizer, records, examples, cfg.data.format, max_new, batch_size, per_token)

    tuned = scored(model)
    if run.is_adapter:
        with model.disable_adapter():  # the same weights in memory minus the adapter: the base as trained
            base = scored(model)
    else:
        del model
        base = scored(load_base(run, device=device))
    return RunEval(source=source, records=len(records), columns={"base": base, "fine-tuned": tuned})
