"""GRPO's training forward. Each group's prompt run once (objectives/prompt_sharing.py): the layout of hand-made
groups (golden ids, positions, mask, picks), where it is refused, and on the bundled demo model (4-bit, double quant,
fp32) the same log-probabilities, loss and gradients as the unshared rows, with a leaking mask as the negative control.
The head over chunks of completion tokens (memory.loss): the same again, no logits wider than a chunk."""

from __future__ import annotations

import pytest
import torch
from test_grpo import grpo_recipe

from finetune.config.schema import build_recipe
from finetune.data import IGNORE_INDEX
from finetune.objectives.grpo import completion_logps
from finetune.objectives.prompt_sharing import Sharing, holds_on, shared_rows, sharing_for
from finetune.objectives.sampling import Completions, trainable_rows
from finetune.trainer import Trainer


def _rows(prompts: list[list[int]], completions: list[list[int]], group: int) -> dict[str, torch.Tensor]:
    """trainable_rows of left-padded prompts (as the collator pads them) and the given completions."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return trainable_rows({"input_ids": ids, "attention_mask": mask}, Completions(completions, [""] * len(completions)), group, 0)


def test_each_group_is_one_row_its_prompt_once_and_its_completions_apart():
    # group 1: prompt 5 6 7, completions (8 9) and (10); group 2: prompt 11 12, completions (13) and (14 15 16)
    batch = _rows([[5, 6, 7], [11, 12]], [[8, 9], [10], [13], [14, 15, 16]], group=2)
    shared = shared_rows(batch, Sharing(2, additive=False, window=None))
    assert shared is not None
    assert shared.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    assert shared.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 2, 3, 4]]
    assert shared.inputs["attention_mask"].int()[:, 0].tolist() == [
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]],
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]],
    ]
    # the logits read: each prompt's last position (for every completion's first token) and each completion's own
    # tokens but its last; each target of the unshared rows, in their order, picks one of them
    assert shared.keep.int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]]
    assert shared.picks.tolist() == [0, 1, 0, 2, 2, 3, 4]
    targets = batch["labels"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    kept = shared.inputs["input_ids"][shared.keep]
    assert targets.tolist() == [8, 9, 10, 13, 14, 15, 16] and kept[shared.picks[1:2]].tolist() == [8]


def test_padding_attends_to_itself_and_eager_attention_gets_an_additive_mask():
    batch = _rows([[5, 6, 7, 4], [11, 12, 13, 4]], [[8], [9], [1], [2]], group=2)
    batch["input_ids"], batch["labels"], batch["attention_mask"] = (
        t[:, :5] for t in (batch["input_ids"], batch["labels"], batch["attention_mask"])
    )
    shared = shared_rows(batch, Sharing(2, additive=True, window=None, dtype=torch.bfloat16))
    assert shared is not None and shared.inputs["attention_mask"].dtype == torch.bfloat16  # the scores' own dtype
    allowed = shared.inputs["attention_mask"][:, 0] == 0
    assert bool(allowed.any(-1).all())  # every query, padding too, has a key: no empty softmax row
    assert float(shared.inputs["attention_mask"].min()) == torch.finfo(torch.bfloat16).min
    assert allowed.int().tolist() == (shared_rows(batch, Sharing(2, False, None)).inputs["attention_mask"][:, 0]).int().tolist()


def test_sharing_is_refused_where_it_would_cost_more_or_change_the_rows():
    how = Sharing(2, additive=False, window=None)
    long_prompts = _rows([[5] * 12, [6] * 12], [[8], [9, 9], [7], [7, 7]], group=2)
    assert shared_rows(long_prompts, how) is not None
    # completions as long as their prompts: one row of (prompt + 2 completions)^2 scores costs more than two rows
    assert shared_rows(_rows([[5, 6], [7, 8]], [[1] * 6, [2] * 6, [3] * 6, [4] * 6], group=2), how) is None
    # two prompts in one group (rows that are not a GRPO group's), rows not a multiple of the group
    assert shared_rows(long_prompts, Sharing(4, additive=False, window=None)) is None
    assert shared_rows({k: v[1:] for k, v in long_prompts.items()}, how) is None
    mixed = {k: v.clone() for k, v in long_prompts.items()}
    mixed["input_ids"][1, 3] = 4  # the group's second row has another prompt
    assert shared_rows(mixed, how) is None
    # a context-parallel part, a sliding window narrower than a row (the mask does not window)
    assert shared_rows({**long_prompts, "context_part": object()}, how) is None
    assert shared_rows(long_prompts, Sharing(2, additive=False, window=8)) is None
    assert shared_rows(long_prompts, Sharing(2, additive=False, window=64)) is not None


def test_only_softmax_attention_models_under_sdpa_or_eager_share():
    import transformers

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, attn_implementation="sdpa"))
    assert sharing_for(llama, 4) == Sharing(4, additive=False, window=None) and sharing_for(llama, 1) is None
    llama.set_attn_implementation("eager")
    assert sharing_for(llama, 4) == Sharing(4, additive=True, window=None)  # (fp32 weights: an fp32 mask)
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(**small, num_key_value_heads=2, sliding_window=16, attn_implementation="sdpa")
    )
    assert sharing_for(mistral, 4) == Sharing(4, additive=False, window=16)
    cfg = transformers.Qwen3NextConfig(**small, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2,
                                       linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                                       num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                       layer_types=["linear_attention"])  # fmt: skip
    assert sharing_for(transformers.Qwen3NextForCausalLM(cfg), 4) is None  # a recurrent state reads every completion


def test_a_vision_language_models_window_alibi_and_a_router_loss_are_read_where_they_are():
    import transformers
    from vlm_models import BUILDERS

    gemma3 = BUILDERS["gemma3"]()[0]  # its sliding window (64) in text_config, sliding and full layers
    assert sharing_for(gemma3, 4) == Sharing(4, additive=gemma3.config._attn_implementation == "eager", window=64)
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(**small, alibi=True))  # biases from a 2-D mask
    moe = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **small,
            intermediate_size=64,
            num_key_value_heads=2,
            num_local_experts=2,
            num_experts_per_tok=1,
            output_router_logits=True,
        )  # fmt: skip
    )  # its load-balancing loss reads the 2-D mask
    assert sharing_for(falcon, 4) is None and sharing_for(moe, 4) is None
    moe.config.output_router_logits = False
    assert sharing_for(moe, 4) is not None


def test_a_model_that_misreads_the_mask_fails_the_probe_and_trains_on_its_rows():
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # causal attention whatever the mask says: each completion reads the completions before it
    AttentionInterface.register("causal_only", lambda m, q, k, v, mask, **kw: sdpa_attention_forward(m, q, k, v, None, **kw))
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, attn_implementation="sdpa"))
    assert holds_on(llama, Sharing(4, additive=False, window=None))
    llama.set_attn_implementation("causal_only")
    assert not holds_on(llama, Sharing(4, additive=False, window=None))
    # positions that run on through the row whatever position_ids say: the completions sit at the wrong distances
    llama.set_attn_implementation("sdpa")
    rope = llama.model.rotary_emb.forward
    llama.model.rotary_emb.forward = lambda x, position_ids, **k: rope(x, torch.arange(x.shape[1])[None], **k)
    assert not holds_on(llama, Sharing(4, additive=False, window=None))


@pytest.fixture(scope="module")
def demo_trainer(tmp_path_factory):
    """The bundled demo model as grpo-demo-cpu loads it (NF4, double quant, r 16 on every linear), fp32."""
    from conftest import tiny_recipe, write_jsonl

    tmp = tmp_path_factory.mktemp("sharing")
    data = grpo_recipe(tiny_recipe(tmp, write_jsonl(tmp / "a.jsonl", [{"instruction": "a", "output": "b"}])), tmp)
    data |= {"model": {"path": "asset:tiny-llama"}, "output_dir": str(tmp / "run")}
    data["quant"] = {"bits": 4, "quant_type": "nf4", "double_quant": True}
    data["lora"] = {"r": 16, "alpha": 32, "dropout": 0.0, "target": "all-linear"}
    trainer = Trainer(build_recipe(data), progress=False)
    trainer.setup()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter's B (not zeros): every adapter tensor gets a gradient
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    yield trainer
    trainer.close()


def _long_prompt_batch(trainer) -> dict[str, torch.Tensor]:
    """Two groups of 4: prompts of 19 and 17 tokens (one left-padded), completions of 1-6 tokens."""
    tok = trainer.tokenizer
    texts = ["Repeat the words: ship snow car pen door lamp tree\nAnswer:", "Add 12 and 30, then say it:"]
    prompts = [tok(t)["input_ids"] for t in texts]
    g = torch.Generator().manual_seed(0)
    lengths = [3, 6, 1, 4, 5, 2, 6, 3]
    completions = [torch.randint(5, len(tok) - 1, (n,), generator=g).tolist() for n in lengths]
    batch = _rows(prompts, completions, group=4)
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, 0.5, -1.0, 0.0])
    batch["sample_sums"] = {}
    return batch


def _loss_and_grads(trainer, batch, sharing, memory: tuple[str, int] = ("full", 0)):
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    kept = (loss.sharing, loss.chunk_rows, loss.chunk_only_above)  # the trainer's own, put back after
    loss.sharing = sharing
    loss.use_memory(*memory, torch.device("cpu"), sharded=False)
    try:
        return _loss_and_grads_now(model, loss, batch)
    finally:
        loss.sharing, loss.chunk_rows, loss.chunk_only_above = kept


def _loss_and_grads_now(model, loss, batch):
    model.zero_grad()
    value, _ = loss(model, batch)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(value), grads


def test_the_demo_model_scores_a_shared_prompt_as_its_rows_with_the_same_gradients(demo_trainer):
    trainer, batch = demo_trainer, _long_prompt_batch(demo_trainer)
    model, how = trainer.parallel.unwrap(trainer.model), trainer.loss_fn.sharing
    assert how == Sharing(4, additive=False, window=None)  # fit() found the demo model (sdpa) can share
    shapes: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    with torch.no_grad():
        shared, mask = completion_logps(model, batch, 0.7, True, how)
        rows, _ = completion_logps(model, batch, 0.7, True, None)
    hook.remove()
    assert shapes[0] == (2, 19 + 14) and shapes[1] == tuple(batch["input_ids"].shape)  # each prompt once, then 8 rows
    torch.testing.assert_close(shared, rows, rtol=1e-5, atol=1e-5)
    assert bool((shared[mask] < 0).all()) and int(mask.sum()) == 30
    with torch.no_grad():  # a model without a boolean logits_to_keep: every position's logits, the kept ones read
        every, _ = completion_logps(model, batch, 0.7, False, how)
    torch.testing.assert_close(every, rows, rtol=1e-5, atol=1e-5)
    loss_shared, grads_shared = _loss_and_grads(trainer, batch, how)
    loss_rows, grads_rows = _loss_and_grads(trainer, batch, None)
    assert abs(loss_shared - loss_rows) < 1e-6 and len(grads_shared) == len(grads_rows) == 7 * 4 * 2
    for name, g in grads_rows.items():  # (fp32 sums in another order: ~1e-5 of each tensor's largest, seen)
        assert float(g.abs().max()) > 0 and float((grads_shared[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()), name
    # Eager attention adds a float mask to its scores: the same log-probabilities again.
    base = model.get_base_model()
    base.set_attn_implementation("eager")
    try:
        eager = sharing_for(model, 4)
        with torch.no_grad():
            added, _ = completion_logps(model, batch, 0.7, True, eager)
    finally:
        base.set_attn_implementation("sdpa")
    assert eager is not None and eager.additive
    torch.testing.assert_close(added, rows, rtol=1e-5, atol=1e-5)
    # Negative control: let each completion also see the completions before it: their log-probabilities move.
    leaky = shared_rows(batch, how)
    leaky.inputs["attention_mask"] = torch.ones_like(leaky.inputs["attention_mask"]).tril()
    with torch.no_grad():
        logits = model(**leaky.inputs).logits[leaky.keep][leaky.picks]
    targets = batch["labels"][:, 1:][mask]
    moved = -torch.nn.functional.cross_entropy(logits / 0.7, targets, reduction="none")
    assert (moved - rows[mask]).abs().max() > 1e-2


def test_the_head_over_chunks_of_completion_tokens_scores_and_trains_as_the_whole_head(demo_trainer):
    trainer, batch = demo_trainer, _long_prompt_batch(demo_trainer)
    model = trainer.parallel.unwrap(trainer.model)
    how = sharing_for(model, 4)
    assert how is not None
    widths: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[0]))
    try:
        for sharing in (how, None):
            whole, grads = _loss_and_grads(trainer, batch, sharing)
            assert widths == [30 if sharing is None else 24]  # every completion token's logits at once (shared: 24 kept)
            widths.clear()
            trainer.loss_fn.head_checked = False
            chunked, chunked_grads = _loss_and_grads(trainer, batch, sharing, ("chunked", 7))
            # the one check of the head (the model's own logits of 1 row x 8 tokens, then the head's), then the 30
            # completion tokens in chunks: 7 7 7 7 2 in forward, recomputed in backward last chunk first
            assert widths == [1, 8, 7, 7, 7, 7, 2, 2, 7, 7, 7, 7], widths
            widths.clear()
            assert abs(chunked - whole) < 1e-6
            with torch.no_grad():  # at a sampling temperature too
                in_chunks, _ = completion_logps(model, batch, 0.7, True, sharing, chunk_rows=7)
                at_once, _ = completion_logps(model, batch, 0.7, True, sharing)
            torch.testing.assert_close(in_chunks, at_once, rtol=1e-5, atol=1e-5)
            widths.clear()
            for name, g in grads.items():
                assert float((chunked_grads[name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name
        # memory.loss=auto chunks only a micro-batch with more completion tokens than a chunk
        _loss_and_grads(trainer, batch, None, ("auto", 64))
        assert widths == [30]
    finally:
        hook.remove()


def test_dropout_or_context_parallelism_keep_the_training_forward_on_its_rows(demo_trainer):
    trainer, batch = demo_trainer, _long_prompt_batch(demo_trainer)
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    widths: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: widths.append(i[0].shape[0]))
    kept = (loss.sharing, loss.dropout, loss.row_group)

    class Wrapped(torch.nn.Module):  # as DDP holds it: no config of its own, the model as .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    try:
        with torch.no_grad():
            loss.logps(Wrapped(model), batch)  # training mode, no dropout, through a wrapper: shared
            loss.dropout = True  # a LoRA dropout: one mask for a shared prompt would not be the rows' G masks
            loss.logps(model, batch)
            model.eval()
            loss.logps(model, batch)  # eval (the sampling policy's, the reference's): no dropout drawn, shared
            model.train()
            loss.use_rows(0, ("a context-parallel group", 0))  # each rank trains a part of every row
            loss.logps(model, batch)
        assert widths == [2, 8, 2, 8]
    finally:
        hook.remove()
        model.train()
        loss.sharing, loss.dropout, loss.row_group = kept


def test_a_model_that_fails_the_probe_at_the_first_forward_trains_on_its_rows_and_says_so(demo_trainer, monkeypatch):
    from finetune.objectives import grpo

    trainer, batch = demo_trainer, _long_prompt_batch(demo_trainer)
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    kept = (loss.sharing, loss.sharing_checked)
    probed: list[object] = []
    monkeypatch.setattr(grpo, "holds_on", lambda m, how: probed.append(m) or False)
    widths: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: widths.append(i[0].shape[0]))
    try:
        loss.sharing_checked = False
        with torch.no_grad(), pytest.warns(UserWarning, match="each completion trains on its own row"):
            loss.logps(model, batch)
        with torch.no_grad():
            loss.logps(model, batch)  # checked once
        assert probed == [model] and loss.sharing is None and widths == [8, 8]
    finally:
        hook.remove()
        loss.sharing, loss.sharing_checked = kept
