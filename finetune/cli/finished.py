"""The commands on a finished run: export, generate, eval (finetune/cli/commands.py builds their parsers).

Each loads what the run wrote (finetune/runs/open.py): its recipe, its tokenizer, its model as trained;
--device picks where, and --trust-remote-code (the user's flag, never a recipe's) runs code from the
model's folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.data import FORMATS, get_format
from finetune.errors import FinetuneError

EXIT_OK = 0


def _device(args: argparse.Namespace):
    """--device as a torch.device (None: the default, the first GPU else the CPU); HardwareError when it cannot be used."""
    if args.device is None:
        return None
    import torch

    from finetune.errors import HardwareError

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise HardwareError(f"--device {args.device}: not a device these commands run on", hint="use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HardwareError(
            f"--device {args.device}: this machine has no CUDA GPU", hint="use --device cpu, or leave --device out"
        )
    return device


def _say_remote_code_notice(run) -> None:
    from finetune.runs.open import remote_code_notice

    notice = remote_code_notice(run)
    if notice:
        print(notice, file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    from finetune.export.run import export_run

    if args.gguf:
        return _export_gguf(args)
    budget = None if args.verify_memory_gib is None else int(args.verify_memory_gib * 2**30)
    export_run(
        args.run_dir,
        args.out,
        merge=args.merge,
        dtype=args.dtype,
        overwrite=args.overwrite,
        verify_max_memory=budget,
        device=_device(args),
        trust_remote_code=args.trust_remote_code,
    )
    return EXIT_OK


def _export_gguf(args: argparse.Namespace) -> int:
    from finetune.export.gguf_export import export_gguf

    given = [flag for flag, on in (("--merge", args.merge), ("--dtype", args.dtype is not None)) if on]
    if given:
        raise FinetuneError(
            f"--gguf with {' and '.join(given)}: a GGUF export always merges, in the type --gguf-type names",
            hint=f"drop {' and '.join(given)}",
        )
    export_gguf(
        args.run_dir,
        args.out,
        gguf_type=args.gguf_type,
        overwrite=args.overwrite,
        device=_device(args),
        trust_remote_code=args.trust_remote_code,
    )
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
    from finetune.runs.evaluate import generate, prompt_ids
    from finetune.runs.open import load_trained, open_run

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
    device = _device(args)
    run = open_run(args.target, allow_model_dir=True, trust_remote_code=args.trust_remote_code)
    fmt = args.format or (run.cfg.data.format if run.has_recipe else "completion")
    if args.input and get_format(fmt).context is None:
        has = [f"{f.name} ({f.context})" for f in FORMATS.values() if f.context]
        raise FinetuneError(
            f"--input fills a prompt field that data.format={fmt} has none of",
            hint=f"drop --input (formats with one: {', '.join(has)})",
        )
    _say_remote_code_notice(run)
    model, tokenizer = load_trained(run, device=device)
    mode = (
        f"sampling (temperature {args.temperature}, top-p {args.top_p}, seed {args.seed})" if args.temperature > 0 else "greedy"
    )
    print(f"{run.weights_dir}: prompts formatted as data.format={fmt}, {mode}", file=sys.stderr)
    images = [str(Path(p).expanduser().resolve()) for p in args.image]
    for text in args.prompt if args.prompt else _prompts_from_stdin():
        ids = prompt_ids(text, fmt, tokenizer, context=args.input or "", images=images)
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
        out = generate(model, tokenizer, [ids], args.max_new_tokens, images=[images], **sampling)[0]
        print(tokenizer.decode(out, skip_special_tokens=True), flush=True)
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from finetune.runs.evaluate import comparison_table
    from finetune.runs.open import eval_records, evaluate_run, open_run

    device = _device(args)
    run = open_run(args.run_dir, trust_remote_code=args.trust_remote_code)
    records, source = eval_records(run, args.data)
    _say_remote_code_notice(run)
    if run.cfg.data.format == "prompt":  # a grpo run: its rewards of greedy completions
        return _eval_rewards(args, run, records, source, device)
    if args.rewards:
        raise FinetuneError(f"--rewards: {run.path} is not a grpo run (data.format={run.cfg.data.format})", hint="drop --rewards")
    result = evaluate_run(run, records, source, limit=args.limit, max_new_tokens=args.max_new_tokens, device=device)
    print(f"{run.path}: {result.records} records from {result.source} (data.format={run.cfg.data.format})")
    print(comparison_table(result.columns))
    if args.json:
        rows = {
            name: {
                "loss": s.loss,
                "perplexity": s.perplexity,
                "tokens": s.tokens,
                "exact_match": s.match.accuracy if s.match else None,
                "contains_match": s.match.contains_accuracy if s.match else None,
            }
            for name, s in result.columns.items()
        }
        Path(args.json).write_text(json.dumps({"source": result.source, "records": result.records, **rows}, indent=2) + "\n")
    return EXIT_OK


def _eval_rewards(args: argparse.Namespace, run, records: list[dict], source: str, device) -> int:
    """`finetune eval` of a grpo run: the base and the fine-tuned model's rewards, side by side."""
    import json

    from finetune.objectives.rewards import load_reward_file
    from finetune.trainer.held_out import reward_table, run_rewards, trained_rewards_missing

    fns = load_reward_file(args.rewards) if args.rewards else ()
    columns = run_rewards(run, records, source, fns, args.limit, args.max_new_tokens, device=device)
    missing = trained_rewards_missing(run.path, columns["base"])
    if missing:
        print(
            f"note: the run also trained on {', '.join(missing)}, not in its recipe (your own rewards): "
            "pass the file again with --rewards FILE.py to score them",
            file=sys.stderr,
        )
    n = min(len(records), args.limit or len(records))
    print(f"{run.path}: {n} prompts from {source}, one greedy completion each")
    print(reward_table(columns))
    if args.json:
        Path(args.json).write_text(json.dumps({"source": source, "records": n, **columns}, indent=2) + "\n")
    return EXIT_OK
