"""A sequence-classification model as a GRPO reward (train.rewards: [{name: model, path: ..., bits: 4}]).

    score = RewardModel(path, bits, max_length)(completions, records)   # one float a completion

The model (one output: num_labels=1, as reward models are trained) is loaded once, at its first call, on the
training device: its own tokenizer, in 4 bits (NF4, double quant) when `bits: 4`, never trained (no_grad, eval).
Each completion is scored as the reward model reads a conversation: the record's prompt (text, or messages) as the
user's turn and the completion as the assistant's, through the reward tokenizer's own chat template where it has
one, else the prompt's text followed by the completion's. A row longer than max_length tokens loses the start of
its prompt, never the completion (it is what is scored), and the first such row is said once (raise max_length).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from finetune.errors import ModelError, RewardError


class RewardModel:
    """A batched reward (rewards.Reward with batched=True): (completions, records) -> one float each."""

    def __init__(self, path: str, bits: int | None, max_length: int, where: str = "train.rewards") -> None:
        self.path, self.bits, self.max_length, self.where = path, bits, max_length, where
        self.device = torch.device("cpu")
        self.model: Any = None
        self.tokenizer: Any = None
        self.warned = False  # a row longer than max_length was said

    def use_device(self, device: torch.device) -> None:
        """Where the policy trains: the reward model is loaded there (at its first call)."""
        self.device = device

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], records: Sequence[Mapping[str, Any]]) -> list[float]:
        model, tok = self._loaded()
        templated = bool(getattr(tok, "chat_template", None))
        texts = [self._text(tok, record, completion, templated) for completion, record in zip(completions, records)]
        if not self.warned:
            longest = max(len(ids) for ids in tok(texts, add_special_tokens=not templated)["input_ids"])
            if longest > self.max_length:
                self.warned = True
                warnings.warn(
                    f"{self.where} (model): a prompt + completion of {longest} tokens is longer than max_length="
                    f"{self.max_length}: the reward model reads its last {self.max_length} (the prompt's start cut)",
                    stacklevel=2,
                )
        enc = tok(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not templated,
        )
        logits = model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return logits[:, 0].float().tolist()

    def _text(self, tok: Any, record: Mapping[str, Any], completion: str, templated: bool) -> str:
        prompt = record.get("prompt", "")
        if not templated:
            text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
            return text + completion
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tok.apply_chat_template([*messages, {"role": "assistant", "content": completion}], tokenize=False)

    def _loaded(self) -> tuple[Any, Any]:
        if self.model is not None:
            return self.model, self.tokenizer
        from transformers import AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

        dtype = torch.float32
        if self.device.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        quant = None
        if self.bits == 4:
            quant = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
            )
        try:
            tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.path,
                dtype=dtype,
                quantization_config=quant,
                device_map={"": self.device} if quant is not None else None,  # bitsandbytes places it there itself
                trust_remote_code=False,  # a recipe names the model: no code of its folder runs
            )
        except (OSError, ValueError) as exc:
            raise ModelError(
                f"{self.where} (model): cannot load a sequence-classification model from {self.path!r}: {exc}",
                hint="give a local folder or a hub id of a reward model (AutoModelForSequenceClassification, num_labels=1)",
            ) from exc
        if model.config.num_labels != 1:
            raise RewardError(
                f"{self.where} (model): {self.path!r} has {model.config.num_labels} outputs; a reward model has one",
                hint="use a reward model (num_labels=1), e.g. one trained by TRL's RewardTrainer",
            )
        tok.truncation_side = "left"  # a long row loses its prompt's start, never the completion scored
        if tok.pad_token is None:  # batches are padded; the classifier reads each row's last token that is not padding
            tok.pad_token = tok.eos_token
        model.config.pad_token_id = tok.pad_token_id
        self.model, self.tokenizer = model.to(self.device) if quant is None else model, tok
        self.model.eval().requires_grad_(False)
        return self.model, self.tokenizer
