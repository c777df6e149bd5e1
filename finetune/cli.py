"""Command line: finetune run | validate | ls | cp | export | generate | eval.

    finetune run recipes/demo-cpu.yaml                 # the CPU demo
    finetune run RECIPE model.path=Qwen/Qwen2.5-7B data.path=mine.jsonl train.lr=1e-4
    finetune validate RECIPE [key=value ...]           # every check short of loading weights
    finetune ls                                        # shipped recipes
    finetune cp qlora-1x24gb my.yaml                   # copy one to edit
    finetune export RUN_DIR --out DIR [--merge] [--dtype bf16|fp16|fp32] [--overwrite]
    finetune generate RUN_DIR|MODEL_DIR [--prompt TEXT [--input TEXT]] [--temperature T --top-p P --seed S]
    finetune eval RUN_DIR [--data FILE] [--limit N] [--json FILE]   # base vs fine-tuned, side by side

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


def cmd_export(args: argparse.Namespace) -> int:
    from finetune.export import export_run

    budget = None if args.verify_memory_gib is None else int(args.verify_memory_gib * 2**30)
    export_run(args.run_dir, args.out, merge=args.merge, dtype=args.dtype, overwrite=args.overwrite, verify_max_memory=budget)
    return EXIT_OK


def _prompts_from_stdin():
    """One prompt per line; with a terminal, an interactive '> ' prompt until EOF (Ctrl-D)."""
    if not sys.stdin.isatty():
        yield from (line.rstrip("\n") for line in sys.stdin if line.strip())
        return
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if line.strip():
            yield line


def cmd_generate(args: argparse.Namespace) -> int:
    from finetune.evaluate import generate, prompt_ids
    from finetune.runs import load_trained, open_run

    bad = [
        f"{flag} {value}: {rule}"
        for flag, value, ok, rule in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "must be at least 1"),
            ("--temperature", args.temperature, args.temperature >= 0, "must be 0 (greedy) or more"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1]"),
        )
        if not ok
    ]
    if bad:
        raise FinetuneError("; ".join(bad), hint="finetune generate --help lists the options")
    run = open_run(args.target, allow_model_dir=True)
    fmt = args.format or (run.cfg.data.format if run.has_recipe else "completion")
    if args.input and fmt != "alpaca":
        raise FinetuneError(f"--input is the alpaca prompt's input field; prompts here use data.format={fmt}", hint="drop --input")
    model, tokenizer = load_trained(run)
    mode = f"sampling (temperature {args.temperature}, top-p {args.top_p}, seed {args.seed})" if args.temperature > 0 else "greedy"
    print(f"{run.weights_dir}: prompts formatted as data.format={fmt}, {mode}", file=sys.stderr)
    for text in args.prompt if args.prompt else _prompts_from_stdin():
        ids = prompt_ids(text, fmt, tokenizer, context=args.input or "")
        out = generate(
            model, tokenizer, [ids], args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )[0]
        print(tokenizer.decode(out, skip_special_tokens=True), flush=True)
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from finetune.evaluate import comparison_table
    from finetune.runs import eval_records, evaluate_run, open_run

    run = open_run(args.run_dir)
    records, source = eval_records(run, args.data)
    result = evaluate_run(run, records, source, limit=args.limit, max_new_tokens=args.max_new_tokens)
    print(f"{run.path}: {result.records} records from {result.source} (data.format={run.cfg.data.format})")
    print(comparison_table(result.columns))
    if args.json:
        rows = {
            name: {
                "loss": s.loss, "perplexity": s.perplexity, "tokens": s.tokens,
                "exact_match": s.match.accuracy if s.match else None,
                "contains_match": s.match.contains_accuracy if s.match else None,
            }
            for name, s in result.columns.items()
        }
        Path(args.json).write_text(json.dumps({"source": result.source, "records": result.records, **rows}, indent=2) + "\n")
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

    ls = sub.add_parser("ls", help="list shipped recipes")
    ls.set_defaults(func=cmd_ls)

    cp = sub.add_parser("cp", help="copy a shipped recipe for editing")
    cp.add_argument("name")
    cp.add_argument("dest")
    cp.add_argument("--force", action="store_true", help="overwrite DEST")
    cp.set_defaults(func=cmd_cp)

    export = sub.add_parser("export", help="export a finished run: the adapter, or a merged model checked against it")
    export.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of a finished run")
    export.add_argument("--out", required=True, metavar="DIR", help="export directory (must be new or empty)")
    export.add_argument("--merge", action="store_true", help="merge the adapter into the base: a standalone model, verified")
    export.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="merged weights' dtype (default: the base's)")
    export.add_argument("--overwrite", action="store_true", help="replace a previous export at --out")
    export.add_argument(
        "--verify-memory-gib", type=float, metavar="GIB",
        help="RAM the merge check may load the merged model into; beyond it layers stream from disk (default: half of free RAM)",
    )
    export.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    export.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate from a run or model, with the training prompt format")
    gen.add_argument("target", metavar="RUN_DIR|MODEL_DIR", help="a finished run, an export, or a model directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable); without it, prompts are read from stdin")
    gen.add_argument("--input", help="alpaca only: the input field that goes with the instruction (--prompt)")
    gen.add_argument("--format", choices=["alpaca", "messages", "completion", "text"], help="prompt format (default: the run's data.format)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    gen.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="loss, perplexity, exact/contains match: base vs fine-tuned")
    ev.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of a finished run")
    ev.add_argument("--data", metavar="FILE", help="records in the run's data.format (default: the run's eval data)")
    ev.add_argument("--limit", type=int, help="score only the first N records")
    ev.add_argument("--max-new-tokens", type=int, help="answer length limit (default: the recipe's eval.max_new_tokens)")
    ev.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    ev.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    ev.set_defaults(func=cmd_eval)
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
