# Run with: python scripts/build_assets.py
"""Build the tiny test/demo assets shipped with ``finetune``.

Creates (deterministically, from a fixed seed, CPU only, no network):

* ``finetune/assets/tiny-llama/``: a tiny Llama-architecture causal LM, pretrained
  from scratch by this script on a synthetic corpus of plain English sentences
  about short word lists ("apple river stone reversed is stone river apple."),
  plus its byte-level BPE tokenizer (trained here with ``tokenizers``) carrying a
  ChatML chat template.
* ``finetune/assets/demo/{train,eval}.jsonl``: an alpaca-format instruction
  dataset over the same skills (reverse / repeat / first / last / count)
  expressed in a *different* surface form, and a README.

The pretraining corpus never contains the alpaca ``### Instruction`` format nor
any word list used in the eval split, so the base model scores ~0% exact match
on the demo eval, and a short (Q)LoRA fine-tune that only has to map the new
format onto the already-learnt skills brings it to ~85-95%.

Options: ``--steps`` (pretraining optimizer steps), ``--out`` (assets dir),
``--threads``.  Runtime with the defaults is ~11 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

SEED = 1234
REPO_ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------
# Vocabulary of list words (every one must be a single token of the trained tokenizer).
# --------------------------------------------------------------------------------------
WORDS = """
apple banana cherry grape lemon mango melon peach pear plum
river stone cloud rain snow wind storm sun moon star
tree leaf flower grass seed root branch forest field hill
lake sea ocean island beach sand rock mountain valley desert
dog cat horse cow sheep goat pig duck goose chicken
bird fish frog mouse rabbit fox wolf bear lion tiger
house door window roof wall floor table chair bed lamp
book pen paper letter box bag cup plate bowl spoon
bread cheese butter milk egg rice soup cake honey salt
car bus train boat ship plane wheel road bridge tower
shirt hat coat shoe sock ring watch key coin bell
""".split()
assert len(WORDS) == len(set(WORDS))

COLORS = "red blue green yellow black white pink brown small big old new warm cold".split()
FILLER_VERBS = "saw found liked took made had kept moved held wanted".split()
FILLER_PEOPLE = ["tom", "anna", "the child", "my friend", "the farmer", "a teacher", "we", "they", "she", "he"]

MIN_LEN, MAX_LEN = 3, 5  # list lengths
FILLER_P = 0.3  # chance of a filler sentence in a pretraining paragraph

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024

MODEL_CFG = dict(
    hidden_size=160,
    intermediate_size=448,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.1,  # larger than the usual 0.02: copying (induction) circuits form far sooner
)


# --------------------------------------------------------------------------------------
# Skills
# --------------------------------------------------------------------------------------
def rand_list(rng: random.Random, forbidden: set[frozenset] | None = None) -> list[str]:
    while True:
        lst = rng.sample(WORDS, rng.randint(MIN_LEN, MAX_LEN))
        if forbidden is None or frozenset(lst) not in forbidden:
            return lst


def j(words) -> str:
    return " ".join(words)


SKILLS = ["reverse", "repeat", "first", "last", "count"]


def skill_answer(skill: str, lst: list[str], rng: random.Random):
    """Return (extra, answer); extra is an optional probe word used by some phrasings."""
    if skill == "reverse":
        return None, j(lst[::-1])
    if skill == "repeat":
        return None, j(lst)
    if skill == "first":
        return None, lst[0]
    if skill == "last":
        return None, lst[-1]
    if skill == "count":
        return None, str(len(lst))
    raise ValueError(skill)


# Pretraining surface forms: plain sentences, never the alpaca format.
PRETRAIN_FORMS = {
    "reverse": [
        "{L} reversed is {A}.",
        "reverse {L} and you get {A}.",
        "backwards, {L} reads {A}.",
        "the words {L} in reverse order are {A}.",
        "words: {L}\nreversed: {A}\n",
        "words:\n{L}\nreversed:\n{A}\n",
    ],
    "repeat": [
        "{L} repeated is {A}.",
        "say {L} again: {A}.",
        "copy {L} and you get {A}.",
        "words: {L}\ncopied: {A}\n",
        "words:\n{L}\ncopied:\n{A}\n",
    ],
    "first": [
        "the first of {L} is {A}.",
        "{L} starts with {A}.",
        "the first word in {L} is {A}.",
        "words: {L}\nfirst word: {A}\n",
        "words:\n{L}\nfirst word:\n{A}\n",
    ],
    "last": [
        "the last of {L} is {A}.",
        "{L} ends with {A}.",
        "the last word in {L} is {A}.",
        "words: {L}\nlast word: {A}\n",
        "words:\n{L}\nlast word:\n{A}\n",
    ],
    "count": [
        "{L} has {A} words.",
        "there are {A} words in {L}.",
        "count the words in {L} and you get {A}.",
        "words: {L}\nnumber of words: {A}\n",
        "words:\n{L}\nnumber of words:\n{A}\n",
    ],
}

# Alpaca instruction phrasings (different surface form from the pretraining corpus).
ALPACA_WITH = {
    "reverse": [
        "Reverse the order of the following words.",
        "Write these words in reverse order.",
        "List the words below backwards.",
    ],
    "repeat": [
        "Repeat the following words exactly.",
        "Copy this list of words.",
        "Write the words below again, unchanged.",
    ],
    "first": [
        "What is the first word in the list?",
        "Give the first word of the following list.",
        "Which word comes first?",
    ],
    "last": [
        "What is the last word in the list?",
        "Give the final word of the following list.",
        "Which word comes last?",
    ],
    "count": [
        "How many words are in the list?",
        "Count the words below.",
        "Give the number of words in the following list.",
    ],
}
ALPACA_WITHOUT = {
    "reverse": ["Reverse the order of these words: {L}", "Write {L} in reverse order."],
    "repeat": ["Repeat these words exactly: {L}", "Copy this list of words: {L}"],
    "first": ["What is the first word in: {L}?", "Give the first word of {L}."],
    "last": ["What is the last word in: {L}?", "Give the final word of {L}."],
    "count": ["How many words are in: {L}?", "Count the words in {L}."],
}


def filler_sentence(rng: random.Random) -> str:
    r = rng.random()
    n1, n2 = rng.choice(WORDS), rng.choice(WORDS)
    c = rng.choice(COLORS)
    p = rng.choice(FILLER_PEOPLE)
    v = rng.choice(FILLER_VERBS)
    if r < 0.25:
        return f"{p} {v} a {c} {n1} near the {n2}."
    if r < 0.5:
        return f"the {n1} is {c} and the {n2} is not."
    if r < 0.75:
        return f"{p} {v} the {n1}, then the {n2}."
    return f"a {c} {n1} and a {rng.choice(COLORS)} {n2} are here."


def pretrain_doc(rng: random.Random, forbidden: set[frozenset]) -> str:
    """A short paragraph of facts about one word list (the list recurs, which makes
    copying from context pay off quickly), sometimes with a filler sentence."""
    lst = rand_list(rng, forbidden)
    parts = []
    if rng.random() < 0.3:
        parts.append(rng.choice(["the words are {L}.", "here is a list: {L}.", "{L}.", "list:\n{L}\n"]).format(L=j(lst)))
    for skill in rng.sample(SKILLS, rng.randint(2, min(4, len(SKILLS)))):
        x, a = skill_answer(skill, lst, rng)
        parts.append(rng.choice(PRETRAIN_FORMS[skill]).format(L=j(lst), A=a, X=x))
    if rng.random() < FILLER_P:
        parts.insert(rng.randrange(len(parts) + 1), filler_sentence(rng))
    out = ""
    for p in parts:
        if out and not out.endswith("\n"):
            out += rng.choice([" ", " ", "\n"])
        out += p
    return out.strip()


def alpaca_example(rng: random.Random, skill: str, lst: list[str]) -> dict:
    x, a = skill_answer(skill, lst, rng)
    if rng.random() < 0.3:
        instr = rng.choice(ALPACA_WITHOUT[skill]).format(L=j(lst), X=x)
        return {"instruction": instr, "input": "", "output": a}
    instr = rng.choice(ALPACA_WITH[skill]).format(X=x)
    return {"instruction": instr, "input": j(lst), "output": a}


def alpaca_prompt(ex: dict) -> str:
    if ex["input"]:
        return ALPACA_WITH_INPUT.format(instruction=ex["instruction"], input=ex["input"])
    return ALPACA_NO_INPUT.format(instruction=ex["instruction"])


def build_datasets(rng: random.Random, n_train: int, n_eval: int):
    eval_sets: set[frozenset] = set()
    eval_rows = []
    for i in range(n_eval):
        skill = SKILLS[i % len(SKILLS)]
        lst = rand_list(rng, eval_sets)
        eval_sets.add(frozenset(lst))
        eval_rows.append(alpaca_example(rng, skill, lst))
    train_rows = []
    for i in range(n_train):
        skill = SKILLS[i % len(SKILLS)]
        lst = rand_list(rng, eval_sets)  # never a word set used in eval
        train_rows.append(alpaca_example(rng, skill, lst))
    rng.shuffle(train_rows)
    rng.shuffle(eval_rows)
    return train_rows, eval_rows, eval_sets


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # GPT-2 style byte-level pre-tokenization: a word carries its leading space
    # ("Ġapple"); at the start of a line it has none ("apple").  The pretraining corpus
    # puts word lists both mid-line and at line starts so both forms are learnt.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        padding_side="right",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# --------------------------------------------------------------------------------------
# Pretraining
# --------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_complete(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    tok.padding_side = "right"
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def probe_base(model, tok, rng: random.Random, forbidden: set[frozenset], n: int = 120) -> dict:
    """Accuracy of the base model on the pretraining surface form, on unseen lists."""
    model.eval()
    res = {}
    for skill in SKILLS:
        prompts, answers = [], []
        lists = [rand_list(rng) for _ in range(n // len(SKILLS))]
        for lst in lists:
            x, a = skill_answer(skill, lst, rng)
            form = PRETRAIN_FORMS[skill][0]
            full = form.format(L=j(lst), A="\x00", X=x)
            prompts.append(full.split("\x00")[0].rstrip(" "))
            answers.append(a)
        outs = greedy_complete(model, tok, prompts, 2 * MAX_LEN + 4)
        ok = 0
        for o, a in zip(outs, answers):
            o = o.strip()
            ok += o.startswith(a) and (len(o) == len(a) or not o[len(a)].isalpha())
        res[skill] = ok / len(prompts)
    model.train()
    return res


def pretrain(tok, docs: list[str], steps: int, seq_len: int, batch: int, lr: float, log_every: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    ids: list[int] = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.append(tok.bos_token_id)
        ids.extend(enc)
        ids.append(tok.eos_token_id)
    stream = torch.tensor(ids, dtype=torch.long)
    n_chunks = len(stream) // seq_len
    data = stream[: n_chunks * seq_len].view(n_chunks, seq_len)
    print(f"[pretrain] corpus {len(stream):,} tokens, {n_chunks:,} chunks of {seq_len}", flush=True)

    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **MODEL_CFG,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[pretrain] model params {n_params:,}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    warmup = max(1, steps // 25)

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        t = (s - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    g = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(n_chunks, generator=g)
    pos = 0
    t0 = time.time()
    ema = None
    for step in range(steps):
        if pos + batch > n_chunks:
            perm = torch.randperm(n_chunks, generator=g)
            pos = 0
        x = data[perm[pos : pos + batch]]
        pos += batch
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % log_every == 0 or step == steps - 1:
            print(
                f"[pretrain] step {step + 1}/{steps} loss {loss.item():.4f} (ema {ema:.4f}) "
                f"lr {lr_at(step):.2e} {time.time() - t0:.0f}s",
                flush=True,
            )
    return model, n_params, ema, time.time() - t0


# --------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / "finetune" / "assets"))
    ap.add_argument("--steps", type=int, default=2800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.time()
    out = Path(args.out)
    model_dir = out / "tiny-llama"
    demo_dir = out / "demo"

    rng = random.Random(SEED)
    torch.manual_seed(SEED)

    # 1) instruction dataset (eval lists are held out from everything else)
    train_rows, eval_rows, eval_sets = build_datasets(rng, n_train=2000, n_eval=150)

    # 2) pretraining corpus (plain sentences; never the alpaca format, never eval lists)
    n_docs = args.steps * args.batch * args.seq_len // 70 + 1000
    docs = [pretrain_doc(rng, eval_sets) for _ in range(n_docs)]
    for d in docs[:2000]:
        assert "###" not in d
    print(f"[data] {len(docs):,} pretraining docs; e.g.\n  " + "\n  ".join(docs[:3]), flush=True)

    # 3) tokenizer: trained on the pretraining corpus plus the (train-split) instruction text
    tok_texts = docs[:20000] + [alpaca_prompt(r) + r["output"] for r in train_rows]
    tok = train_tokenizer(tok_texts)
    bad = [w for w in WORDS for v in (w, " " + w) if len(tok(v, add_special_tokens=False).input_ids) != 1]
    assert not bad, f"list words split into several tokens: {bad}"
    s = "Hello  world!\n\tapple river stone reversed is stone river apple. 123 héllo ✓"
    enc = tok(s).input_ids
    assert enc[0] == tok.bos_token_id and enc[-1] != tok.eos_token_id
    assert tok.decode(enc, skip_special_tokens=True) == s, tok.decode(enc, skip_special_tokens=True)
    print(
        f"[tokenizer] vocab {len(tok)}; special ids: bos={tok.bos_token_id} eos={tok.eos_token_id} "
        f"pad={tok.pad_token_id} unk={tok.unk_token_id}",
        flush=True,
    )

    # 4) pretrain
    model, n_params, final_loss, pt_time = pretrain(tok, docs, args.steps, args.seq_len, args.batch, args.lr, log_every=100)
    probe = probe_base(model, tok, random.Random(SEED + 1), eval_sets)
    print(f"[probe] base accuracy on pretraining-style prompts (unseen lists): {probe}", flush=True)

    # 5) save
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    model.config.use_cache = True
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16).save_pretrained(model_dir)
    tok.padding_side = "right"
    tok.save_pretrained(model_dir)

    demo_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(demo_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    (demo_dir / "README.md").write_text(
        "# Demo instruction dataset: word-list operations\n\n"
        "Alpaca-format (`instruction`, `input`, `output`) tasks over short lists (3-5) of\n"
        "simple English words: reverse the list, repeat it, give the first / last word,\n"
        "count the words. About 30% of examples put the list in the instruction and leave\n"
        "`input` empty.\n\n"
        f"`train.jsonl`: {len(train_rows)} examples; `eval.jsonl`: {len(eval_rows)} held-out\n"
        "examples whose word sets never occur in the train split or in the pretraining corpus.\n\n"
        "Generated by `python scripts/build_assets.py` (seeded, deterministic), which also\n"
        "pretrains `../tiny-llama` on plain sentences exercising the same skills in another\n"
        'surface form ("apple river stone reversed is stone river apple."), never in the\n'
        "alpaca format. The base scores ~0% exact match on `eval.jsonl`; a short QLoRA\n"
        "fine-tune (300 steps on CPU) teaches the format and reaches ~85-95%.\n"
    )
    print(f"[done] wrote {model_dir} and {demo_dir} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
