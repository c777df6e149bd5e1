"""The worker side of benchmarks/compare.py: `compare.py --worker SPEC` runs one tool's
training (TOOLS) in lockstep with the parent, then the held-out loss, and reports back."""

from __future__ import annotations

from typing import Any

from compare_job import PAD_ID, read_jsonl
from compare_measure import Lockstep
from compare_peer_finetune import run_finetune
from compare_peer_hf import run_hf
from compare_peer_trl import run_trl


def encode_eval(records: list[dict[str, str]], tok, max_len: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for r in records:
        p = tok(r["prompt"])["input_ids"]
        ids = (tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id])[:max_len]
        labels = ([-100] * len(p) + ids[len(p) :])[: len(ids)]
        out.append((ids, labels))
    return out


def eval_loss(model, examples: list[tuple[list[int], list[int]]], batch: int = 8, device: str = "cpu") -> float:
    """Token-mean cross-entropy over the completion tokens of held-out examples, full logits,
    padded batches: the same function for every tool (inputs on `device`)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            chunk = examples[i : i + batch]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), PAD_ID)
            labels = torch.full((len(chunk), width), -100)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (x, y) in enumerate(chunk):
                ids[r, : len(x)], labels[r, : len(y)], mask[r, : len(x)] = torch.tensor(x), torch.tensor(y), 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits[:, :-1]
            tgt = labels[:, 1:].to(device)
            keep = tgt != -100
            total += float(F.cross_entropy(logits[keep].float(), tgt[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


TOOLS = {"finetune": run_finetune, "trl": run_trl, "hf": run_hf}


def worker_main(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    lock = Lockstep()
    try:
        result = TOOLS[spec["tool"]](spec, lock)
        lock.free = True
        model, tok = result.pop("model"), result.pop("tokenizer")
        held = encode_eval(read_jsonl(spec["eval"]), tok, spec["max_seq_len"]) if spec.get("eval") else []
        result["eval_loss"] = eval_loss(model, held) if held else None
        result["total"] = lock.total.as_dict()
        result["step_examples"] = lock.step_examples
        result["threads"] = torch.get_num_threads()
        lock.send({"event": "done", **lock.loaded, **result})
    except BaseException as exc:  # the parent prints it with the log tail
        import traceback

        lock.send({"event": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
        raise
