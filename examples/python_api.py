"""python examples/python_api.py

Fine-tune from Python instead of the CLI: load a shipped recipe, override keys,
bring your own tokenizer/data if you like, and read the result.
"""

from finetune import Trainer, build_datasets, load_recipe, load_tokenizer, preflight

cfg = load_recipe("demo-cpu", ["output_dir=runs/example-api", "overwrite=true", "train.max_steps=60"])

report = preflight(cfg)  # every check short of loading weights
if not report.ok:
    raise SystemExit("\n".join(report.problems))

tokenizer = load_tokenizer(cfg)
data = build_datasets(cfg, tokenizer)  # tokenized + label-masked examples
print("train:", data.train_stats.summary())

result = Trainer(cfg, tokenizer=tokenizer, data=data).train()
print(f"final loss {result.final_loss:.4f}; adapter in {result.adapter_dir}")
if result.exact_match_after is not None:
    print(f"held-out exact match: {result.exact_match_after.summary()}")
