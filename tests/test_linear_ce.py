"""Chunked linear cross-entropy equals the full logits path: loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from finetune.memory.linear_ce import CaptureHead, chunked_linear_cross_entropy, chunked_token_logps, logits_transform


def full_and_chunked(head, hidden, targets, chunk, transform=None):
    """(loss, grads) of the full path and of the chunked one, from the same inputs."""
    results = []
    for chunked in (False, True):
        h = hidden.detach().clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            loss = chunked_linear_cross_entropy(h, head, targets, chunk, transform)
        else:
            logits = head(h)
            logits = transform(logits) if transform else logits
            loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        loss.backward()
        grads = {"hidden": h.grad.clone(), **{n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}}
        results.append((loss.detach(), grads))
    return results


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_loss_and_gradients_equal_the_full_logits(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 101, bias=False)
    hidden, targets = torch.randn(64, 32), torch.randint(0, 101, (64,))
    (full, gf), (chunked, gc) = full_and_chunked(head, hidden, targets, chunk)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)
    assert gf.keys() == gc.keys() == {"hidden", "weight"}
    for name in gf:
        torch.testing.assert_close(gc[name], gf[name], rtol=1e-5, atol=1e-7)


def test_lora_on_the_head_gets_the_same_gradients():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(16, 50, bias=True)

    model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.0))
    head = model.base_model.model.lm_head
    with torch.no_grad():  # B starts at zero: move it so A's gradient is not trivially zero
        head.lora_B["default"].weight.normal_()
    hidden, targets = torch.randn(40, 16), torch.randint(0, 50, (40,))
    (full, gf), (chunked, gc) = full_and_chunked(head, hidden, targets, 9)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)
    assert {"lora_A.default.weight", "lora_B.default.weight", "hidden"} <= gc.keys() and gf.keys() == gc.keys()
    for name in gf:
        torch.testing.assert_close(gc[name], gf[name], rtol=1e-5, atol=1e-7)


def test_soft_capping_of_the_model_is_applied_per_chunk():
    class Cfg:
        final_logit_softcapping = 5.0

    transform = logits_transform(Cfg())
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 30, bias=False)
    with torch.no_grad():
        head.weight.mul_(20)  # logits far beyond the cap, so capping changes the loss
    hidden, targets = torch.randn(20, 8), torch.randint(0, 30, (20,))
    (full, gf), (chunked, gc) = full_and_chunked(head, hidden, targets, 6, transform)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)
    uncapped = F.cross_entropy(head(hidden).float(), targets, reduction="sum").detach()
    assert abs(float(uncapped) - float(full)) > 1.0
    torch.testing.assert_close(gc["hidden"], gf["hidden"], rtol=1e-5, atol=1e-7)

    class Plain:
        pass

    assert logits_transform(Plain()) is None


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_each_tokens_log_probability_chunked_equals_the_full_softmax_with_its_gradients(chunk):
    # GRPO's per-token terms: weights of either sign on each token's log-probability, at a temperature, soft-capped
    class Cfg:
        final_logit_softcapping = 5.0

    torch.manual_seed(3)
    head = torch.nn.Linear(16, 61, bias=True)
    with torch.no_grad():
        head.weight.mul_(10)
    hidden, targets, weights = torch.randn(30, 16), torch.randint(0, 61, (30,)), torch.randn(30)
    transform = logits_transform(Cfg())
    results = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            logps = chunked_token_logps(h, head, targets, chunk, transform, temperature=0.7)
        else:
            logps = F.log_softmax(transform(head(h)).float() / 0.7, dim=-1).gather(1, targets[:, None]).squeeze(1)
        (logps * weights).sum().backward()
        results.append((logps.detach(), h.grad, head.weight.grad, head.bias.grad))
    for chunked, full in zip(results[1], results[0]):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    plain = F.log_softmax(head(hidden).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert (plain - results[0][0]).abs().max() > 0.1  # the cap and the temperature matter here


def test_no_targets_gives_a_zero_loss_that_backpropagates():
    head = torch.nn.Linear(4, 10)
    h = torch.randn(0, 4, requires_grad=True)
    loss = chunked_linear_cross_entropy(h, head, torch.zeros(0, dtype=torch.long), 8)
    loss.backward()
    assert float(loss.detach()) == 0.0 and h.grad.shape == (0, 4)
    # The head's own parameters get zeros, as the full path gives them, not None: FSDP reduce-scatters only the
    # gradients that exist, so a rank without targets would leave the others waiting.
    assert torch.equal(head.weight.grad, torch.zeros(10, 4)) and torch.equal(head.bias.grad, torch.zeros(10))


def test_capture_head_keeps_the_states_and_returns_no_logits():
    capture = CaptureHead()
    h = torch.randn(3, 5, 16)
    out = capture(h)
    assert out.shape == (3, 5, 0) and capture.hidden is h
    assert out.grad_fn is None  # h is a leaf without grad: nothing to hang a graph on
    out = capture(h.requires_grad_())
    assert out.grad_fn is not None  # in the graph: FSDP's root hooks its backward on the forward's output


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_trainer_loss_chunked_equals_the_target_only_head(recipe_dict, tmp_path, packing):
    # The real model path: ignore_index prompt positions, padded or packed rows, LoRA on the
    # head too (lm_head targeted). Loss and every LoRA gradient equal within fp32 rounding.
    import json

    from finetune.config.schema import build_recipe
    from finetune.trainer import CausalLMLoss, Trainer

    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(tmp_path / "run")
    data["lora"].update(dropout=0.0, target=["q_proj", "v_proj", "down_proj", "lm_head"])
    data["data"]["packing"] = packing
    trainer = Trainer(build_recipe(data), progress=False)
    trainer.setup()
    model, batch = trainer.model, trainer.step_batches(0)[0]
    assert ("position_ids" in batch) == packing

    def loss_and_grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss, n = loss_fn(model, batch)
        loss.backward()
        return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    whole, n_whole, g_whole = loss_and_grads(CausalLMLoss())
    chunked_fn = CausalLMLoss(chunk_rows=7)
    chunked, n_chunked, g_chunked = loss_and_grads(chunked_fn)
    assert chunked_fn.chunked_batches == 1 and n_chunked == n_whole > 7
    assert any("lm_head.lora" in k for k in g_whole)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    assert g_whole.keys() == g_chunked.keys()
    # Summation order differs (chunks): elements near zero get an absolute floor of 1e-6; a
    # wrong mask or a missing chunk moves gradients by orders of magnitude more.
    for name in g_whole:
        torch.testing.assert_close(g_chunked[name], g_whole[name], rtol=1e-5, atol=1e-6)
    # auto: a batch whose targets fit one chunk takes the one-matmul path.
    small = CausalLMLoss(chunk_rows=10_000, chunk_only_above=True)
    loss_and_grads(small)
    assert small.chunked_batches == 0


def test_a_model_whose_logits_the_chunked_head_cannot_reproduce_trains_on_the_full_logits(recipe_dict, tmp_path):
    # A config that claims soft-capping its Llama forward never applies: the probe against the
    # model's own logits catches the mismatch and the loss falls back, with a warning.
    import json

    from finetune.config.schema import build_recipe
    from finetune.trainer import CausalLMLoss, Trainer

    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(tmp_path / "run")
    data["lora"]["dropout"] = 0.0
    trainer = Trainer(build_recipe(data), progress=False)
    trainer.setup()
    model, batch = trainer.model, trainer.step_batches(0)[0]
    whole, n = CausalLMLoss()(model, batch)
    model.base_model.model.config.final_logit_softcapping = 5.0  # what logits_transform reads; Llama ignores it
    chunked = CausalLMLoss(chunk_rows=7)
    with pytest.warns(UserWarning, match="LlamaForCausalLM post-processes its logits"):
        loss, n2 = chunked(model, batch)
    assert chunked.checked and chunked.chunk_rows is None and chunked.chunked_batches == 0
    assert n2 == n and torch.equal(loss.detach(), whole.detach())
