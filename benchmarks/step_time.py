"""python benchmarks/step_time.py [--steps 5] [recipe overrides ...]

Time one optimizer step (forward + backward + AdamW) of the demo recipe's model
and data, outside the trainer. Prints seconds per step and tokens per step.
Used for the thread-oversubscription table in benchmarks/README.md:
run it alone, with OMP_NUM_THREADS=1, and beside another training process.
"""

from __future__ import annotations

import argparse
import time

import torch

from finetune.config import load_recipe
from finetune.data import Collator, build_datasets
from finetune.model import load_model, load_tokenizer
from finetune.evaluate import loss_sum_and_count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipe", default="demo-cpu")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, ["output_dir=/tmp/step_time"] + args.overrides)
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok)
    model = load_model(cfg, "fp32", torch.device("cpu"))
    batch = Collator(tok.pad_token_id)(data.train[: cfg.train.batch_size])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    print(f"threads {torch.get_num_threads()}, batch {tuple(batch['input_ids'].shape)}")
    for i in range(args.steps):
        t0 = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, n = loss_sum_and_count(logits, batch["labels"])
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {i}: {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
