"""Whether vLLM can serve an exported adapter as it is, and the command that serves it.

    note = vllm_note(adapter_config, base="meta-llama/Llama-3.1-8B", adapter_dir=Path("exports/my"))
    note["servable"], note["command"], note["refused_by_vllm"]

What vLLM refuses when it loads a LoRA adapter, as its own loader states it (vllm/lora/peft_helper.py,
PEFTHelper._validate_features and validate_legal): "vLLM does not yet support DoRA." (use_dora),
"vLLM only supports modules_to_save being None." (modules_to_save), and a rank "greater than
max_lora_rank", whose values are vllm.config.lora's MaxLoRARanks (default 16). PEFTHelper.from_dict
also drops the keys it has no field for, init_lora_weights among them: a PiSSA adapter, which peft
loads onto the residual W - U_r S_r V_r^T it recomputes, would be added to the original W by vLLM.
Nothing here imports vLLM: the note is written at export, where vLLM is usually not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
VLLM_DEFAULT_MAX_LORA_RANK = 16
MERGE_INSTEAD = "export with --merge and serve the merged model: vllm serve MERGED_DIR"


def _largest_rank(config: dict[str, Any]) -> int:
    """The adapter's largest rank: r, or a larger one rank_pattern gives some modules."""
    return max([int(config.get("r") or 0), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def vllm_note(config: dict[str, Any], base: str, adapter_dir: Path) -> dict[str, Any]:
    """{"servable", "refused_by_vllm": [why], "max_lora_rank", "command"} for adapter_config.json's contents."""
    rank = _largest_rank(config)
    refused = []
    if config.get("use_dora"):
        refused.append("DoRA (use_dora): vLLM does not yet support DoRA")
    if config.get("modules_to_save"):
        refused.append(f"modules_to_save {config['modules_to_save']}: vLLM only supports modules_to_save being None")
    if str(config.get("init_lora_weights")).startswith("pissa"):
        refused.append("PiSSA (init_lora_weights): vLLM adds the adapter to the original weights, not to PiSSA's residual")
    if rank > VLLM_MAX_LORA_RANKS[-1]:
        refused.append(f"rank {rank}: above vLLM's largest --max-lora-rank, {VLLM_MAX_LORA_RANKS[-1]}")
    # --max-lora-rank takes only these values: the smallest that holds the adapter's rank
    max_rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= max(rank, VLLM_DEFAULT_MAX_LORA_RANK)), None)
    command = f"vllm serve {base} --enable-lora --lora-modules {adapter_dir.name}={adapter_dir}"
    if max_rank and max_rank != VLLM_DEFAULT_MAX_LORA_RANK:
        command += f" --max-lora-rank {max_rank}"
    return {
        "servable": not refused,
        "refused_by_vllm": refused,
        "max_lora_rank": max_rank if not refused else None,
        "command": command if not refused else None,
        "instead": MERGE_INSTEAD if refused else None,
        "source": "vllm/lora/peft_helper.py (PEFTHelper checks) and vllm.config.lora.MaxLoRARanks",
    }


def vllm_line(note: dict[str, Any]) -> str:
    """The one line the export prints about vLLM."""
    if note["servable"]:
        return f"  vLLM:       {note['command']}"
    return f"  vLLM:       cannot serve this adapter ({'; '.join(note['refused_by_vllm'])}); {note['instead']}"
