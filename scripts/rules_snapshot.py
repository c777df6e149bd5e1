"""Every combination of the distributed keys (with a few other keys they rule on): the recipe's problems, one
JSON line each. Run before and after a refactor of the rules and `cmp` the two (issue 46: every refusal identical).

    python scripts/rules_snapshot.py > after.txt      # seconds; PYTHONPATH=<a worktree> for another commit
"""

from __future__ import annotations

import itertools
import json

from finetune.config.schema import check_recipe_dict

BASE = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "out"}
AXES = {
    "strategy": ["auto", "ddp", "fsdp", "deepspeed"],
    "zero_stage": [2, 3],
    "pipeline_parallel": [1, 2],
    "tensor_parallel": [1, 2],
    "context_parallel": [1, 2],
    "grad_compression": ["none", "bf16", "powersgd"],
    "cpu_offload": [False, True],
}
OTHERS = (
    {},
    {"lora": None},
    {"precision": "fp16"},
    {"train": {"objective": "dpo"}},
    {"memory": {"base_weights": "cpu"}},
    {"quant": {"bits": 8}},
    {"data": {"path": "d.jsonl", "packing": False}},
)

for values in itertools.product(*AXES.values()):
    distributed = dict(zip(AXES, values))
    for other in OTHERS:
        _, problems = check_recipe_dict({**BASE, **other, "distributed": distributed})
        print(json.dumps({"in": [distributed, other], "problems": problems}, sort_keys=True))
