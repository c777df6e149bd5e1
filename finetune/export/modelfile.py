"""An Ollama Modelfile for an exported GGUF: the run's prompt format in Ollama's Go-template syntax.

    text = modelfile("model-q8_0.gguf", tokenizer, data_format="messages")
    # ollama create NAME -f DIR/Modelfile

A chat template is recognised by what it renders (a probe conversation compared with finetune's
built-in ChatML and Llama-3 templates), not by its source text, so a tokenizer's own ChatML
template written another way is recognised too. Other templates are left to Ollama, which reads
the GGUF's tokenizer.chat_template.
"""

from __future__ import annotations

from typing import Any

from finetune.data import get_format
from finetune.data.templates import BUILTIN_TEMPLATES

# Ollama's template for each built-in chat template, and the strings that end an assistant turn.
# Ollama passes its SYSTEM prompt as the first of .Messages; BOS comes from the GGUF's add_bos_token.
OLLAMA_CHAT = {
    "chatml": (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        ("<|im_end|>",),
    ),
    "llama3": (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("<|eot_id|>",),
    ),
}
_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "R"},
]


def _render(tokenizer: Any, template: str) -> str | None:
    try:
        return tokenizer.apply_chat_template(_PROBE, chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses the probe (no system role, ...) is not one of ours
        return None


def known_chat_template(tokenizer: Any) -> str | None:
    """'chatml' or 'llama3' when the tokenizer's chat template renders as that built-in does, else None."""
    own = getattr(tokenizer, "chat_template", None)
    if not isinstance(own, str):
        return None
    rendered = _render(tokenizer, own)
    bos = tokenizer.bos_token or ""
    for name in OLLAMA_CHAT:
        expected = _render(tokenizer, BUILTIN_TEMPLATES[name])
        # Ollama adds BOS itself (add_bos_token), so a template that writes it or not is the same prompt.
        if rendered is not None and expected is not None and rendered.removeprefix(bos) == expected.removeprefix(bos):
            return name
    return None


def _quoted(text: str) -> str:
    return '"""' + text + '"""'


def modelfile(gguf_name: str, tokenizer: Any, data_format: str, system: str | None = None) -> str:
    """The Modelfile text: FROM the GGUF beside it, TEMPLATE, PARAMETER stop lines, SYSTEM when given."""
    lines = ["# Ollama: ollama create NAME -f Modelfile (in this directory)", f"FROM ./{gguf_name}"]
    fmt = get_format(data_format)
    stops: tuple[str, ...] = ()
    if fmt.chat:
        known = known_chat_template(tokenizer)
        if known is None:
            lines.append(
                "# the run's chat template has no Ollama equivalent here: Ollama uses the GGUF's tokenizer.chat_template"
            )
        else:
            template, stops = OLLAMA_CHAT[known]
            lines.append(f"TEMPLATE {_quoted(template)}")
    elif isinstance(fmt.prompt_template, dict) and "without_input" in fmt.prompt_template:
        lines.append(f"TEMPLATE {_quoted(fmt.prompt_template['without_input'].format(instruction='{{ .Prompt }}'))}")
    else:  # completion / text: the prompt is the text itself
        lines.append(f"TEMPLATE {_quoted('{{ .Prompt }}')}")
    eos = getattr(tokenizer, "eos_token", None)
    for stop in dict.fromkeys((*stops, *([eos] if eos else []))):
        lines.append(f'PARAMETER stop "{stop}"')
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    return "\n".join(lines) + "\n"
