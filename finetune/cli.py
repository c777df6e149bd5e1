"""Command line: finetune run | validate | data | preprocess | ls | cp.

    finetune run recipes/demo-cpu.yaml                 # the CPU demo
    finetune run RECIPE model.path=Qwen/Qwen2.5-7B data.path=mine.jsonl train.lr=1e-4
    finetune validate RECIPE [key=value ...]           # every check short of loading weights
    finetune data RECIPE [--examples 3]                # examples with trained tokens marked, statistics
    finetune preprocess RECIPE                         # tokenize into the cache now; `run` then starts at once
    finetune ls                                        # shipped recipes
    finetune cp qlora-1x24gb my.yaml                   # copy one to edit

Exit codes: 0 success, 2 a problem with the input (message says what and how
to fix; --debug adds the traceback), 1 a bug (traceback), 75 preempted
(SIGTERM/SIGUSR1: a checkpoint was saved; rerun with resume=auto), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

from finetune.config import check_recipe_dict, find_recipe, read_recipe, recipe_description, shipped_recipes
from finetune.errors import FinetuneError, Preempted
from finetune.preflight import preflight

EXIT_OK, EXIT_BUG, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PREEMPTED = Preempted.exit_code  # 75: checkpoint saved after SIGTERM/SIGUSR1; rerun with resume=auto


def _quiet_libraries() -> None:
    """Library chatter (weight-loading bars, advisory warnings) hides our own output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        pass
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(peft|transformers|bitsandbytes|accelerate|torch)\b")
    warnings.filterwarnings("ignore", category=FutureWarning)


def _print_problems(title: str, problems: list[str]) -> None:
    print(f"{title}: {len(problems)} problem{'s' if len(problems) != 1 else ''}", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)


def check_all(args: argparse.Namespace):
    """Schema, cross-field and preflight problems of a recipe, all of them; None when there are any."""
    data, source = read_recipe(args.recipe, args.overrides)
    cfg, problems = check_recipe_dict(data, source)
    report = preflight(cfg) if cfg is not None else None
    if report is not None:
        for note in report.notes:
            print(f"note: {note}")
        problems += [p for p in report.problems if p not in problems]
    if problems:
        _print_problems(source, problems)
        return None, None
    return cfg, report


def cmd_validate(args: argparse.Namespace) -> int:
    cfg, report = check_all(args)
    if cfg is None:
        return EXIT_INPUT
    print(f"{find_recipe(args.recipe)}: valid (precision {report.precision})")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from finetune.trainer import Trainer

    cfg, report = check_all(args)
    if cfg is None:
        return EXIT_INPUT
    print(f"recipe {find_recipe(args.recipe)} -> {cfg.output_dir}")
    Trainer(cfg, tokenizer=report.tokenizer, progress=not args.no_progress).train()
    return EXIT_OK


def cmd_data(args: argparse.Namespace) -> int:
    """`data` and `preprocess`: build the tokenized data (through the cache), then describe it."""
    import time

    from finetune.data import build_datasets
    from finetune.data.cache import cache_root
    from finetune.data.show import report

    cfg, checked = check_all(args)
    if cfg is None:
        return EXIT_INPUT
    t0 = time.perf_counter()
    bundle = build_datasets(cfg, checked.tokenizer)
    took = time.perf_counter() - t0
    if args.command == "preprocess":
        how = "already in the cache" if bundle.from_cache else f"tokenized in {took:.1f}s"
        print(f"train: {bundle.train_stats.summary()}")
        if bundle.eval_stats is not None:
            print(f"eval: {bundle.eval_stats.summary()}")
        for line in bundle.train_stats.warnings:
            print(f"warning: {line}")
        where = f"cache {cache_root(cfg)}" if cfg.data.cache else "nothing cached (data.cache=false)"
        print(f"{how}; {where}. `finetune run {args.recipe}` with the same data settings starts training at once.")
        return EXIT_OK
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(report(bundle, checked.tokenizer, cfg.data.max_seq_len, examples=args.examples, color=color))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    recipes = shipped_recipes()
    width = max((len(n) for n in recipes), default=0)
    for name, path in recipes.items():
        print(f"{name:<{width}}  {recipe_description(path)}")
    print("\nrun one: finetune run NAME [key=value ...]; copy one to edit: finetune cp NAME my.yaml")
    return EXIT_OK


def cmd_cp(args: argparse.Namespace) -> int:
    recipes = shipped_recipes()
    name = Path(args.name).stem if args.name.endswith((".yaml", ".yml")) else args.name
    if name not in recipes:
        import difflib

        close = difflib.get_close_matches(name, list(recipes), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise FinetuneError(f"no shipped recipe named '{args.name}'. {hint}Run `finetune ls` to list them.")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / f"{name}.yaml"
    if dest.exists() and not args.force:
        raise FinetuneError(f"'{dest}' already exists; not overwriting it.", hint="choose another name or pass --force")
    shutil.copyfile(recipes[name], dest)
    print(f"copied {name} -> {dest}\nedit it, then: finetune run {dest}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Parameter-efficient fine-tuning (QLoRA) on the GPUs you own.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_recipe(p: argparse.ArgumentParser) -> None:
        p.add_argument("recipe", help="recipe YAML path or shipped recipe name (see `finetune ls`)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")

    run = sub.add_parser("run", help="train a recipe")
    with_recipe(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.jsonl)")
    run.set_defaults(func=cmd_run)

    val = sub.add_parser("validate", help="check a recipe without loading weights; lists every problem")
    with_recipe(val)
    val.set_defaults(func=cmd_validate)

    data = sub.add_parser("data", help="show tokenized examples (trained tokens marked) and dataset statistics")
    with_recipe(data)
    data.add_argument("--examples", type=int, default=3, help="how many examples to print (default 3)")
    data.set_defaults(func=cmd_data)

    pre = sub.add_parser("preprocess", help="tokenize a recipe's data into the cache ahead of training")
    with_recipe(pre)
    pre.set_defaults(func=cmd_data)

    ls = sub.add_parser("ls", help="list shipped recipes")
    ls.set_defaults(func=cmd_ls)

    cp = sub.add_parser("cp", help="copy a shipped recipe for editing")
    cp.add_argument("name")
    cp.add_argument("dest")
    cp.add_argument("--force", action="store_true", help="overwrite DEST")
    cp.set_defaults(func=cmd_cp)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # parse_intermixed_args does not support subparsers; overrides that follow an
    # option (`run R --no-progress a.b=c`) come back as extras and are kept here.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    _quiet_libraries()
    try:
        return args.func(args)
    except Preempted as exc:
        print(f"preempted: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    except FinetuneError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
