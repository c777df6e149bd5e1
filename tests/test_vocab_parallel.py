"""Vocabulary parallelism (finetune/parallel/vocab.py) on 2 gloo processes: a tiny Llama's embedding and head cut
to each rank's rows of an odd vocabulary (37: shares of 18 and 19) give the whole model's embeddings, logits, chunked
loss and gradients; tied and untied tables; fp32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from finetune.data import IGNORE_INDEX
from finetune.errors import ConfigError
from finetune.memory.linear_ce import chunked_linear_cross_entropy
from finetune.parallel.vocab import share_bounds, split_vocabulary

VOCAB, HIDDEN, POSITIONS = 37, 16, 11


def _model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)  # frozen, as a (Q)LoRA base


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, POSITIONS), generator=g)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=g) * 3
    targets = torch.randint(0, VOCAB, (POSITIONS,), generator=g)
    targets[[2, 7]] = IGNORE_INDEX
    return ids, hidden, targets


def _measure(model):
    """(embeddings of ids, whole logits of hidden and their gradient at hidden, the chunked loss and its gradient)."""
    ids, hidden, targets = _inputs()
    cap = lambda logits: torch.tanh(logits / 5) * 5  # noqa: E731 - a model's own logits transform (Gemma's soft-capping)
    embedded = model.get_input_embeddings()(ids)
    h = hidden.clone().requires_grad_()
    logits = model.lm_head(h)
    logits.pow(2).sum().backward()
    logits_grad = h.grad
    h = hidden.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, model.lm_head, targets, chunk_rows=4, transform=cap)
    loss.backward()
    return [t.detach() for t in (embedded, logits, logits_grad, loss, h.grad)]


def _precut(model, rank: int, tied: bool) -> None:
    """The tables as a load that reads only this rank's rows leaves them (tensor.reads_vocab_rows)."""
    start, end = share_bounds(VOCAB, 2)[rank : rank + 2]
    embedding = model.get_input_embeddings()
    embedding.weight = torch.nn.Parameter(embedding.weight[start:end].clone(), requires_grad=False)
    head = embedding.weight if tied else torch.nn.Parameter(model.lm_head.weight[start:end].clone(), requires_grad=False)
    model.lm_head.weight = head


def _worker(rank: int, port: int, tied: bool, broken: str, results, precut: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        whole = _measure(_model(tied))
        model = _model(tied)
        if precut:
            _precut(model, rank, tied)
        split_vocabulary(model, dist.group.WORLD, VOCAB)
        if broken:  # the head's input gradient left as each rank's columns' part, never summed over the group
            from finetune.parallel import vocab

            class Unsummed(torch.autograd.Function):  # the head's f without its all-reduce (tensor.py keeps its own)
                forward = staticmethod(lambda ctx, x, group: x.view_as(x))
                backward = staticmethod(lambda ctx, grad: (grad, None))

            vocab.ToGroup = Unsummed
        rows = model.get_input_embeddings().weight.shape[0] - 1
        results[rank] = ([w - s for w, s in zip(whole, _measure(model))], rows)
    finally:
        dist.destroy_process_group()


def _run(tied: bool, broken: str = "", precut: bool = False) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), tied, broken, results, precut), nprocs=2, start_method="spawn")
    return dict(results)


@pytest.mark.parametrize("tied, precut", [(False, False), (True, False), (False, True)], ids=["untied", "tied", "read-split"])
def test_tables_split_over_two_ranks_give_the_whole_tables_results(tied, precut):
    # read-split: each rank's tables hold only its rows already (as a load reads them where tp divides the vocabulary)
    results = _run(tied, precut=precut)
    assert [results[r][1] for r in (0, 1)] == [18, 19]  # each rank's rows of the vocabulary
    for rank in (0, 1):
        names = ["embeddings", "logits", "their gradient", "chunked loss", "its gradient"]
        for name, diff in zip(names, results[rank][0]):
            assert float(diff.abs().max()) < 1e-5, (rank, name)


def test_a_head_input_gradient_never_summed_over_the_group_fails():
    for rank, (diffs, _) in _run(tied=False, broken="unsummed").items():
        assert float(diffs[3].abs().max()) < 1e-5  # the loss itself is the group's
        assert float(diffs[4].abs().max()) > 1e-3, rank  # its gradient at the head's input is one rank's part


def test_share_bounds_cover_the_vocabulary_once():
    assert share_bounds(37, 2) == [0, 18, 37]
    assert share_bounds(128256, 8) == [i * 16032 for i in range(9)]


def test_trained_tables_are_refused_with_the_fix():
    model = _model(tied=False)
    model.lm_head.weight.requires_grad_(True)
    model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="lm_head.*lora.target|Take lm_head and embed_tokens out of lora.target"):
        split_vocabulary(model, group=None)


def test_vocab_parallelism_is_refused_where_it_does_not_split_with_the_fix():
    from test_config import MINIMAL, problems_of

    alone = problems_of({**MINIMAL, "distributed": {"vocab_parallel": True}})
    assert any(
        "distributed.vocab_parallel=true splits the embedding and the head over a tensor-parallel group" in p for p in alone
    )
    split = {"tensor_parallel": 2, "vocab_parallel": True}
    said = problems_of({**MINIMAL, "distributed": {**split, "pipeline_parallel": 2}})
    assert any("vocab_parallel=true with distributed.pipeline_parallel=2: not yet" in p for p in said)
    said = problems_of({**MINIMAL, "distributed": split, "memory": {"loss": "full"}})
    assert any("memory.loss=full: a rank holds only its columns" in p and "memory.loss=chunked" in p for p in said)
    said = problems_of({**MINIMAL, "distributed": split, "lora": {"target": ["q_proj", "lm_head"]}})
    assert any("with lm_head in lora.target: the split tables are frozen" in p for p in said)
    from finetune.config.schema import build_recipe

    assert build_recipe({**MINIMAL, "distributed": split}).distributed.vocab_parallel
    assert build_recipe({**MINIMAL, "distributed": {**split, "context_parallel": 2}}).distributed.vocab_parallel


def test_the_planner_gives_a_rank_its_share_of_the_tables_and_of_a_chunks_logits():
    from test_plan_context import GPU, recipe

    from finetune.plan import plan_recipe
    from finetune.plan.inputs import describe_setup

    device = ("memory.base_weights=device", "memory.embeddings=device", "memory.activation_offload=false")
    tp = (*device, "data.max_seq_len=8192", "distributed.tensor_parallel=2", "distributed.context_parallel=1")
    whole, split = (plan_recipe(recipe(*tp, f"distributed.vocab_parallel={on}"), GPU, gpus=2) for on in ("false", "true"))
    vocab, hidden, b = 128256, 4096, 2  # Llama-3.1-8B, bf16 tables, untied
    assert whole.component("weights_unquantized") - split.component("weights_unquantized") == 2 * vocab // 2 * hidden * b
    assert split.component("logits_loss") < whole.component("logits_loss")  # a chunk's columns: half the vocabulary
    assert "vocabulary parallel" in describe_setup(split.setup) and "1/2 of the embedding and head rows" in " ".join(split.notes)


def test_a_head_of_other_rows_than_the_embedding_is_refused():
    model = _model(tied=False)
    model.lm_head = torch.nn.Linear(HIDDEN, VOCAB + 3, bias=False).requires_grad_(False)
    with pytest.raises(ConfigError, match="head has 40 rows and its input embedding 37"):
        split_vocabulary(model, group=None)


def test_fit_splits_the_vocabulary_only_where_no_adapter_trains_a_table():
    from dataclasses import replace

    from finetune.declarations.splits import trained_tables
    from finetune.plan.fitting import _laid_out
    from finetune.plan.inputs import Setup

    assert trained_tables("all-linear") == [] and trained_tables(["q_proj", "lm_head"]) == ["lm_head"]
    assert trained_tables(r".*(embed_tokens|q_proj)") == ["embed_tokens"] and trained_tables(["q_proj"]) == []
    base = Setup(batch_size=1, grad_accum=2, gpus=2, seq_len=1024, loss="auto")
    assert _laid_out(base, base, 1, 2).vp and _laid_out(base, base, 1, 2).sp
    assert not _laid_out(base, base, 1, 2, tables_train=True).vp
    assert not _laid_out(replace(base, loss="full"), base, 1, 2).vp
