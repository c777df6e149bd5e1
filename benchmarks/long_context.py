"""What memory.loss saves on one long sequence: whole logits vs the chunked head and loss
(and, with memory.activation_offload, the checkpointed layers' inputs parked in host RAM).

    python benchmarks/long_context.py                          # CPU: vocab 128,256 (Llama 3), 4,096 tokens
    python benchmarks/long_context.py --seq 16384 --hidden 4096 --layers 2 --precision bf16   # a GPU

A Llama-shaped model with random weights and Llama 3's vocabulary size trains on
one sequence whose every token is a target (the worst case for the logits),
through Trainer.from_parts (already-tokenized examples), once per memory.loss mode,
each in a fresh process so peaks do not mix. Reports the median step time and the
peak memory of training: RssAnon on a CPU (sampled every 2 ms, over the figure right
after setup), torch.cuda.max_memory_allocated on a GPU. The loss of the first step
is printed too: the modes must agree. Numbers in benchmarks/README.md.

chunked+offload parks each checkpointed layer's input in pinned host RAM (the first
layer's is the embeddings' output, which autograd holds: use --layers 2 or more). On a
CPU there is no other memory to move to: it only counts the bytes (parked MiB/step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import PeakSampler, mib, rss_anon  # noqa: E402  (this folder's shared memory sampler)

# memory.* of each mode, on top of activation_checkpointing all and loss_chunk
MODES = {
    "full": {"loss": "full"},
    "chunked": {"loss": "chunked"},
    "chunked+offload": {"loss": "chunked", "activation_offload": True},
}


def child(args) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.config.schema import resolve_path
    from finetune.trainer import Trainer

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))  # only its pad id is used
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 256, 1),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.seq,), generator=generator).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    trainer = Trainer.from_parts(
        model,
        tokenizer,
        examples,
        output_dir=args.out_dir,
        overwrite=True,
        progress=False,
        precision=args.precision,
        seed=0,
        data={"max_seq_len": args.seq, "shuffle": False},
        lora={"r": 16, "alpha": 32, "dropout": 0.0},
        train={"max_steps": args.steps, "batch_size": 1, "grad_accum": 1},
        memory={"activation_checkpointing": "all", "loss_chunk": args.chunk, **MODES[args.mode]},
        checkpoint={"every_steps": None},
        report={"plot": False},
    )
    trainer.setup()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = rss_anon()
    times, losses = [], []
    with PeakSampler() as train:
        trainer.model.train()
        for step in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            totals = trainer.accumulate_gradients(step)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(totals.loss_sum / totals.units)
    trainer.close()
    offload = trainer.memory.activations
    return {
        "mode": args.mode,
        "parked_bytes_per_step": getattr(offload, "checkpoint_bytes", 0) // args.steps,
        "step_s_median": statistics.median(times[1:] or times),
        "first_loss": losses[0],
        "rss_anon_after_setup": base,
        "rss_anon_train_peak": train.peak,
        "cuda_peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "logits_bytes_whole": args.seq * args.vocab * 4,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256, help="memory.loss_chunk")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--child", dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="finetune-long-context-") as work:
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--out-dir", str(Path(work) / mode)]
            cmd += [
                f"--{k}={v}"
                for k, v in vars(args).items()
                if k in ("vocab", "hidden", "layers", "seq", "chunk", "precision", "steps")
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if done.returncode != 0:
                sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"vocab {args.vocab:,}, seq {args.seq:,} (every token a target), hidden {args.hidden}, {args.layers} layer(s), "
        f"{args.precision}; whole fp32 logits {mib(args.seq * args.vocab * 4)} MiB; chunk {args.chunk}"
    )
    print(
        f"{'mode':16} {'step s':>8} {'first loss':>11} {'RssAnon train peak - after setup, MiB':>39} "
        f"{'CUDA peak MiB':>14} {'parked MiB/step':>16}"
    )
    for r in results:
        print(
            f"{r['mode']:16} {r['step_s_median']:8.3f} {r['first_loss']:11.5f} "
            f"{mib(r['rss_anon_train_peak'] - r['rss_anon_after_setup']):>39} {mib(r['cuda_peak_allocated']):>14} "
            f"{mib(r['parked_bytes_per_step']):>16}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
