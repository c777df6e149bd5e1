"""Tensor parallelism (distributed.tensor_parallel) on CPU, gloo, a tiny Llama in 4-bit, fp32: each rank
reads and quantizes its share of every layer, and the group trains as one process does (losses, pre-clip
gradient norms, adapter), alone and with replicas; a checkpoint of one process resumes split. Through the
real launcher. Double quantization on, as the recipes quantize: each share is cut from the whole weight's
quantization (tensor.cut_shares_from_whole), so the base is one process's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_same_steps, build_char_tokenizer, build_tiny_llama, step_rows
from test_distributed import adapter, assert_adapters_close, finetune, run_driver, stopped_under_sigterm, write

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny Llama at hidden 128 (4 heads, 2 key/value heads, MLP 256: each 4-bit block of 64 stays in
    one rank's share), 2 micro-batches per step, clipping at a norm every step exceeds."""
    from conftest import ALPACA_ROWS, write_jsonl

    root = tmp_path_factory.mktemp("tensor")
    model = root / "model"
    model.mkdir()
    build_tiny_llama(model, vocab_size=len(build_char_tokenizer(model)), hidden=128, layers=2)
    recipe = {
        "model": {"path": str(model)},
        "data": {"path": str(write_jsonl(root / "train.jsonl", ALPACA_ROWS)), "format": "alpaca", "max_seq_len": 256},
        "seed": 0,
        "report": {"plot": False},  # no loss.png: ~0.5 s of matplotlib a run
        "precision": "fp32",
        "quant": {"bits": 4},  # double quant on (the default)
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {
            "max_steps": STEPS,
            "batch_size": 4,
            "grad_accum": 2,
            "lr": 1e-3,
            "max_grad_norm": 0.5,
            "scheduler": "constant",
        },
        "checkpoint": {"every_steps": 2},
    }
    return root, recipe


@pytest.fixture(scope="module")
def one_process(base) -> Path:
    root, recipe = base
    path, out = write(root, recipe, "one")
    finetune(str(path), cwd=root)
    return out


@pytest.mark.parametrize(
    "nproc, batch, sp, vocab",
    [(2, 4, False, False), (4, 2, False, False), (2, 4, True, False), (2, 4, True, True)],
    ids=["tp2", "tp2xdp2", "tp2-sp", "tp2-sp-vocab-streamed"],
)
def test_tensor_parallel_matches_one_process(base, one_process, nproc, batch, sp, vocab):
    # sp: sequence parallelism, each rank's norms and residual stream over half of every row's positions (rows
    # padded to an even length), all-gathered into the split linears and reduce-scattered out of them.
    # vocab: the embedding and the head split along the vocabulary, the loss from each rank's columns of the logits;
    # and each rank's share of the first layer streamed from host RAM, of the second kept (memory.device_layers).
    root, recipe = base
    split = {"tensor_parallel": 2, "sequence_parallel": sp, "vocab_parallel": vocab}
    memory = {"base_weights": "cpu", "device_layers": 1} if vocab else {}
    path, out = write(root, recipe, f"tp-{nproc}-{sp}-{vocab}", train__batch_size=batch, distributed=split, memory=memory)
    proc = finetune(str(path), "--nproc", str(nproc), cwd=root)
    if vocab:
        assert "of frozen decoder-layer weights live in CPU RAM" in proc.stdout
    replicas = "1 replica" if nproc == 2 else "2 replicas"
    vocabulary = ", the vocabulary's tables too" if vocab else ""
    assert f"parallel: tensor parallel, each decoder layer split over 2 processes x {replicas}{vocabulary}\n" in proc.stdout
    assert all(norm > 0.5 for _, norm in step_rows(one_process))  # every update clipped
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))  # gathered whole, as one process writes it


def test_pipeline_of_split_stages_matches_one_process(base, one_process):
    # pp=2 x tp=2 x dp=2 on 8 processes: each tensor-parallel rank of each replica runs a pipeline of its shares
    # (1 layer per stage) on half of every step's rows, the group's all-reduces inside each stage, the shares'
    # gradients summed over the replicas, the norm over all. The same global batch: 2 rows a replica.
    root, recipe = base
    distributed = {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "1f1b"}
    path, out = write(root, recipe, "pp2xtp2xdp2", distributed=distributed, train__batch_size=2)
    proc = finetune(str(path), "--nproc", "8", cwd=root)
    said = "parallel: pipeline: 2 stages of 1 layers over 2 processes x 2 tensor-parallel ranks (each layer split) x 2 replicas"
    assert said in proc.stdout
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))
    # Its checkpoint (stages' shares gathered whole, moments too) resumes on one process, and one
    # process's checkpoint resumes as split stages on 4 processes (held, then sliced for each tensor-parallel
    # rank, moments too): steps 3 and 4 as uninterrupted.
    later = [x for row in step_rows(one_process)[2:] for x in row]
    # (on one process the saved 2 rows a replica x 2 replicas become 2 rows x twice the micro-batches: trainer/order.py)
    alone, alone_out = write(root, recipe, "pp2xtp2xdp2-alone", train__batch_size=2, resume=str(out / "checkpoints" / "step-2"))
    finetune(str(alone), cwd=root)
    split, split_out = write(
        root, recipe, "alone-pp2xtp2", distributed=distributed, resume=str(one_process / "checkpoints" / "step-2")
    )
    finetune(str(split), "--nproc", "4", cwd=root)
    for resumed in (alone_out, split_out):
        assert [x for row in step_rows(resumed) for x in row] == pytest.approx(later, rel=1e-5)
        assert_adapters_close(adapter(one_process), adapter(resumed))


DRIVER = """
import os, sys
from finetune.config.schema import load_recipe
from finetune.parallel.tensor import TensorParallel
from finetune.trainer import Trainer

if os.environ.get("UNREDUCED"):  # sequence parallelism's reduce-scatter keeps each rank's partial sum
    import torch.distributed as dist
    dist.reduce_scatter = lambda out, parts, group=None: out.copy_(parts[dist.get_rank(group)])
if os.environ.get("UNSUMMED"):  # the whole LoRA tensors' partial gradients left unsummed over the group
    summed = TensorParallel.sum_gradients
    def unsummed(self, params):
        self.split_params = {id(p) for p in params}  # every tensor taken for a split one
        summed(self, params)
    TensorParallel.sum_gradients = unsummed
if os.environ.get("VOCAB_UNSUMMED"):  # the split head's input gradient left as each rank's columns' part
    import torch
    from finetune.parallel import vocab
    class Unsummed(torch.autograd.Function):  # the head's f without its all-reduce (tensor.py keeps its own)
        forward = staticmethod(lambda ctx, x, group: x.view_as(x))
        backward = staticmethod(lambda ctx, grad: (grad, None))
    vocab.ToGroup = Unsummed
if os.environ.get("REPLICAS_UNSUMMED"):  # a pipeline's stages never sum their gradients over the replicas
    from finetune.parallel import pipeline
    pipeline.sum_over = lambda params, group: None
Trainer(load_recipe(sys.argv[1]), progress=False).train()
"""


def test_pp_x_tp_replicas_whose_gradients_are_never_summed_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    distributed = {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "1f1b"}
    recipe, out = write(tmp_path, recipe_dict, "replicas", distributed=distributed, train__batch_size=2, train__max_steps=1)
    run_driver(tmp_path, DRIVER, recipe, nproc=8, REPLICAS_UNSUMMED="1")
    (loss_one, norm_one), (loss_bad, norm_bad) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_bad == pytest.approx(loss_one, rel=1e-5)  # each replica's forward is right, the loss summed over them
    assert norm_bad != pytest.approx(norm_one, rel=1e-3)  # each replica's gradient is of its own rows only


def test_a_gradient_not_summed_over_the_group_fails_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    recipe, out = write(tmp_path, recipe_dict, "unsummed", distributed={"tensor_parallel": 2})
    run_driver(tmp_path, DRIVER, recipe, UNSUMMED="1")
    (loss_one, norm_one), (loss_bad, norm_bad) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_bad == pytest.approx(loss_one, rel=1e-5)  # the first forward is the same
    assert norm_bad != pytest.approx(norm_one, rel=1e-3)  # its gradient is not
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one_process, out, rel=1e-5)


def test_positions_whose_partial_outputs_are_never_summed_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    split = {"tensor_parallel": 2, "sequence_parallel": True}
    recipe, out = write(tmp_path, recipe_dict, "unreduced", distributed=split, train__max_steps=1)
    run_driver(tmp_path, DRIVER, recipe, UNREDUCED="1")
    assert step_rows(out)[0][0] != pytest.approx(step_rows(one_process)[0][0], rel=1e-3)  # the forward itself


def test_a_split_head_whose_input_gradient_is_never_summed_fails_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    split = {"tensor_parallel": 2, "vocab_parallel": True}
    recipe, out = write(tmp_path, recipe_dict, "vocab-unsummed", distributed=split, train__max_steps=1)
    run_driver(tmp_path, DRIVER, recipe, VOCAB_UNSUMMED="1")
    (loss_one, norm_one), (loss_bad, norm_bad) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_bad == pytest.approx(loss_one, rel=1e-5)  # the loss is the group's
    assert norm_bad != pytest.approx(norm_one, rel=1e-3)  # the gradients below the head are not


def test_the_demo_model_with_its_tables_split_trains_and_generates_as_with_them_whole(tmp_path):
    # The bundled model and its recipe (double quant, tied tables, a 912-token BPE vocabulary whose targets fall in
    # both ranks' halves, greedy generation for the exact match) at tp2: the vocabulary split changes no number.
    demo = str(Path(__file__).parents[2] / "recipes" / "demo-cpu.yaml")
    keys = ["precision=fp32", "lora.dropout=0", "train.max_steps=2", "train.warmup_steps=0", "train.log_every_steps=1"]
    keys += ["eval.every_steps=2", "eval.max_new_tokens=8", "report.plot=false", "distributed.tensor_parallel=2"]
    whole = finetune(demo, *keys, f"output_dir={tmp_path / 'whole'}", "--nproc", "2", cwd=tmp_path)
    split = finetune(
        demo, *keys, "distributed.vocab_parallel=true", f"output_dir={tmp_path / 'split'}", "--nproc", "2", cwd=tmp_path
    )
    assert "the vocabulary's tables too" in split.stdout
    assert_same_steps(tmp_path / "whole", tmp_path / "split", rel=1e-5)
    said = [[line for line in p.stdout.splitlines() if "expected" in line or "exact match" in line] for p in (whole, split)]
    assert len(said[0]) >= 4 and said[0] == said[1]  # the same greedy answers before and after training


def test_dpo_split_over_two_ranks_matches_one_process(base, tmp_path):
    # Preference pairs: chosen and rejected in one forward, the reference with the adapter switched off on
    # every rank; the loss a mean over the step's pairs, its metrics counted once per group.
    from conftest import write_jsonl
    from test_preference_distributed import PAIRS

    _, recipe = base
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    dpo = {"data": {"path": str(pairs), "format": "preference", "max_seq_len": 64}, "train__objective": "dpo", "train__lr": 1e-2}
    one, one_out = write(tmp_path, recipe, "one", **dpo)
    finetune(str(one), cwd=tmp_path)
    # With sequence parallelism: a pair's rows padded to an even length, the log-probabilities of the gathered rows.
    split, out = write(tmp_path, recipe, "split", distributed={"tensor_parallel": 2, "sequence_parallel": True}, **dpo)
    finetune(str(split), "--nproc", "2", cwd=tmp_path)
    assert step_rows(one_out)[0][0] == pytest.approx(0.6931472, abs=1e-6)
    assert_same_steps(one_out, out, rel=1e-5)
    assert_adapters_close(adapter(one_out), adapter(out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"rewards/chosen"' in line]
    alone = [json.loads(line) for line in (one_out / "metrics.jsonl").read_text().splitlines() if '"rewards/chosen"' in line]
    assert [m["rewards/chosen"] for m in metrics] == pytest.approx([m["rewards/chosen"] for m in alone], rel=1e-4, abs=1e-6)


def test_sigterm_under_tensor_parallelism_resumes_under_a_pipeline(base, tmp_path):
    # Split tensors gathered whole into the checkpoint, read back as stages: the run ends where an
    # uninterrupted one-process run ends.
    root, recipe_dict = base
    total = 24
    recipe, out = write(tmp_path, recipe_dict, "moved", distributed={"tensor_parallel": 2})
    ref_recipe, ref = write(tmp_path, recipe_dict, "straight")
    finetune(str(ref_recipe), f"train.max_steps={total}", cwd=tmp_path)
    stopped = stopped_under_sigterm(recipe, out, tmp_path)
    assert stopped <= total - 4, stopped
    staged = ("distributed.tensor_parallel=1", "distributed.pipeline_parallel=2", f"train.max_steps={total}", "resume=auto")
    proc = finetune(str(recipe), "--nproc", "2", *staged, cwd=tmp_path)
    assert "resume: allowed change distributed.tensor_parallel: 2 -> 1" in proc.stdout
    assert "parallel: pipeline: 2 stages of 1 layers" in proc.stdout
    assert_adapters_close(adapter(ref), adapter(out))


def test_biased_layers_and_a_lora_on_the_head_train_as_one_process(base, tmp_path):
    # A row-parallel bias must be added once, not once per rank; a LoRA outside the split layers (the head)
    # has its whole gradient on every rank, which a sum over the group would multiply.
    from transformers import LlamaConfig, LlamaForCausalLM

    root, recipe = base
    biased = tmp_path / "biased"
    import torch

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(recipe["model"]["path"])
    config.attention_bias = config.mlp_bias = True
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random init leaves biases zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(biased)
    for f in Path(recipe["model"]["path"]).glob("tokenizer*"):
        (biased / f.name).write_bytes(f.read_bytes())
    lora = {**recipe["lora"], "target": ["q_proj", "o_proj", "up_proj", "down_proj", "lm_head"]}
    one, one_out = write(tmp_path, recipe, "one", model={"path": str(biased)}, lora=lora)
    finetune(str(one), cwd=tmp_path)
    split, out = write(tmp_path, recipe, "split", model={"path": str(biased)}, lora=lora, distributed={"tensor_parallel": 2})
    finetune(str(split), "--nproc", "2", cwd=tmp_path)
    assert_same_steps(one_out, out, rel=1e-5)
    # peft also saves the head's frozen base weight when one process writes the adapter; a gathered state
    # holds the trained tensors only (as under FSDP and a pipeline): the LoRA tensors are compared.
    mine, theirs = adapter(out), adapter(one_out)
    assert set(theirs) - set(mine) == {"base_model.model.lm_head.base_layer.weight"}
    assert_adapters_close({k: theirs[k] for k in mine}, mine)
