"""Where metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, and a loss-curve PNG.

    report:
      tensorboard: true     # output_dir/tensorboard; `tensorboard --logdir output_dir`
      wandb: true           # project report.wandb_project, mode report.wandb_mode
      plot: true            # output_dir/loss.png at the end of the run

Each is an optional install (`pip install 'finetune[tensorboard]'`, `[wandb]`,
`[plot]`), imported only when asked for, behind one availability check. A sink
receives the same rows metrics.jsonl gets: train rows become train/<key>
scalars, eval rows (eval_loss) eval/loss, at the row's optimizer step.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.errors import ReportError
from finetune.metrics import read_metrics

# module -> the pip extra that installs it
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "matplotlib": "plot"}
PLOT_NAME = "loss.png"


def install_hint(module: str) -> str:
    return f"pip install 'finetune[{EXTRAS[module]}]'"


def installed(module: str) -> bool:
    """Whether `import module` can work, without importing it (W&B and matplotlib take seconds)."""
    if module in sys.modules:  # already imported, or blocked with None
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def plot_available() -> bool:
    return installed("matplotlib")


def missing_extras(cfg: RecipeConfig) -> list[str]:
    """report.* settings whose package is not installed, one message each (for `finetune validate`)."""
    wanted = {"tensorboard": cfg.report.tensorboard, "wandb": cfg.report.wandb}
    return [
        f"report.{key}=true needs the '{key}' package, which is not installed. Run {install_hint(key)} or set report.{key}=false."
        for key, on in wanted.items()
        if on and not installed(key)
    ]


def require_extras(cfg: RecipeConfig) -> None:
    """ReportError for the first report.* sink whose package is missing: checked before any weight is loaded."""
    problems = missing_extras(cfg)
    if problems:
        raise ReportError(" ".join(problems))


def _require(module: str, key: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ReportError(
            f"{key}=true but '{module}' is not installed", hint=f"{install_hint(module)}, or set {key}=false"
        ) from None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """{"train/loss": ..., "eval/loss": ...} from one metrics row; flags, step and missing values left out."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        _require("tensorboard", "report.tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package checked above

        # flush_secs: a crash loses at most this much; metrics.jsonl (flushed per row) has everything anyway.
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=30)

    def log(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: RecipeConfig, out: Path):
        wandb = _require("wandb", "report.wandb")
        self.run = wandb.init(
            project=cfg.report.wandb_project,
            name=Path(cfg.output_dir).name,
            dir=str(out),
            config=cfg.to_dict(),
            mode=cfg.report.wandb_mode,
        )

    def log(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        if values:
            self.run.log(values, step=row["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: RecipeConfig, out: Path) -> list:
    """The sinks report.* asks for, opened (ReportError with the install hint when a package is missing)."""
    sinks: list = []
    if cfg.report.tensorboard:
        sinks.append(TensorBoardSink(Path(out) / "tensorboard"))
    if cfg.report.wandb:
        os.makedirs(out, exist_ok=True)
        sinks.append(WandbSink(cfg, Path(out)))
    return sinks


def plot_curves(metrics_path: Path, png_path: Path, title: str = "") -> Path | None:
    """Train loss (and eval loss when logged) against step, as a PNG; None with a notice when matplotlib is absent."""
    if not plot_available():
        print(f"note: {png_path.name} skipped: matplotlib is not installed ({install_hint('matplotlib')})", flush=True)
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display on servers; Agg writes files only
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path) if Path(metrics_path).is_file() else []
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        if train:
            ax.plot(*zip(*train), label="train loss", linewidth=1.2)
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss", linewidth=1.2, markersize=4)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (mean per trained token)")
        ax.set_title(title or str(Path(metrics_path).parent.name))
        ax.grid(alpha=0.3)
        if train or evals:
            ax.legend()
        fig.tight_layout()
        tmp = png_path.with_name(f".tmp-{png_path.name}")
        fig.savefig(tmp, format="png")
        tmp.replace(png_path)  # a reader never sees half a PNG
    finally:
        plt.close(fig)
    return png_path
