"""Chat templates: the tokenizer's own, or a built-in one chosen by data.template.

A built-in template is installed as `tokenizer.chat_template`, so the tokenizer
saved with the adapter carries exactly the template the model was trained with,
and generation, eval and export render prompts the same way.

Rendered conversation [system "S", user "Q", assistant "A"] (bos "<s>", eos "</s>"):
    chatml   <|im_start|>system\\nS<|im_end|>\\n<|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\nA<|im_end|>\\n
    llama3   <s><|start_header_id|>system<|end_header_id|>\\n\\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\n
             Q<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\nA<|eot_id|>
    mistral  <s>[INST] S\\n\\nQ [/INST]A</s>
    alpaca   S\\n\\n### Instruction:\\nQ\\n\\n### Response:\\nA</s>
(llama3 and mistral write bos themselves; the tokenizer then adds none.)
"""

from __future__ import annotations

from typing import Any

from finetune.data.formats import FORMATS
from finetune.errors import DataError

# Built-ins render role + content only: a tool call would be dropped without a word, so they refuse it.
_NO_TOOL_CALLS = (
    "{% if m['tool_calls'] is defined %}{{ raise_exception('built-in templates cannot render tool calls: "
    "use a tokenizer whose own chat template can (data.template=auto)') }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}"
        + _NO_TOOL_CALLS
        + "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for m in messages %}"
        + _NO_TOOL_CALLS
        + "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # Mistral-instruct / Llama-2-chat style; a system message is folded into the first user turn.
    "mistral": (
        "{{ bos_token }}"
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}" + _NO_TOOL_CALLS + "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
        "{% elif m['role'] == 'user' %}{{ '[INST] ' + ns.system + m['content'] + ' [/INST]' }}{% set ns.system = '' %}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
        "{% else %}{{ raise_exception('the mistral template has no place for role ' + m['role']) }}"
        "{% endif %}"
        "{% endfor %}"
    ),
    "alpaca": (
        "{% for m in messages %}" + _NO_TOOL_CALLS + "{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
        "{% elif m['role'] == 'user' %}{{ ('\n\n' if not loop.first and messages[loop.index0 - 1]['role'] != 'system' else '')"
        " + '### Instruction:\n' + m['content'] + '\n\n### Response:\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
        "{% else %}{{ raise_exception('the alpaca template has no place for role ' + m['role']) }}"
        "{% endif %}"
        "{% endfor %}"
    ),
}

# Tokens that end an assistant turn in common templates: a reply must train one of them
# (or eos), or the model never learns to stop.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>")


def use_template(tokenizer: Any, name: str) -> str:
    """Make `tokenizer` render conversations with data.template=`name`; returns which template is used.

    auto: the tokenizer's own, or an error when it has none (naming the built-ins).
    """
    if name == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"chat data (data.format={'/'.join(n for n, f in FORMATS.items() if f.chat)}) needs a chat template, "
                "but the tokenizer has none",
                hint=f"set data.template to one of {', '.join(BUILTIN_TEMPLATES)} (chatml for base models), "
                "use a chat/instruct model's tokenizer (model.tokenizer=...), or convert to data.format=completion",
            )
        return "tokenizer"
    tokenizer.chat_template = BUILTIN_TEMPLATES[name]
    return name


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids that can end an assistant reply: eos, then the end-of-turn tokens this tokenizer has.

    Only tokens the tokenizer keeps whole count: a "</s>" that it splits into pieces ends
    nothing. Special tokens, and added ones: Phi-3's tokenizer adds <|end|> without listing
    it among its special tokens.
    """
    ids = [] if getattr(tokenizer, "eos_token_id", None) is None else [int(tokenizer.eos_token_id)]
    specials = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "get_added_vocab", dict)())
    for name in END_OF_TURN_TOKENS:
        if name in specials:
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid not in ids:
                ids.append(tid)
    return ids
