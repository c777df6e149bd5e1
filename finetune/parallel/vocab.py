"""Vocabulary parallelism for a tensor-parallel group (distributed.vocab_parallel; Megatron-LM's vocab-parallel
embedding and cross-entropy): each rank holds 1/tp of the vocabulary's rows of the input embedding and of the LM
head, so neither table is whole on any rank, and the training loss never makes a position's whole-vocabulary logits.

    split_vocabulary(model, group)       # after loading: the tables cut to this rank's rows, hooks for the rest

Embedding: a rank looks its ids up in its rows (an id outside them reads a zero row kept at the end), and the group's
sum (one all-reduce) is every id's vector. Head: a rank's logits are its rows' (n, V/tp). The chunked loss
(memory/linear_ce.py) takes them as they are: the group's max, sum of exponentials and target logit all-reduced
(VocabCrossEntropy), and in backward each rank's softmax minus one-hot over its own columns; the head's input
gradient is summed over the group (Megatron's f). Any other forward of the head (generation, the held-out exact
match, preference log-probabilities) gets the whole logits: the shares all-gathered along the vocabulary, whose
backward keeps the rank's own columns. Shares differ by at most one row where tp does not divide the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune.data import IGNORE_INDEX
from finetune.errors import ConfigError
from finetune.model.load import head_owner
from finetune.parallel import waits
from finetune.parallel.regions import FromGroup, ToGroup


def share_bounds(vocab: int, ranks: int) -> list[int]:
    """Where each rank's rows start, and the end: rank r holds [bounds[r], bounds[r + 1])."""
    return [r * vocab // ranks for r in range(ranks + 1)]


class _Gathered(torch.autograd.Function):
    """The group's logit shares side by side along the vocabulary; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.columns = (bounds[rank], bounds[rank + 1])
        widest = max(b - a for a, b in zip(bounds, bounds[1:]))
        padded = nn.functional.pad(local, (0, widest - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(len(bounds) - 1)]
        with waits.collective(padded.device):
            dist.all_gather(parts, padded, group=group)
        return torch.cat([p[..., : b - a] for p, a, b in zip(parts, bounds, bounds[1:])], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, end = ctx.columns
        return grad[..., start:end].contiguous(), None, None, None


class VocabCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of logits split along the vocabulary over `group`: equal to F.cross_entropy of the
    whole logits (reduction sum, IGNORE_INDEX ignored), computed in fp32 from (n, this rank's columns)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        top = logits.max(dim=-1).values
        with waits.collective(logits.device):  # top: for exp's range only, no gradient flows through it
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - top.unsqueeze(-1)).exp()
        total = exp.sum(dim=-1)
        with waits.collective(logits.device):
            dist.all_reduce(total, group=group)
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])  # the target's column is this rank's
        column = torch.where(mine, local, torch.zeros_like(local))
        target = torch.where(mine, logits.gather(-1, column.unsqueeze(-1)).squeeze(-1) - top, torch.zeros_like(top))
        with waits.collective(logits.device):
            dist.all_reduce(target, group=group)
        scored = (targets != IGNORE_INDEX).to(logits.dtype)
        ctx.save_for_backward(exp / total.unsqueeze(-1), column, mine, scored)
        return ((total.log() - target) * scored).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, column, mine, scored = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, column.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * (scored * grad).unsqueeze(-1), None, None, None


class VocabSplit:
    """What a split head answers the chunked loss (memory/linear_ce.py finds it as the head's `vocab_split`)."""

    def __init__(self, head: nn.Module, group: Any, bounds: list[int], rank: int) -> None:
        self.head, self.group, self.bounds, self.rank = head, group, bounds, rank

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the logits, without gathering the others'."""
        head: Any = self.head
        return nn.functional.linear(ToGroup.apply(hidden, self.group), head.weight, head.bias)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return VocabCrossEntropy.apply(logits, targets, self.bounds[self.rank], self.group)

    # the head's hooks: any forward of the module itself gives the whole logits
    def head_in(self, module: nn.Module, args: tuple):
        return (ToGroup.apply(args[0], self.group), *args[1:])

    def head_out(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _Gathered.apply(output, self.bounds, self.rank, self.group)


def split_vocabulary(model: nn.Module, group: Any, vocab: int | None = None) -> list[Any]:
    """The input embedding and the head cut to this rank's rows of the `vocab` (default: the embedding's rows; a tied
    head shares the embedding's cut), or kept where the load read only those rows (tensor.reads_vocab_rows); returns
    the hooks. Refuses tables that train (a LoRA on them, resized and trained rows)."""
    owner: Any = head_owner(model)
    embedding, head = owner.get_input_embeddings(), owner.lm_head
    named = [*embedding.named_parameters("input embedding"), *head.named_parameters("lm_head")]
    trained = [n for n, p in named if p.requires_grad]
    if trained or not isinstance(embedding, nn.Embedding) or type(head) is not nn.Linear:
        raise ConfigError(
            [
                "distributed.vocab_parallel=true splits a frozen input embedding (nn.Embedding) and a plain linear head; "
                f"this model's are {type(embedding).__name__} and {type(head).__name__}"
                + (f", trained ({', '.join(trained)})" if trained else "")
                + ". Take lm_head and embed_tokens out of lora.target, or set distributed.vocab_parallel=false."
            ]
        )
    held = embedding.weight.shape[0]
    if head.weight.shape[0] != held:
        raise ConfigError(
            [
                f"distributed.vocab_parallel=true: this model's head has {head.weight.shape[0]} rows and its input "
                f"embedding {held}; the split needs them alike. Set distributed.vocab_parallel=false."
            ]
        )
    rank, ranks, whole = dist.get_rank(group), dist.get_world_size(group), vocab or held
    bounds = share_bounds(whole, ranks)
    start, end = bounds[rank], bounds[rank + 1]
    read = held == end - start and held != whole  # the load read this rank's rows alone
    if held not in (whole, end - start):
        raise ConfigError(
            [
                f"distributed.vocab_parallel=true: this rank's tables have {held} rows, neither the vocabulary's "
                f"{whole} nor its share {end - start}. Set distributed.vocab_parallel=false."
            ]
        )
    tied = head.weight is embedding.weight
    with torch.no_grad():
        rows = embedding.weight if read else embedding.weight[start:end]
        table = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # the zero row: ids another rank holds
        embedding.weight = nn.Parameter(table, requires_grad=False)
        embedding.num_embeddings, embedding.padding_idx = end - start + 1, None
        kept = table[:-1] if tied else head.weight if read else head.weight[start:end].clone()
        head.weight = nn.Parameter(kept, requires_grad=False)
        if head.bias is not None:
            head.bias = nn.Parameter(head.bias if read else head.bias[start:end].clone(), requires_grad=False)
        head.out_features = end - start

    def own_ids(module: nn.Module, args: tuple):
        ids = args[0] - start
        return (torch.where((ids >= 0) & (ids < end - start), ids, torch.full_like(ids, end - start)), *args[1:])

    split = VocabSplit(head, group, bounds, rank)
    asked: Any = head
    asked.vocab_split = split  # the chunked loss asks the head for it
    return [
        embedding.register_forward_pre_hook(own_ids),
        embedding.register_forward_hook(lambda module, args, out: FromGroup.apply(out, group)),
        head.register_forward_pre_hook(split.head_in),
        head.register_forward_hook(split.head_out),
    ]
