"""Tiled MLP: each decoder layer's MLP runs over tiles of the sequence, each tile a checkpoint.

    tiles = tile_mlps(model, "auto")      # memory.tiled_mlp: auto | off | N

A gated MLP's intermediate is (tokens x intermediate_size) three times over (gate, its
SiLU, up): at 32k tokens of an 8B model, 3 x 32k x 14,336 x 2 bytes = 2.6 GiB for one
layer, alive while the layer runs forward, again while activation checkpointing
recomputes it, and kept whole for backward when the layer is not checkpointed. The MLP
works on each position alone, so it can run tile by tile along the sequence; each tile
is a checkpoint, so only one tile's intermediate ever exists, in forward and in backward
(which recomputes it). Outputs and gradients equal the whole MLP's within fp32 rounding.
Arctic Long Sequence Training's TiledMLP is the reference; this is our own, on
torch.utils.checkpoint, and it leaves the module tree (and adapter names) untouched.

`auto` tiles sequences longer than AUTO_TILE_TOKENS (or the hidden size, if larger) into
tiles of that many positions (ALST tiles by the hidden size: a tile's intermediate is then
a few times the layer's input); shorter ones run whole, as before. Mixture-of-experts
blocks are left alone (their router statistics are per call).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from finetune.errors import ModelError
from finetune.model.load import base_of, decoder_layers

AUTO_TILE_TOKENS = 4096  # below this a whole MLP's intermediate is small next to the rest (8B: ~340 MiB)


def tiles_for(setting: str | int, seq_len: int, hidden: int) -> int:
    """How many tiles memory.tiled_mlp asks for at this sequence length (1: the MLP runs whole)."""
    if setting == "off":
        return 1
    if setting == "auto":
        return max(1, math.ceil(seq_len / max(AUTO_TILE_TOKENS, hidden)))
    return max(1, min(int(setting), seq_len))


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], setting: str | int, hidden: int):
    def tiled_forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        n = tiles_for(setting, x.shape[-2], hidden)
        if n <= 1 or args or kwargs:  # an MLP that takes more than the hidden states runs whole
            return forward(x, *args, **kwargs)
        chunks = x.split(math.ceil(x.shape[-2] / n), dim=-2)
        if not torch.is_grad_enabled():  # eval and generation: nothing is saved, only the tile at a time
            return torch.cat([forward(c) for c in chunks], dim=-2)
        # preserve_rng_state: LoRA dropout inside the MLP draws the same masks when backward recomputes a tile.
        return torch.cat([checkpoint(forward, c, use_reentrant=False, preserve_rng_state=True) for c in chunks], dim=-2)

    return tiled_forward


def tile_mlps(model, setting: str | int) -> int:
    """Make every dense decoder-layer MLP run tiled per memory.tiled_mlp; the number of MLPs changed."""
    if setting == "off":
        return 0
    hidden = int(getattr(base_of(model).config, "hidden_size", 0) or 0)
    if hidden <= 0:
        return 0
    try:
        layers = decoder_layers(model, "memory.tiled_mlp", "set memory.tiled_mlp=off")
    except ModelError:
        if setting == "auto":
            return 0  # a model that names no decoder layers runs its MLPs whole
        raise
    changed = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or hasattr(mlp, "experts") or getattr(mlp, "_finetune_tiled", False):
            continue  # no MLP, a mixture of experts, or tiled already
        mlp.forward = _tiled(mlp.forward, setting, hidden)
        mlp._finetune_tiled = True
        changed += 1
    return changed
