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

    Each row also goes to `sinks` (finetune.report: TensorBoard, W&B), objects with
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


_SHOWN = ("rewards/accuracy", "rewards/margin")  # of a step's extra metrics, the ones the bar shows


class Progress:
    """A tqdm bar on rank 0 showing loss, tokens/s and ETA; silent elsewhere."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, is_main: bool = True):
        self._bar = None
        self._is_main = is_main
        if enabled and is_main:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, loss: float, tokens_per_s: float, lr: float, extra: dict[str, float] | None = None) -> None:
        """extra: the loss's own metrics (preference: rewards/accuracy, rewards/margin) shown by their last part."""
        if self._bar is not None:
            shown = "".join(f" {k.rsplit('/', 1)[-1][:3]}={v:.3f}" for k, v in (extra or {}).items() if k in _SHOWN)
            self._bar.set_postfix_str(f"loss={loss:.4f}{shown} lr={lr:.2e} tok/s={tokens_per_s:,.0f}", refresh=False)
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
