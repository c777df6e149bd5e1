"""Command line: finetune run | validate | data | preprocess | plan | export | generate | eval | ls | cp.

    finetune run recipes/demo-cpu.yaml                 # the CPU demo
    finetune run RECIPE model.path=Qwen/Qwen2.5-7B data.path=mine.jsonl train.lr=1e-4
    finetune run RECIPE --nproc 4 [--max-restarts 2]   # 4 processes (GPUs) via torchrun; DDP or FSDP per distributed.*
    finetune validate RECIPE [key=value ...]           # every check short of loading weights
    finetune data RECIPE [--examples 3]                # examples with trained tokens marked, statistics
    finetune preprocess RECIPE                         # tokenize into the cache now; `run` then starts at once
    finetune plan RECIPE --gpu rtx4090 [--gpus 2] [--json] [--fit --out my.yaml]   # memory before weights
    finetune ls                                        # shipped recipes
    finetune cp qlora-1x24gb my.yaml                   # copy one to edit
    finetune export RUN_DIR --out DIR [--merge] [--dtype bf16|fp16|fp32] [--overwrite]
    finetune export RUN_DIR --out DIR --gguf [--gguf-type f16|bf16|q8_0|f32]
    finetune generate RUN_DIR|MODEL_DIR [--prompt TEXT [--input TEXT]] [--temperature T --top-p P --seed S]
    finetune eval RUN_DIR [--data FILE] [--limit N] [--json FILE]   # base vs fine-tuned, side by side (grpo: rewards)
    (export, generate, eval: --device cpu|cuda[:N]; --trust-remote-code runs code from the model's folder)

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

from finetune.cli.finished import cmd_eval, cmd_export, cmd_generate
from finetune.config.schema import check_recipe_dict, find_recipe, read_recipe, recipe_description, shipped_recipes
from finetune.data import FORMATS
from finetune.declarations.layout import Layout
from finetune.errors import ConfigError, FinetuneError, Preempted
from finetune.parallel.launch import (
    add_launch_arguments,
    elastic,
    launch_command,
    launch_env,
    mark_exit,
    restarts,
    run_launcher,
    stale_build_locks,
)
from finetune.runs.preflight import preflight

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


def check_all(args: argparse.Namespace, training: bool = True):
    """Schema, cross-field and preflight problems of a recipe, all of them; None when there are any.

    training=False (data, preprocess) skips what only a training run needs: output_dir and memory.
    """
    data, source = read_recipe(args.recipe, args.overrides)
    cfg, problems = check_recipe_dict(data, source)
    memory_check = not getattr(args, "skip_memory_check", False)
    report = preflight(cfg, memory_check=memory_check, training=training) if cfg is not None else None
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

    low, high = args.nnodes  # MIN:MAX for an elastic job (parallel/launch.py)
    launching = args.nproc > 1 or high > 1 or restarts(args) > 0
    if launching and "LOCAL_RANK" in os.environ:
        raise FinetuneError(
            "--nproc/--nnodes/--max-restarts were given to a process that torchrun/accelerate already launched",
            hint="either launch with `finetune run RECIPE --nproc N` or with `torchrun ... -m finetune run RECIPE`, not both",
        )
    if args.profile:  # an override, so the launched processes get it too
        args.overrides = [*args.overrides, f"profile.steps={args.profile}"]
    if restarts(args) > 0 and not any(o.split("=", 1)[0].strip() == "resume" for o in args.overrides):
        # A restarted worker must continue from the last checkpoint, not start over or refuse the output_dir.
        args.overrides = [*args.overrides, "resume=auto"]
    cfg, report = check_all(args)
    if cfg is None:
        return EXIT_INPUT
    from finetune.parallel.distribute import vision_problems
    from finetune.parallel.split_checks import split_problems
    from finetune.trainer.order import elastic_problems

    if launching or "WORLD_SIZE" not in os.environ:  # said once here, not by each process (torchrun's asked below)
        worlds = [args.nproc * n for n in range(low, high + 1)]  # an elastic job may restart on any of them
        problems = list(dict.fromkeys(p for w in worlds for p in split_problems(cfg, w) + vision_problems(cfg, w)))
        if elastic(args) and not problems:
            problems = elastic_problems(cfg, [Layout.of(cfg, 0, w).replicas for w in worlds])
        if problems:
            raise ConfigError(problems, str(find_recipe(args.recipe)))
    if launching:
        for warning in stale_build_locks():
            print(warning, file=sys.stderr)
        cmd = launch_command(args)
        print(
            f"launching {args.nproc} process{'es' if args.nproc > 1 else ''} x {f'{low} to {high}' if elastic(args) else high} "
            f"node(s): {' '.join(cmd[2:])}",
            flush=True,
        )
        return run_launcher(cmd, launch_env(args))
    print(f"recipe {find_recipe(args.recipe)} -> {cfg.output_dir}")
    from finetune.objectives.rewards import load_reward_file

    reward_fns = load_reward_file(args.rewards) if args.rewards else ()
    trainer = Trainer(cfg, tokenizer=report.tokenizer, progress=not args.no_progress, reward_fns=reward_fns)
    try:
        trainer.train()
    finally:
        trainer.close()
    return EXIT_OK


def cmd_data(args: argparse.Namespace) -> int:
    """`data` and `preprocess`: build the tokenized data (through the cache), then describe it."""
    import time

    from finetune.data import build_datasets
    from finetune.data.cache import cache_root
    from finetune.data.show import report

    cfg, checked = check_all(args, training=False)
    if cfg is None:
        return EXIT_INPUT
    tokenizer = checked.tokenizer
    if tokenizer is None:  # a hub model: preflight does not fetch, but showing tokens needs its tokenizer
        from finetune.model.load import load_tokenizer

        tokenizer = load_tokenizer(cfg)
    if args.command == "data" and cfg.data.mask_check == "error":
        # Show the examples a failing mask check is about instead of stopping before them.
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"mask_check": "warn"})})
    t0 = time.perf_counter()
    bundle = build_datasets(cfg, tokenizer)
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
    print(report(bundle, tokenizer, cfg.data.max_seq_len, examples=args.examples, color=color))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from finetune.plan.command import plan_command

    return plan_command(args)


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


def _loads_a_run(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code from the model's folder (custom architectures); only for sources you trust. "
        "A run's recipe.yaml cannot switch this on",
    )
    p.add_argument("--device", help="where the model runs: cuda, cuda:N or cpu (default: the first GPU, else the CPU)")


def _with_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML path or shipped recipe name (see `finetune ls`)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _add_recipe_commands(sub) -> None:
    """run, validate, data, preprocess, plan, ls, cp: commands that read a recipe (or list them)."""
    run = sub.add_parser("run", help="train a recipe")
    _with_recipe(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.jsonl)")
    run.add_argument(
        "--skip-memory-check", action="store_true", help="run even when the planner predicts the GPU runs out of memory"
    )
    run.add_argument(
        "--profile", metavar="STEPS", help="record optimizer steps with torch.profiler, e.g. 5-7 (= profile.steps=5-7)"
    )
    run.add_argument(
        "--rewards", metavar="FILE.py", help="grpo: your rewards (REWARDS = [...] or reward_* functions); recipes never name code"
    )
    add_launch_arguments(run)
    run.set_defaults(func=cmd_run)

    val = sub.add_parser("validate", help="check a recipe without loading weights; lists every problem")
    _with_recipe(val)
    val.add_argument("--skip-memory-check", action="store_true", help="report a predicted out-of-memory as a note, not a problem")
    val.set_defaults(func=cmd_validate)

    data = sub.add_parser("data", help="show tokenized examples (trained tokens marked) and dataset statistics")
    _with_recipe(data)
    data.add_argument("--examples", type=int, default=3, help="how many examples to print (default 3)")
    data.set_defaults(func=cmd_data)

    pre = sub.add_parser("preprocess", help="tokenize a recipe's data into the cache ahead of training")
    _with_recipe(pre)
    pre.set_defaults(func=cmd_data)
    plan = sub.add_parser(
        "plan", help="predict per-GPU memory and step time before loading weights; --fit writes a recipe that fits"
    )
    _with_recipe(plan)
    plan.add_argument(
        "--gpu",
        help="GPU name (rtx3060, rtx3090, rtx4090, a10g, l4, a6000, l40s, a100-40gb, a100-80gb, h100, h100-pcie, h200, t4)",
    )
    plan.add_argument("--gpu-mem", help="memory per GPU, e.g. 11GB (any other card, or to override the catalogue)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs available (the search may use fewer); default 1")
    plan.add_argument("--nodes", type=int, default=1, help="nodes holding the GPUs, as many on each (default 1)")
    plan.add_argument("--node-link", type=float, default=10.0, help="Gbit/s between nodes (default 10: Ethernet)")
    plan.add_argument("--host-ram", help="host RAM per node, e.g. 64GB: --fit leaves out setups that need more")
    plan.add_argument("--json", action="store_true", help="print one JSON object (every component in bytes)")
    plan.add_argument(
        "--max-seq",
        action="store_true",
        help="the longest sequence that trains at batch 1: as written, and with the best settings the search finds",
    )
    plan.add_argument(
        "--fit",
        action="store_true",
        help="search batch/accumulation/checkpointing/GPUs for the fastest setup that fits and write it",
    )
    plan.add_argument("--out", help="recipe file --fit writes (default RECIPE-NxGPU.yaml here)")
    plan.add_argument("--force", action="store_true", help="overwrite --out")
    plan.set_defaults(func=cmd_plan)

    ls = sub.add_parser("ls", help="list shipped recipes")
    ls.set_defaults(func=cmd_ls)

    cp = sub.add_parser("cp", help="copy a shipped recipe for editing")
    cp.add_argument("name")
    cp.add_argument("dest")
    cp.add_argument("--force", action="store_true", help="overwrite DEST")
    cp.set_defaults(func=cmd_cp)


def _add_finished_run_commands(sub) -> None:
    """export, generate, eval: commands that use a finished run."""
    export = sub.add_parser("export", help="export a finished run: the adapter, or a merged model checked against it")
    export.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of a finished run")
    export.add_argument("--out", required=True, metavar="DIR", help="export directory (must be new or empty)")
    export.add_argument("--merge", action="store_true", help="merge the adapter into the base: a standalone model, verified")
    export.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="merged weights' dtype (default: the base's)")
    export.add_argument("--overwrite", action="store_true", help="replace a previous export at --out")
    export.add_argument("--gguf", action="store_true", help="one GGUF file (llama.cpp, Ollama) of the merged model, verified")
    export.add_argument(
        "--gguf-type", choices=["f16", "bf16", "q8_0", "f32"], default="f16", help="GGUF weights' type (default f16)"
    )
    export.add_argument(
        "--verify-memory-gib",
        type=float,
        metavar="GIB",
        help="RAM the merge check may load the merged model into; beyond it layers stream from disk (default: half of free RAM)",
    )
    _loads_a_run(export)
    export.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    export.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate from a run or model, with the training prompt format")
    gen.add_argument("target", metavar="RUN_DIR|MODEL_DIR", help="a finished run, an export, or a model directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable); without it, prompts are read from stdin")
    with_context = ", ".join(f"{f.name}: its '{f.context}' field" for f in FORMATS.values() if f.context)
    gen.add_argument("--input", help=f"what goes with the --prompt text, for formats that take it ({with_context})")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image before the prompt's text (vision-language models; repeatable)",
    )
    gen.add_argument("--format", choices=list(FORMATS), help="prompt format (default: the run's data.format)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    _loads_a_run(gen)
    gen.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="loss, perplexity, exact/contains match (grpo: rewards): base vs fine-tuned")
    ev.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of a finished run")
    ev.add_argument("--data", metavar="FILE", help="records in the run's data.format (default: the run's eval data)")
    ev.add_argument("--limit", type=int, help="score only the first N records")
    ev.add_argument(
        "--max-new-tokens",
        type=int,
        help="answer length limit (default: the recipe's eval.max_new_tokens; grpo: train.max_new_tokens)",
    )
    ev.add_argument("--rewards", metavar="FILE.py", help="a grpo run: your own rewards too (as `finetune run --rewards`)")
    ev.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    _loads_a_run(ev)
    ev.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    ev.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Parameter-efficient fine-tuning (QLoRA) on the GPUs you own.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_recipe_commands(sub)
    _add_finished_run_commands(sub)
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
    code = 1  # an exception of another kind: Python's own exit code, with its traceback
    try:
        code = args.func(args)
    except Preempted as exc:
        print(f"{exc.label}: {exc}", file=sys.stderr)
        code = EXIT_PREEMPTED
    except FinetuneError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    finally:
        mark_exit(code)  # a worker of `finetune run --nproc`: how it ended, for the launcher
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
