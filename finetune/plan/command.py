"""The `finetune plan` command: a recipe's memory and step time, its longest sequence (--max-seq),
or the fastest setup that fits, written as a recipe (--fit). Arguments come from cli/commands.py's parser.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from finetune.config.schema import read_recipe
from finetune.errors import FinetuneError


def plan_command(args: argparse.Namespace) -> int:
    """`finetune plan RECIPE --gpu NAME [--gpus N] [--json] [--max-seq | --fit --out FILE]`; returns the exit code."""
    import json

    from finetune.config.schema import build_recipe, parse_overrides
    from finetune.gpus import find_gpu, parse_bytes
    from finetune.plan import describe_setup, fit, gib, physical_ram, plan_recipe, report, write_fitted_recipe
    from finetune.plan.fitting import node_ram
    from finetune.plan.recipe import compare_strategies
    from finetune.plan.render import strategy_table

    data, source = read_recipe(args.recipe, args.overrides)
    cfg = build_recipe(data, source)  # planning needs no data file or output_dir: schema only
    gpu = find_gpu(args.gpu, args.gpu_mem)
    if args.nodes > 1:  # collectives and sends that span nodes go over the nodes' link
        if args.gpus % args.nodes:
            raise FinetuneError(
                f"--gpus {args.gpus} --nodes {args.nodes}: the GPUs must be the same number on each node",
                hint=f"give --gpus as the total, a multiple of {args.nodes}",
            )
        gpu = replace(gpu, gpus_per_node=args.gpus // args.nodes, node_link_gbps=args.node_link / 8)
    host_ram = parse_bytes(args.host_ram, "--host-ram") if args.host_ram else None
    if args.max_seq:
        return _print_longest_seq(args, cfg, gpu, host_ram)
    if not args.fit:
        est = plan_recipe(cfg, gpu, gpus=args.gpus)
        host_ok = host_ram is None or node_ram(est, gpu) <= host_ram  # per node, as --host-ram says
        strategies = compare_strategies(cfg, gpu, args.gpus) if args.gpus > 1 else []
        if args.json:
            side = {label: e.to_dict() for label, e in strategies}
            print(json.dumps({**est.to_dict(), "host_ram_fits": host_ok, **({"strategies": side} if side else {})}, indent=2))
        else:
            print(report(est))
            if strategies:
                print("\n" + strategy_table(strategies))
            if host_ram is not None:
                print(f"host RAM   {'enough' if host_ok else 'NOT enough'}: {gib(node_ram(est, gpu))} needed of {gib(host_ram)}")
            if not est.fits:
                print(f"\nfind a setup that fits: finetune plan {args.recipe} --gpu {args.gpu or 'custom'} --fit --out my.yaml")
        return 0

    if host_ram is None:
        # Offload trades GPU memory for host RAM; without a limit the search could pick a setup
        # that pins hundreds of GB. Plans are usually made on the machine that trains.
        host_ram = physical_ram()
        if host_ram is not None and not args.json:
            print(f"host RAM limit: {gib(host_ram)} (this machine's; --host-ram SIZE plans for another)")
    current, best = fit(cfg, gpu, max_gpus=args.gpus, host_ram=host_ram)  # offload that needs more RAM is left out
    out = Path(args.out or f"{Path(source).stem}-{best.setup.gpus}x{gpu.name}.yaml")
    if out.exists() and not args.force:
        raise FinetuneError(f"'{out}' already exists; not overwriting it.", hint="choose another --out or pass --force")
    invocation = f"finetune plan {args.recipe} --gpu {gpu.name} --gpus {args.gpus} --fit"
    fitted = write_fitted_recipe(Path(source), out, _flatten(parse_overrides(args.overrides)), current, best, invocation)
    changes, command = fitted.changes, fitted.command
    if args.json:
        print(
            json.dumps(
                {"current": current.to_dict(), "best": best.to_dict(), "changes": changes, "out": str(out), "command": command},
                indent=2,
            )
        )
        return 0
    print(
        f"as written: {describe_setup(current.setup)}: peak {gib(current.peak_bytes)} "
        f"({'fits' if current.fits else 'does not fit'}), ~{current.step_time_s:.1f} s/step"
    )
    print(f"fastest that fits: {describe_setup(best.setup)}\n")
    print(report(best))
    print(f"\nwrote {out} ({', '.join(f'{k}={v}' for k, v in changes.items()) or 'no changes needed'})\nrun it: {command}")
    return 0


def _print_longest_seq(args: argparse.Namespace, cfg, gpu, host_ram: int | None) -> int:
    """plan --max-seq: the longest sequence that trains at batch 1, as written and with the best settings."""
    import json

    from finetune.plan import describe_setup, longest_trainable_seq

    found = longest_trainable_seq(cfg, gpu, max_gpus=args.gpus, host_ram=host_ram)
    best = describe_setup(found.best_setup) if found.best_setup else "the recipe's own settings"
    if args.json:
        print(json.dumps({"gpu": gpu.name, "as_written": found.as_written, "best": found.best, "best_setup": best}, indent=2))
        return 0
    print(f"longest sequence at batch 1 on {args.gpus} x {gpu.name} (10% of the card kept free):")
    print(f"  as written    {found.as_written:>9,} tokens")
    print(f"  best settings {found.best:>9,} tokens  ({best})")
    return 0


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
