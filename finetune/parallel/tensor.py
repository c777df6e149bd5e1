"""Tensor parallelism (distributed.tensor_parallel): Megatron-LM's split of each decoder layer over the
ranks of a group, on a 4-bit base. torch's DTensor cannot hold bitsandbytes' Params4bit
(scripts/spikes/tensor_parallel_4bit.py), so the split is our own, and made before quantization:

    config = narrowed(text_config, tp)           # the model a rank builds: heads / tp, kv heads / tp, MLP / tp
    with sliced_reads(split_dim, rank, tp):      # model/partial.py: a rank reads only its rows or columns
        model = from_pretrained(..., config=config)   # bitsandbytes quantizes the rank's slice alone
    tensor = TensorParallel(accelerator, cfg, layout, text_config)   # the room, before loading: split()
    model = tensor.shard(model, dtype)           # the group's hooks; LoRA drawn as one process draws it

q, k, v, gate and up are column-parallel (their output features split: whole heads, a slice of the MLP),
o and down row-parallel (their input features split): attention and the MLP each run on a rank's share
and one all-reduce sums their outputs; the input's gradient is all-reduced in backward (Megatron's f and
g). Norms stay whole on every rank, the embeddings and the head too unless split along the vocabulary
(distributed.vocab_parallel, vocab.py). LoRA is split to match, so that the
group computes the unsplit model: a column-parallel layer keeps A whole and splits B by rows, a
row-parallel one splits A by columns and keeps B whole; each rank's part is what one process draws
(the same generator, whole shapes, then sliced), so checkpoints gather into one process's adapter.
The whole (replicated) LoRA tensors get partial gradients on each rank: they are summed over the group.
Ranks: tensor-parallel innermost, rank = replica x tp + tp_rank (a group's all-reduces stay in a node).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune.declarations.layout import COLUMN, ROW, Layout
from finetune.errors import ConfigError, TrainingError
from finetune.model.load import decoder_layers, head_owner, model_source
from finetune.model.partial import checkpoint_tensors, cut_from_whole, share_blocks, whole_blocks
from finetune.parallel.grads import clip_to, squares, sum_over
from finetune.parallel.mesh import dim_group, dims_group
from finetune.parallel.regions import FromGroup, ToGroup
from finetune.parallel.room import SplitRoom, refuse_fp16
from finetune.parallel.sequence import SequenceSplit, pad_rows
from finetune.parallel.vocab import split_vocabulary
from finetune.plan.terms import NF4_BLOCK


def split_dim(name: str) -> int | None:
    """The dimension a checkpoint tensor or parameter is split along over the group, or None: whole.
    `name` as the checkpoint or the (peft-wrapped) model names it."""
    parts = name.split(".")
    if ".layers." not in f".{name}" or len(parts) < 2:
        return None
    module = next((p for p in reversed(parts) if p in COLUMN or p in ROW), None)
    if module is None:
        return None
    if "lora_A" in parts:
        return 1 if module in ROW else None  # column-parallel A reads the whole input: whole
    if "lora_B" in parts:
        return 0 if module in COLUMN else None  # row-parallel B writes the whole output: whole
    if parts[-1] == "bias":
        return 0 if module in COLUMN else None
    return 0 if module in COLUMN else 1


def partial_gradient(name: str) -> bool:
    """Whether a whole (unsplit) LoRA tensor's gradient on one rank is only its share's part, to be summed over
    the group: A of a column-parallel layer (its input's gradient comes from every rank's rows) and B of a
    row-parallel one (every rank adds to its output). LoRA outside the split layers (lm_head, embeddings)
    sees the whole computation on every rank: its gradient is whole already."""
    parts = name.split(".")
    module = next((p for p in reversed(parts) if p in COLUMN or p in ROW), None)
    return ("lora_A" in parts and module in COLUMN) or ("lora_B" in parts and module in ROW)


VOCAB_KEYS = ("embed_tokens.weight", "lm_head.weight", "lm_head.bias")  # the checkpoint's vocabulary tables


def reads_vocab_rows(cfg: Any, config: Any, tp: int) -> bool:
    """distributed.vocab_parallel where tp divides the vocabulary: a rank reads only its rows of the tables at load
    (else it loads them whole and vocab.py cuts them after)."""
    return bool(cfg.distributed.vocab_parallel) and config.get_text_config().vocab_size % tp == 0


def narrowed(config: Any, tp: int, vocab: bool = False) -> Any:
    """The config each rank builds its model from: its share of the heads and of the MLP (vocab: of the vocabulary
    too, reads_vocab_rows); head_dim said explicitly (it would otherwise be recomputed from hidden_size / heads)."""
    out = copy.deepcopy(config)
    text = out.get_text_config()
    if vocab:
        text.vocab_size //= tp
    heads = text.num_attention_heads
    text.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    text.num_attention_heads = heads // tp
    text.num_key_value_heads = (getattr(text, "num_key_value_heads", None) or heads) // tp
    text.intermediate_size = text.intermediate_size // tp
    return out


def _split_linears(config: Any) -> dict[str, tuple[tuple[int, int], int]]:
    """Each split linear's whole weight shape (out, in) and the dimension its shares are cut along."""
    text = config.get_text_config()
    heads, hidden, inter = text.num_attention_heads, text.hidden_size, text.intermediate_size
    kv, hd = getattr(text, "num_key_value_heads", None) or heads, getattr(text, "head_dim", None) or hidden // heads
    return {
        "q_proj": ((heads * hd, hidden), 0),
        "k_proj": ((kv * hd, hidden), 0),
        "v_proj": ((kv * hd, hidden), 0),
        "o_proj": ((hidden, heads * hd), 1),
        "gate_proj": ((inter, hidden), 0),
        "up_proj": ((inter, hidden), 0),
        "down_proj": ((hidden, inter), 1),
    }


def inexact_shares(config: Any, tp: int) -> list[str]:
    """The split linears whose shares over tp ranks are not whole blocks of the whole weight's 4-bit quantization:
    each rank quantizes its own share of those, so the base differs from one process's (e.g. 'o_proj (80 columns)')."""
    return [
        f"{name} ({shape[dim] // tp} {'rows' if dim == 0 else 'columns'})"
        for name, (shape, dim) in _split_linears(config).items()
        if not whole_blocks(shape, dim, tp, NF4_BLOCK)
    ]


def exactness_note(config: Any, tp: int) -> str | None:
    """What a 4-bit tensor-parallel run says before loading when its shares cannot be one process's quantization."""
    inexact = inexact_shares(config, tp)
    if not inexact:
        return None
    exact = [t for t in range(2, 9) if not problems(config, t) and not inexact_shares(config, t)]
    return (
        f"note: distributed.tensor_parallel={tp}: the shares of {', '.join(inexact)} are not whole {NF4_BLOCK}-element "
        "blocks of the whole weights' 4-bit quantization, so each rank quantizes its own and the base differs from "
        f"one process's; tensor_parallel values exact for this model: {', '.join(map(str, exact)) or 'none'}"
    )


def problems(config: Any, tp: int) -> list[str]:
    """What does not split over `tp` ranks in this model's config (heads, kv heads, the MLP)."""
    text = config.get_text_config()
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    out = []
    for what, n in (("attention heads", heads), ("key/value heads", kv), ("MLP intermediate size", text.intermediate_size)):
        if n % tp:
            fits = [d for d in range(2, n + 1) if heads % d == 0 and kv % d == 0 and text.intermediate_size % d == 0][:5]
            out.append(
                f"distributed.tensor_parallel={tp}: the model's {n} {what} do not split into {tp}; values that "
                f"split heads, key/value heads and the MLP: {', '.join(map(str, fits)) or 'none'}"
            )
    return out


def cut_shares_from_whole(model: nn.Module, cfg: Any, tp: int, tp_rank: int) -> None:
    """Each split 4-bit weight whose shares are whole blocks replaced by this rank's blocks of the whole weight's
    quantization (read whole from the checkpoint, one weight at a time, each file opened once): the group's base is
    one process's, bit for bit, double quant included. The others (exactness_note said which) stay as this rank
    quantized them."""
    from safetensors import safe_open

    files = checkpoint_tensors(model_source(cfg), cfg.model.revision)
    cuts: dict[Any, list[tuple[str, Any, torch.Tensor]]] = {}  # file -> (key, weight, its blocks)
    seen: set[int] = set()  # peft's wrapper answers .weight with its base layer's: cut each weight once
    for name, module in model.named_modules():
        weight: Any = getattr(module, "weight", None)
        if type(weight).__name__ != "Params4bit" or weight.is_meta or id(weight) in seen:  # is_meta: another stage's
            continue
        seen.add(id(weight))
        key = name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
        dim = split_dim(key)
        rows, cols = weight.quant_state.shape
        whole_shape = (rows * tp, cols) if dim == 0 else (rows, cols * tp)
        blocks = share_blocks(whole_shape, dim, tp_rank, tp, NF4_BLOCK) if dim is not None else None
        if blocks is not None and key in files:
            cuts.setdefault(files[key], []).append((key, weight, blocks))
    for path, weights in cuts.items():
        with safe_open(str(path), framework="pt") as f:
            for key, weight, blocks in weights:
                cut_from_whole(weight, f.get_tensor(key), blocks)


class TensorParallel(SplitRoom):
    """This rank's share of every decoder layer, and what the loop asks of it (gradients, norm, states)."""

    name = "tensor"
    trains_alone = True  # each rank streams its own share of the layers (memory.base_weights=cpu), as one process

    def __init__(self, accelerator, cfg: Any, layout: Layout, model_config: Any, mesh: Any = None) -> None:
        super().__init__(accelerator, cfg, layout, mesh)
        self.tp, self.tp_rank, self.replicas, self.device = layout.tp, layout.tp_rank, layout.replicas, accelerator.device
        self.model_config = model_config  # the whole model's (text) config.json
        note = exactness_note(model_config, self.tp) if cfg.quant.bits == 4 and model_config is not None else None
        if note and accelerator.is_main_process:
            print(note, flush=True)  # before any weight loads

    @classmethod
    def build(cls, accelerator, cfg: Any, layout: Layout, model_config: Any, mesh: Any) -> TensorParallel:
        return cls(accelerator, cfg, layout, model_config, mesh)

    def describe(self) -> str:
        many = f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        vocab = ", the vocabulary's tables too" if self.cfg.distributed.vocab_parallel else ""
        return f"parallel: tensor parallel, each decoder layer split over {self.tp} processes x {many}{vocab}"

    def split(self) -> Any:
        """This rank's reading: its share of every split weight, its narrowed config."""
        from transformers import AutoConfig

        from finetune.model.partial import Split

        cfg = self.cfg
        whole = AutoConfig.from_pretrained(
            model_source(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
        if not reads_vocab_rows(cfg, whole, self.tp):
            return Split(split_dim, self.tp_rank, self.tp, narrowed(whole, self.tp))
        rows = lambda name: 0 if name.endswith(VOCAB_KEYS) else split_dim(name)  # noqa: E731 - the tables by rows too
        return Split(rows, self.tp_rank, self.tp, narrowed(whole, self.tp, vocab=True))

    def loaded(self, model: Any) -> None:
        """The shares cut from the whole weights' quantization, before memory.base_weights may stream them.
        Without double quant a share of whole blocks quantizes alone as the whole does (its blocks' own absmax):
        only double quant's offset and groups belong to the whole tensor, so only then is the whole read."""
        if self.cfg.quant.bits == 4 and self.cfg.quant.double_quant:
            cut_shares_from_whole(model, self.cfg, self.tp, self.tp_rank)
        owner: Any = head_owner(model)
        if owner is not None and self.model_config is not None:  # read as 1/tp of the vocabulary: it is still the whole's
            owner.config.get_text_config().vocab_size = self.model_config.vocab_size

    def shard(self, model: Any, compute_dtype: torch.dtype) -> Any:
        """This rank's share of each layer (loaded split), its LoRA drawn as one process's."""
        refuse_fp16(self.cfg, compute_dtype)
        config = model.config.get_text_config()
        if config.num_attention_heads * self.tp != getattr(self.model_config, "num_attention_heads", None):
            raise ConfigError(
                [
                    f"distributed.tensor_parallel={self.tp}: the model was not loaded split (a model given in memory "
                    "holds every head); let the trainer load it from model.path, or set distributed.tensor_parallel=1"
                ]
            )
        self._attach(model)
        draw_lora_as_one_process(model, self, self.cfg.seed)
        model.finetune_local_slice = self.local  # a checkpoint's whole tensors, sliced
        return model

    def _attach(self, model: nn.Module) -> None:
        """The group's process groups, the row-parallel biases added once, f and g around attention and MLP."""
        self.group = dim_group(self.mesh, "tp")
        # The ranks holding this share: other replicas' rows, other context-parallel parts of them. Under a pipeline
        # the replicas of a stage's share are summed by the pipeline (parallel/pipeline.py).
        self.replica_group = None if self.layout.pipelined else dims_group(self.mesh, ("dp", "cp"))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.split_params = {id(p) for n, p in named if split_dim(n) is not None}
        self.partial = {id(p) for n, p in named if partial_gradient(n)}
        self.names = {id(p): n for n, p in named}
        if self.tp_rank:  # a row-parallel layer's bias is added once, by the first rank: the group's sum adds the others'
            with torch.no_grad():
                for name, module in model.named_modules():
                    leaf = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
                    if leaf in ROW and not name.endswith(("lora_A", "lora_B")) and getattr(module, "bias", None) is not None:
                        module.bias.zero_()
        self.hooks = []
        # distributed.sequence_parallel: its hooks, registered first, take the layers' forwards whose batch it padded
        self.sequence = SequenceSplit(self.group) if self.cfg.distributed.sequence_parallel else None
        if self.sequence is not None:
            first = decoder_layers(model, "distributed.sequence_parallel", "set distributed.sequence_parallel=false")[0]
            self.hooks.append(first.register_forward_pre_hook(self.sequence.first_layer_in, with_kwargs=True))
            owner: Any = head_owner(model)
            self.hooks.append(owner.get_decoder().norm.register_forward_hook(self.sequence.after_norm))
        if self.cfg.distributed.vocab_parallel:  # the tables cut to this rank's vocabulary rows
            self.hooks += split_vocabulary(model, self.group, self.model_config.vocab_size)
        for name, module in model.named_modules():
            if name.endswith(".self_attn") or name.endswith(".mlp"):
                if self.sequence is not None:
                    into = self.sequence.attention_in if name.endswith(".self_attn") else self.sequence.mlp_in
                    self.hooks.append(module.register_forward_pre_hook(into, with_kwargs=True))
                    self.hooks.append(module.register_forward_hook(self.sequence.from_shares))
                self.hooks.append(module.register_forward_pre_hook(self._into, with_kwargs=True))
                self.hooks.append(module.register_forward_hook(self._out))

    def local_part(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch padded to split its rows' positions over the group (sequence parallelism), else as it is."""
        return pad_rows(batch, self.tp) if self.cfg.distributed.sequence_parallel else batch

    def _into(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.sequence is not None and self.sequence.active:
            return None  # gathered by the sequence split's own hook
        if args:
            return (ToGroup.apply(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": ToGroup.apply(kwargs["hidden_states"], self.group)}

    def _out(self, module: nn.Module, args: tuple, output: Any):
        if self.sequence is not None and self.sequence.active:
            return None  # reduce-scattered by the sequence split's own hook
        if isinstance(output, tuple):  # attention: (output, weights)
            return (FromGroup.apply(output[0], self.group), *output[1:])
        return FromGroup.apply(output, self.group)

    # ------------------------------------------------------------------ the step

    @property
    def counts_window(self) -> bool:
        return self.tp_rank == 0  # the group's ranks hold one window and compute one loss: its first counts it

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        self.sum_gradients(params)  # (a name of its own: a pipeline of shares calls it for its group)

    def sum_gradients(self, params: list[nn.Parameter]) -> None:
        """The whole LoRA tensors whose gradient is a share's part summed over the group (partial_gradient);
        then every gradient summed over the replicas (other examples), unless a pipeline sums them."""
        sum_over([p for p in params if id(p) in self.partial], self.group)
        if self.replica_group is not None:
            sum_over(params, self.replica_group)

    def squares(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The sum of the group's gradient squares: split tensors' summed over the group, whole ones once."""
        split = squares([p for p in params if id(p) in self.split_params], self.device)
        dist.all_reduce(split, group=self.group)
        return split + squares([p for p in params if id(p) not in self.split_params], self.device)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The whole gradient's norm, and clipping to max_norm with it by torch's rule."""
        self.accelerator.unscale_gradients()  # fp16: the GradScaler's factor out first, as accelerate does
        return clip_to(params, float(self.squares(params).sqrt()), max_norm)

    # ------------------------------------------------------------------ whole states for a checkpoint

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        unwrapped = self.unwrap(model)
        return self.whole_trainable_state(unwrapped), self.whole_optimizer_state(unwrapped, optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return self.whole_trainable_state(model)

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor of `name` whole: the group's slices concatenated (a collective), or itself."""
        dim = split_dim(name)
        if dim is None or t.dim() == 0:
            return t.detach().cpu()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=dim).cpu()

    def whole_trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """{name: whole tensor on CPU} of every trained parameter on rank 0 (every rank calls)."""
        out = {n: self.whole(n, p) for n, p in model.named_parameters() if p.requires_grad}
        return out if dist.get_rank() == 0 else None

    def whole_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """The optimizer state whole (moments of split tensors gathered), on rank 0; one process's numbering:
        every rank holds every trainable parameter, in the same order."""
        sd = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]  # the state's numbering
        names = [self.names.get(id(p), "") for p in params]
        if len(sd["param_groups"]) != 1:
            raise TrainingError(
                f"distributed.tensor_parallel checkpoints an optimizer with one parameter group; this one has {len(sd['param_groups'])}",
                hint="pass an optimizer with one group, or set distributed.tensor_parallel=1",
            )
        state = {
            i: {k: (self.whole(names[i], v) if torch.is_tensor(v) and v.dim() else v) for k, v in sorted(s.items())}
            for i, s in sorted(sd["state"].items())
        }
        return {"state": state, "param_groups": sd["param_groups"]} if dist.get_rank() == 0 else None

    def local(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole tensor of `name` (a checkpoint's, or one process's draw)."""
        dim = split_dim(name)
        if dim is None or whole.dim() == 0:
            return whole
        n = whole.shape[dim] // self.tp
        return whole.narrow(dim, self.tp_rank * n, n)


def draw_lora_as_one_process(model: nn.Module, tensor: TensorParallel, seed: int) -> None:
    """Each rank's LoRA tensors set to its share of what one process draws (peft's order per layer: A and B
    built as nn.Linear, then A by kaiming_uniform_ and B zero): the group is the unsplit adapter, and a
    checkpoint gathers into one process's. The generator is left where one process's would be."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            a_layers: Any = getattr(module, "lora_A", None)
            b_layers: Any = getattr(module, "lora_B", None)
            if not isinstance(a_layers, nn.ModuleDict) or not a_layers:
                continue
            for adapter, a_module in a_layers.items():
                a: Any = a_module
                b = b_layers[adapter]
                a_name, b_name = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
                whole_in = int(a.in_features) * (tensor.tp if split_dim(a_name) == 1 else 1)
                whole_out = int(b.out_features) * (tensor.tp if split_dim(b_name) == 0 else 1)
                full_a = nn.Linear(whole_in, int(a.out_features), bias=False).weight
                nn.Linear(int(b.in_features), whole_out, bias=False)  # peft builds B this way too: its draws
                nn.init.kaiming_uniform_(full_a, a=math.sqrt(5))
                a.weight.copy_(tensor.local(a_name, full_a))
                b.weight.zero_()
