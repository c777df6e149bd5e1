"""A group's completions scored in one row behind their one prompt (GRPO's training forward, and the sampling
policy's and the reference's log-probabilities): the prompt's tokens run through the model once, not G times.

    a group's row   prompt     | completion 1    | completion 2    | ... | completion G   (right-padded to the widest)
    position_ids    0 .. P-1   | P .. P+c1-1     | P .. P+c2-1     | ...
    attends to      its prompt | the prompt and completion 1's earlier tokens, never another completion's

The mask is a (groups, 1, L, L) tensor that sdpa and eager attention take as given (transformers passes a 4-D mask
through), so nothing else changes: no KV cache (checkpointed layers recompute as before), one forward under
DDP and FSDP. Each completion's first token is predicted by the prompt's last position, read once per
completion. The same log-probabilities as the G rows of prompt + completion (fp32: tests/test_grpo_forward.py).

Shared only where it pays and holds (else None: the rows as they are):
  - the mask costs no more than the padded rows' own: groups x L^2 <= rows x W^2 (a prompt at least ~sqrt(G) times
    its completions): fewer tokens, and a mask no larger than the one transformers builds for padded rows (rows
    without any padding get none and sdpa's causal kernel: there the shared row's attention can cost up to ~2x,
    still the smaller part of a step whose linear layers run fewer tokens);
  - attention is sdpa or eager (varlen, flash and flex build their own masks; checked again at each call: context
    parallelism switches it after loading), every layer softmax attention over a KV cache (a recurrent layer,
    Qwen3-Next's, would read the completions before it), no multimodal rope, no ALiBi, no chunked attention, no
    router loss over the mask, no sliding window narrower than a row (the mask does not window); and a probe of two
    small groups gives the model's own log-probabilities (holds_on, run once at the loss's first forward);
  - whole rows of text: not a context- or sequence-parallel part, no images; every group's G rows the same prompt.

With LoRA dropout, a shared prompt draws one dropout mask for its G completions where the rows draw G: the same in
expectation, not the same gradients. objectives/grpo.py shares the training forward only without dropout (the
sampling policy's and the reference's passes run in eval mode and always may).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from finetune.data import IGNORE_INDEX

ROW_KEYS = ("input_ids", "attention_mask", "labels")  # what a GRPO batch's rows are (the rest is per-row numbers)
NOT_WHOLE_ROWS = ("context_part", "sequence_split", "position_ids")  # a part of each row, or packed rows


@dataclass(frozen=True)
class Sharing:
    """What the model allows: the prompt shared across each run of `group` rows."""

    group: int
    additive: bool  # eager attention adds the mask to its scores (a float mask); sdpa takes booleans
    window: int | None  # the config's sliding window (its windowed layers'), None without one
    dtype: torch.dtype = torch.float32  # the added mask's: the hidden states' (a wider one would upcast the scores)


@dataclass
class SharedRows:
    inputs: dict[str, torch.Tensor]  # input_ids and position_ids (groups, L), attention_mask (groups, 1, L, L)
    keep: torch.Tensor  # (groups, L) bool: the positions whose next-token logits are read
    picks: torch.Tensor  # each target of the unshared rows (row-major) -> its logits among the kept positions


def sharing_for(model, group: int) -> Sharing | None:
    """Whether this model's forward can share a group's prompt, from its config (see the module's list); None where
    it cannot. GRPOLoss checks the model itself once, at its first forward (holds_on)."""
    from finetune.model.load import base_of
    from finetune.objectives.sampling import repeatable_cache, shareable

    base = base_of(model)
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    attention = getattr(base.config, "_attn_implementation", None)
    if group < 2 or attention not in ("sdpa", "eager") or not shareable(base) or not repeatable_cache(base):
        return None
    # ALiBi builds its biases from a 2-D mask; chunked attention (Llama-4) and a router's load-balancing loss read the
    # mask their own way: the 4-D mask would be refused or misread there.
    if (
        getattr(text, "alibi", False)
        or getattr(text, "attention_chunk_size", None)
        or getattr(text, "output_router_logits", False)
    ):
        return None
    kinds = set(getattr(text, "layer_types", None) or [])
    if kinds - {"full_attention", "sliding_attention"}:  # chunked, linear or other attention layers
        return None
    windowed = "sliding_attention" in kinds if kinds else getattr(text, "use_sliding_window", True) is not False
    window = getattr(text, "sliding_window", None) if windowed else None
    dtype = base.get_input_embeddings().weight.dtype
    return Sharing(group, attention == "eager", window or None, dtype if dtype.is_floating_point else torch.float32)


PROBE_GROUP = 4  # rows a probe group has, whatever num_generations is: the mask's meaning does not depend on it


@torch.no_grad()
def holds_on(model, how: Sharing) -> bool:
    """Whether a shared row gives the model's own log-probabilities on a probe (2 groups of 4: prompts of 16 and 14
    tokens, completions of 3-5), in eval mode. Judged against two controls, the same row with each completion reading
    the ones before it and with positions running on instead of restarting: the shared row must be within a quarter
    of the nearer control's distance from the rows' log-probabilities (other shapes sum in another order, so not
    bitwise). A model whose forward does something else with a 4-D mask or with position_ids fails or raises."""
    from finetune.model.load import compute_device, head_owner

    config: Any = getattr(head_owner(model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 8:
        return False
    probe = Sharing(PROBE_GROUP, how.additive, how.window, how.dtype)
    batch = _probe_rows(vocab, compute_device(model))
    shared = shared_rows(batch, probe)
    if shared is None:
        return False
    targets = batch["labels"][:, 1:]
    picked = targets != IGNORE_INDEX
    leaky = dict(shared.inputs, attention_mask=_causal_like(shared.inputs["attention_mask"], how))
    running = torch.arange(shared.inputs["input_ids"].shape[1], device=targets.device).expand_as(shared.inputs["input_ids"])
    ran_on = dict(shared.inputs, position_ids=running)
    was_training = model.training
    model.eval()
    try:
        rows = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][picked]
        tries = [model(**inputs).logits[shared.keep][shared.picks] for inputs in (shared.inputs, leaky, ran_on)]
    except torch.OutOfMemoryError:
        raise  # the device is full, not the mask refused: said as the run's out-of-memory error
    except Exception:  # noqa: BLE001 (a model whose forward refuses the 4-D mask: it trains on the rows as they are)
        return False
    finally:
        model.train(was_training)
    truth = torch.log_softmax(rows.float(), -1).gather(1, targets[picked][:, None])
    off = [float((torch.log_softmax(t.float(), -1).gather(1, targets[picked][:, None]) - truth).abs().max()) for t in tries]
    return off[0] <= 0.25 * min(off[1], off[2])


def _probe_rows(vocab: int, device) -> dict[str, torch.Tensor]:
    """Two groups of PROBE_GROUP rows as GRPO trains them (sampling.trainable_rows): a prompt, then a completion."""
    from finetune.objectives.sampling import Completions, trainable_rows

    token = lambda i: 3 + i % (vocab - 3)  # noqa: E731 (ids past the usual special tokens)
    prompts = [[token(7 * i) for i in range(16)], [token(5 * i + 1) for i in range(14)]]
    completions = [[token(11 * r + 3 * j + 2) for j in range(3 + r % 3)] for _ in prompts for r in range(PROBE_GROUP)]
    width = max(len(p) for p in prompts)  # left-padded, as the collator gives prompts
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    done = Completions(completions, [""] * len(completions))
    return trainable_rows({"input_ids": ids, "attention_mask": mask}, done, PROBE_GROUP, 0)


def _causal_like(mask: torch.Tensor, how: Sharing) -> torch.Tensor:
    """A plain causal mask of the shared mask's shape and kind: every token reads every one before it."""
    allowed = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril().expand_as(mask)
    if not how.additive:
        return allowed
    return torch.zeros(mask.shape, dtype=how.dtype, device=mask.device).masked_fill(~allowed, torch.finfo(how.dtype).min)


def shared_rows(batch: dict[str, Any], how: Sharing) -> SharedRows | None:
    """The batch's rows, each group's prompt once, where it pays and holds (module doc); else None."""
    if any(k in batch for k in NOT_WHOLE_ROWS) or batch["attention_mask"].dim() != 2:
        return None
    extra = {k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and k not in ROW_KEYS}
    if extra - {"old_logps", "ref_logps"}:  # image inputs, token types: not rows of text alone
        return None
    ids, labels = batch["input_ids"], batch["labels"]
    rows, width = ids.shape
    if rows % how.group or (how.window is not None and width > how.window):
        return None
    lengths = (labels != IGNORE_INDEX).sum(1)
    prompt_lengths = (batch["attention_mask"].sum(1) - lengths).tolist()  # right-padded: prompt, completion, padding
    lengths, ids_list = lengths.tolist(), ids.tolist()
    groups = rows // how.group
    widths = []
    for g in range(groups):
        members = range(g * how.group, (g + 1) * how.group)
        p = prompt_lengths[members[0]]
        prompt = ids_list[members[0]][:p]
        if p < 1 or any(prompt_lengths[r] != p or ids_list[r][:p] != prompt for r in members):
            return None  # not one prompt per group (the rows are not a GRPO group's)
        widths.append(p + sum(lengths[r] for r in members))
    longest = max(widths)
    if groups * longest**2 > rows * width**2:
        return None  # the mask and the attention would cost more than the rows' own
    return _layout(ids_list, prompt_lengths, lengths, how, longest, ids.device)


def _layout(ids: list[list[int]], prompts: list[int], lengths: list[int], how: Sharing, longest: int, device) -> SharedRows:
    groups = len(ids) // how.group
    shared = torch.zeros(groups, longest, dtype=torch.long)
    positions = torch.zeros_like(shared)
    part = torch.full_like(shared, -1)  # -1 padding, 0 the prompt, j + 1 completion j
    keep = torch.zeros(groups, longest, dtype=torch.bool)
    predictor: list[int] = []  # each target's position in the flattened shared rows, in the unshared rows' order
    for g in range(groups):
        first = g * how.group
        p = prompts[first]
        shared[g, :p] = torch.tensor(ids[first][:p])
        positions[g, :p] = torch.arange(p)
        part[g, :p] = 0
        at = p
        for j in range(how.group):
            c = lengths[first + j]
            shared[g, at : at + c] = torch.tensor(ids[first + j][p : p + c], dtype=torch.long)
            positions[g, at : at + c] = torch.arange(p, p + c)
            part[g, at : at + c] = j + 1
            if c:  # its first token is predicted by the prompt's last position, the rest by its own tokens
                predictor += [g * longest + p - 1] + [g * longest + at + t for t in range(c - 1)]
                keep[g, p - 1] = True
                keep[g, at : at + c - 1] = True
            at += c
    part = part.to(device)  # the (groups, L, L) mask made where it is used: no host-built copy crosses
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    query, key = part[:, :, None], part[:, None, :]
    allowed = causal & (((key == 0) & (query >= 0)) | (key == query))  # padding sees padding: no empty softmax row
    mask = allowed.unsqueeze(1)
    if how.additive:
        mask = torch.zeros(mask.shape, dtype=how.dtype, device=device).masked_fill(~mask, torch.finfo(how.dtype).min)
    kept_index = keep.flatten().cumsum(0) - 1
    picks = kept_index[torch.tensor(predictor, dtype=torch.long)]
    inputs = {"input_ids": shared.to(device), "attention_mask": mask, "position_ids": positions.to(device)}
    return SharedRows(inputs, keep.to(device), picks.to(device))
