# Run with: .venv/bin/python scripts/probe_grpo_demo.py [--file finetune/assets/demo/prompts_eval.jsonl]
"""Probe the bundled tiny-llama base on pretraining-style prompts, for the GRPO demo.

Without --file: tries a grid of candidate prompt forms (reverse / repeat / first / last /
count, several phrasings, list lengths 3-7) on word lists the pretraining corpus never
contained, and prints one row per (form, length).  With --file: scores a prompts jsonl
(`{"prompt", "answer"}` records) such as finetune/assets/demo/prompts_eval.jsonl.

Scoring (what the GRPO reward should mirror):
  * generation: BOS + prompt (tokenizer(prompt) adds BOS), max_new_tokens tokens, stopped at
    EOS (</s>); decoded with skip_special_tokens.
  * answer extraction: `cut(c)` = the completion up to (not including) its first '.' or
    newline, whitespace-stripped.  "exact" = cut(c) == answer.
  * "contains" = answer in the whole (uncut) completion, as the `contains` reward would see it.
  * "raw" = completion.strip() == answer (no cutting), i.e. what an uncut exact_match sees.
  * greedy: do_sample=False; sampled: temperature 1.0, top_p 1, top_k 0, --samples per prompt.

What the grid showed (40 unseen lists per cell): the pretraining forms are at ~90-100% for
3-5 words (first/last also for 6-7) and 0% for reverse/repeat/count of 6-7 words (the base
never writes more than 5 words, so no sample ever earns a reward); most novel sentence cues
are ~0%.  Cue lines after "words: <list>\n" that the corpus never had land in between, which
is what scripts/build_grpo_demo.py uses.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import build_assets as BA  # noqa: E402  (main() is guarded; importing has no side effects)

MODEL_DIR = REPO_ROOT / "finetune" / "assets" / "tiny-llama"


def cut(c: str) -> str:
    """The answer part of a completion: up to its first '.' or newline, stripped."""
    c = c.lstrip()
    for i, ch in enumerate(c):
        if ch in ".\n":
            return c[:i].strip()
    return c.strip()


def load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model.eval()
    return model, tok


@torch.no_grad()
def complete(model, tok, prompts, n: int, sample: bool, max_new_tokens: int, seed: int = 0):
    """n completions per prompt (decoded strings, cut at EOS) plus whether each ended on EOS."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(do_sample=False)
    if sample:
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        torch.manual_seed(seed)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        num_return_sequences=n,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **kw,
    )
    rows = out[:, enc["input_ids"].shape[1] :].tolist()
    texts, eos = [], []
    for r in rows:
        k = next((i for i, t in enumerate(r) if t in (tok.eos_token_id, tok.pad_token_id)), len(r))
        eos.append(k < len(r) and r[k] == tok.eos_token_id)
        texts.append(tok.decode(r[:k], skip_special_tokens=True))
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))], [eos[i * n : (i + 1) * n] for i in range(len(prompts))]


def score(model, tok, recs, samples: int, max_new_tokens: int, bs: int = 50, show: int = 0):
    g_ex = g_co = g_raw = s_ex = s_co = 0
    n_eos_after = n_period = 0
    pass_any = 0
    for b in range(0, len(recs), bs):
        chunk = recs[b : b + bs]
        prompts = [r["prompt"] for r in chunk]
        greedy, geos = complete(model, tok, prompts, 1, False, max_new_tokens)
        sampled, _ = complete(model, tok, prompts, samples, True, max_new_tokens, seed=b)
        for r, gl, el, sl in zip(chunk, greedy, geos, sampled):
            a, g = r["answer"], gl[0]
            g_ex += cut(g) == a
            g_co += a in g
            g_raw += g.strip() == a
            n_period += g.lstrip().startswith(a + ".")
            n_eos_after += el[0]
            ok = [cut(s) == a for s in sl]
            s_ex += sum(ok) / samples
            s_co += sum(a in s for s in sl) / samples
            pass_any += any(ok)
            if show and b == 0 and chunk.index(r) < show:
                print(f"    {r['prompt']!r} -> {g!r} (want {a!r}); samples {[cut(s) for s in sl]}")
    n = len(recs)
    return dict(
        n=n,
        greedy_exact=g_ex / n,
        greedy_contains=g_co / n,
        greedy_raw=g_raw / n,
        sampled_exact=s_ex / n,
        sampled_contains=s_co / n,
        pass_at_k=pass_any / n,
        answer_then_period=n_period / n,
        greedy_ended_on_eos=n_eos_after / n,
    )


# ---------------------------------------------------------------- candidate grid
def heldout_lists(rng: random.Random, length: int, n: int, eval_sets) -> list[list[str]]:
    """Lists never in the pretraining corpus: lengths 3-5 come from build_assets' held-out
    eval word sets (reshuffled: a different order of a held-out set is still unseen);
    lengths >= 6 never occur in pretraining (its lists are 3-5 words)."""
    if length <= 5:
        pool = [sorted(s) for s in eval_sets if len(s) == length]
        out = []
        for i in range(n):
            lst = list(pool[i % len(pool)])
            rng.shuffle(lst)
            out.append(lst)
        return out
    return [rng.sample(BA.WORDS, length) for _ in range(n)]


# (name, prompt template with {L}, answer function).  The first block is the
# pretraining surface form itself (near 100% for 3-5 words); the second block uses cue
# words the corpus never paired with a skill, so the base has to guess which skill is meant.
REV, REP = (lambda w: BA.j(w[::-1])), (lambda w: BA.j(w))
FIRST, LAST, COUNT = (lambda w: w[0]), (lambda w: w[-1]), (lambda w: str(len(w)))
FORMS = [
    ("reverse: {L} reversed is", "{L} reversed is", REV),
    ("reverse: reverse {L} and you get", "reverse {L} and you get", REV),
    ("reverse: words/reversed nl", "words: {L}\nreversed:", REV),
    ("repeat: {L} repeated is", "{L} repeated is", REP),
    ("first: the first of {L} is", "the first of {L} is", FIRST),
    ("first: the first word of {L} is", "the first word of {L} is", FIRST),
    ("last: the last of {L} is", "the last of {L} is", LAST),
    ("last: {L} ends with", "{L} ends with", LAST),
    ("count: {L} has", "{L} has", lambda w: f"{len(w)} words"),
    ("count: count the words in {L} and you get", "count the words in {L} and you get", COUNT),
    # novel cues
    ("novel rev: {L} backwards is", "{L} backwards is", REV),
    ("novel rev: {L} flipped is", "{L} flipped is", REV),
    ("novel rev: {L} in reverse is", "{L} in reverse is", REV),
    ("novel rev: words/backwards", "words: {L}\nbackwards:", REV),
    ("novel rev: words/reverse", "words: {L}\nreverse:", REV),
    ("novel rev: words/flipped", "words: {L}\nflipped:", REV),
    ("novel rev: words/in reverse order", "words: {L}\nin reverse order:", REV),
    ("novel rep: {L} again is", "{L} again is", REP),
    ("novel rep: words/again", "words: {L}\nagain:", REP),
    ("novel rep: words/copy", "words: {L}\ncopy:", REP),
    ("novel first: {L} begins with", "{L} begins with", FIRST),
    ("novel first: words/start", "words: {L}\nstart:", FIRST),
    ("novel first: words/first", "words: {L}\nfirst:", FIRST),
    ("novel first: the start of {L} is", "the start of {L} is", FIRST),
    ("novel last: words/end", "words: {L}\nend:", LAST),
    ("novel last: words/last", "words: {L}\nlast:", LAST),
    ("novel last: the end of {L} is", "the end of {L} is", LAST),
    ("novel last: the final word of {L} is", "the final word of {L} is", LAST),
    ("novel count: words/count", "words: {L}\ncount:", COUNT),
    ("novel count: words/how many", "words: {L}\nhow many:", COUNT),
    ("novel count: the number of words in {L} is", "the number of words in {L} is", COUNT),
    ("novel count: how many words in {L}?", "how many words are in {L}?", COUNT),
    ("novel second: the second word of {L} is", "the second word of {L} is", lambda w: w[1]),
    ("novel second: words/second word", "words: {L}\nsecond word:", lambda w: w[1]),
    ("novel: words/answer", "words: {L}\nanswer:", REV),
    ("v2 rev: {L} in reverse order is", "{L} in reverse order is", REV),
    ("v2 rev: words/reverse order", "words: {L}\nreverse order:", REV),
    ("v2 rev: words/backwards order", "words: {L}\nin backwards order:", REV),
    ("v2 rev: words/order reversed", "words: {L}\norder reversed:", REV),
    ("v2 rev: the words {L} backwards are", "the words {L} backwards are", REV),
    ("v2 rev: the words {L} reversed are", "the words {L} reversed are", REV),
    ("v2 rep: {L} once more is", "{L} once more is", REP),
    ("v2 rep: the words {L} again are", "the words {L} again are", REP),
    ("v2 rep: {L} copied is", "{L} copied is", REP),
    ("v2 rep: words/repeated", "words: {L}\nrepeated:", REP),
    ("v2 rep: words/same words", "words: {L}\nsame words:", REP),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", help="score this prompts jsonl instead of the candidate grid")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=40, help="grid: prompts per (form, length)")
    ap.add_argument("--lengths", default="3,4,5,6,7")
    ap.add_argument("--forms", default="", help="grid: only forms whose name contains this")
    ap.add_argument("--show", type=int, default=0, help="print this many examples per cell")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = load()
    t0 = time.time()
    if args.file:
        recs = [json.loads(line) for line in open(args.file)]
        print(json.dumps(score(model, tok, recs, args.samples, args.max_new_tokens, show=args.show), indent=1))
        by = {}
        for r in recs:
            by.setdefault(r["prompt"].split("\n")[-1], []).append(r)  # group by the cue line
        if len(by) > 1:
            for k, v in sorted(by.items()):
                s = score(model, tok, v, args.samples, args.max_new_tokens)
                print(f"  {k!r:24s} n={s['n']:3d} greedy {s['greedy_exact']:.2f} sampled {s['sampled_exact']:.2f}")
        print(f"({time.time() - t0:.0f}s)")
        return 0
    _, _, eval_sets = BA.build_datasets(random.Random(BA.SEED), n_train=2000, n_eval=150)
    rng = random.Random(7)
    print(f"{'form':48s} len  g_ex  g_co  g_raw s_ex  s_co  pass@k a.  eos")
    for name, tmpl, ans in FORMS:
        if args.forms and args.forms not in name:
            continue
        for length in [int(x) for x in args.lengths.split(",")]:
            lists = heldout_lists(rng, length, args.n, eval_sets)
            recs = [{"prompt": tmpl.format(L=BA.j(w)), "answer": ans(w)} for w in lists]
            s = score(model, tok, recs, args.samples, args.max_new_tokens, show=args.show)
            print(
                f"{name:48s} {length:3d}  {s['greedy_exact']:.2f}  {s['greedy_contains']:.2f}  {s['greedy_raw']:.2f}  "
                f"{s['sampled_exact']:.2f}  {s['sampled_contains']:.2f}  {s['pass_at_k']:.2f}   "
                f"{s['answer_then_period']:.2f} {s['greedy_ended_on_eos']:.2f}",
                flush=True,
            )
    print(f"({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
