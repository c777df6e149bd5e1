"""What a run reports: metrics.jsonl rows, the progress bar, throughput and peak memory."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak device memory on CUDA (allocator high-water mark), else peak process RSS."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl, flushed per row so a crash loses nothing logged.

    Each row also goes to `sinks` (finetune.runs.report: TensorBoard, W&B), objects with
    log(row) and close(). close() closes the file only (the trainer rewrites it on
    resume); finish() also closes the sinks, once, when the run ends.
    """

    def __init__(self, path: Path, enabled: bool = True, sinks: list | None = None):
        self.path = path
        self.enabled = enabled
        self.sinks = list(sinks or [])
        self._fh: TextIO | None = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()
        for sink in self.sinks:
            sink.log(clean)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def finish(self) -> None:
        self.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class Throughput:
    """Tokens per second over the run so far, excluding time spent in eval and checkpointing."""

    def __init__(self) -> None:
        self.tokens = 0
        self.trained_tokens = 0
        self.seconds = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int, trained_tokens: int) -> None:
        assert self._t0 is not None, "Throughput.stop() without start()"
        self.seconds += time.perf_counter() - self._t0
        self._t0 = None
        self.tokens += tokens
        self.trained_tokens += trained_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# Of a step's row, what the bar shows besides loss, lr and tokens/s, and how: the loss's own metrics
# (preference: rewards/accuracy, rewards/margin) after the loss, the model's FLOPs rate after tokens/s.
_SHOWN_LOSS = {"rewards/accuracy": "acc={:.3f}", "rewards/margin": "mar={:.3f}"}
_SHOWN_SPEED = {"tflops": "TFLOP/s={:.3g}", "mfu": "MFU={:.1%}"}


class Progress:
    """A tqdm bar on rank 0 showing loss, tokens/s, MFU and ETA; silent elsewhere."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, is_main: bool = True):
        self._bar = None
        self._is_main = is_main
        if enabled and is_main:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, loss: float, tokens_per_s: float, lr: float, extra: dict[str, Any] | None = None) -> None:
        """extra: the step's row, of which the keys of _SHOWN_LOSS and _SHOWN_SPEED are shown."""
        if self._bar is not None:
            row = extra or {}
            shown = "".join(" " + f.format(row[k]) for k, f in _SHOWN_LOSS.items() if row.get(k) is not None)
            speed = "".join(" " + f.format(row[k]) for k, f in _SHOWN_SPEED.items() if row.get(k) is not None)
            self._bar.set_postfix_str(f"loss={loss:.4f}{shown} lr={lr:.2e} tok/s={tokens_per_s:,.0f}{speed}", refresh=False)
            self._bar.update(1)

    def write(self, text: str) -> None:
        """A message that must not be lost: above the bar, or plainly when the bar is off."""
        if self._bar is not None:
            self._bar.write(text)
        elif self._is_main:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
