# Run with: python scripts/build_demo_pairs.py
"""Build finetune/assets/demo/pairs.jsonl: the preference set of the dpo-demo-cpu recipe.

Seeded and deterministic, from the same word-list skills as the SFT demo (scripts/build_assets.py):
each pair is an alpaca-style prompt (the text data.format=alpaca would render) whose two
responses hold the same right answer in two styles: `chosen` a full sentence ("the answer is
frog."), `rejected` the bare answer ("frog"). The bundled base model never saw the sentence
style and ranks the bare answer higher on (nearly) every pair; what DPO has to teach is the
style, for prompts and word lists it has not seen.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT))

from build_assets import ALPACA_WITH, ALPACA_WITHOUT, SKILLS, j, rand_list, skill_answer  # noqa: E402

from finetune.data.formats.alpaca import alpaca_prompt  # noqa: E402

SEED = 4321
N_PAIRS = 640


def pair(rng: random.Random) -> dict:
    skill = rng.choice(SKILLS)
    while True:
        lst = rand_list(rng)
        if skill not in ("reverse", "repeat") or lst != lst[::-1]:
            break
    if rng.random() < 0.3:
        record = {"instruction": rng.choice(ALPACA_WITHOUT[skill]).format(L=j(lst)), "input": ""}
    else:
        record = {"instruction": rng.choice(ALPACA_WITH[skill]), "input": j(lst)}
    answer = skill_answer(skill, lst, rng)[1]
    return {"prompt": alpaca_prompt(record), "chosen": f"the answer is {answer}.", "rejected": answer}


def main() -> int:
    rng = random.Random(SEED)
    out = REPO_ROOT / "finetune" / "assets" / "demo" / "pairs.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(N_PAIRS):
            f.write(json.dumps(pair(rng)) + "\n")
    print(f"wrote {N_PAIRS} pairs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
