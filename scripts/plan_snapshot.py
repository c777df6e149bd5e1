"""Every shipped recipe's `finetune plan` output in one file (text, --gpus 2, --json, --max-seq, --fit with the recipe
it writes, on 4 model configs), the commands run in this one process: run before and after a refactor and `cmp` the two.

    python scripts/plan_snapshot.py OUT       # ~1 min on 2 cores; PYTHONPATH=<a worktree> for another commit
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

MODELS = ("qwen2.5-7b", "llama-3.1-8b", "llama-3-70b", "qwen3-30b-a3b")
ARGS = ("--gpu rtx4090", "--gpu rtx3060 --gpus 2", "--gpu rtx4090 --gpus 4 --json", "--gpu rtx4090 --max-seq")


def run(argv: list[str]) -> tuple[str, int]:
    """The command's stdout and stderr together, and its exit code (an exception's traceback counted as rc 1)."""
    from finetune.cli.commands import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return buffer.getvalue(), code


def main(out: str) -> None:
    import finetune

    out = os.path.abspath(out)
    os.chdir(Path(finetune.__file__).resolve().parent.parent)  # the checkout whose finetune runs: its recipes
    fit = Path(tempfile.mkdtemp()) / "fit.yaml"
    with open(out, "w") as sink:
        for recipe in sorted(Path("recipes").glob("*.yaml")):
            for model in MODELS:
                for args in (*ARGS, f"--gpu rtx4090 --gpus 2 --fit --out {fit} --force"):
                    sink.write(f"=== {recipe.stem} {model} {args.replace(str(fit), 'FIT')}\n")
                    argv = ["plan", str(recipe), f"model.path=tests/fixtures/configs/{model}", "data.path=x.jsonl", *args.split()]
                    text, code = run(argv)
                    sink.write(text.replace(str(fit), "FIT") + f"rc={code}\n")
                    if fit.exists():
                        sink.write(fit.read_text().replace(str(fit), "FIT"))
                        fit.unlink()


if __name__ == "__main__":
    main(sys.argv[1])
