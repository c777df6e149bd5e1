# Run with: python scripts/build_grpo_demo.py
"""Build the prompt sets of the GRPO demo: finetune/assets/demo/prompts{,_eval}.jsonl.

Seeded and deterministic, no model needed.  Records are `{"prompt": ..., "answer": ...}`
for data.format=prompt (the prompt text is used as written; the model continues it).

The bundled tiny-llama (scripts/build_assets.py) was pretrained on plain sentences about
3-5 word lists, among them the two-line form "words: <list>\\nreversed: <reversed list>".
In that exact form it reverses unseen lists ~100% of the time, so there is nothing for RL
to climb.  The demo prompts keep the familiar "words: <list>\\n" line but end with cue
lines the corpus never had ("in reverse order:", "reversed order:", "copy again:",
"copied words:"): the base
has to guess which skill is asked for and answers right only part of the time (it echoes
the list, reverses it, or starts a different sentence), while its right answers are
exactly the skills it already has.  Rewarding those samples (GRPO) is what the demo shows.

Held out: every eval list is one of build_assets.py's held-out eval word sets, which the
pretraining corpus never contains (its `forbidden` sets); train lists never use those sets.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

# build_assets.py guards main(); importing it only defines word lists and helpers.
import build_assets as BA  # noqa: E402

SEED = 2468
N_TRAIN, N_EVAL = 600, 100
OUT = REPO_ROOT / "finetune" / "assets" / "demo"

# (cue line after "words: <list>\n", answer from the list).  Novel cues for known skills.
FORMS = [
    ("in reverse order:", lambda lst: BA.j(lst[::-1])),
    ("reversed order:", lambda lst: BA.j(lst[::-1])),
    ("copy again:", lambda lst: BA.j(lst)),
    ("copied words:", lambda lst: BA.j(lst)),
]


def record(lst: list[str], form: int) -> dict:
    cue, answer = FORMS[form]
    return {"prompt": f"words: {BA.j(lst)}\n{cue}", "answer": answer(lst)}


def heldout_sets() -> list[list[str]]:
    """build_assets.py's held-out eval lists, replayed from its seed (the same calls in the
    same order as its main(): build_datasets is the first user of the rng)."""
    rng = random.Random(BA.SEED)
    eval_sets: set[frozenset] = set()
    lists = []
    for i in range(150):  # build_datasets(rng, n_train=2000, n_eval=150): its eval loop
        lst = BA.rand_list(rng, eval_sets)
        eval_sets.add(frozenset(lst))
        lists.append(lst)
        BA.alpaca_example(rng, BA.SKILLS[i % len(BA.SKILLS)], lst)  # consume the rng as it does
    return lists


def main() -> int:
    held = heldout_sets()
    # Cross-check the replay against build_assets' own function.
    _, _, eval_sets = BA.build_datasets(random.Random(BA.SEED), n_train=2000, n_eval=150)
    assert {frozenset(x) for x in held} == eval_sets

    rng = random.Random(SEED)
    eval_lists = rng.sample(held, N_EVAL)
    eval_rows = [record(lst, i % len(FORMS)) for i, lst in enumerate(eval_lists)]

    train_rows = []
    for i in range(N_TRAIN):
        lst = BA.rand_list(rng, eval_sets)  # never one of the held-out word sets
        train_rows.append(record(lst, i % len(FORMS)))
    rng.shuffle(train_rows)
    rng.shuffle(eval_rows)

    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("prompts.jsonl", train_rows), ("prompts_eval.jsonl", eval_rows)):
        with open(OUT / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {len(rows)} records to {OUT / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
