"""Records -> (input_ids, labels): format, tokenize and mask, for every data.format and data.train_on.

A label of IGNORE_INDEX (-100) means "not trained": the model shifts labels by one
inside its loss, so labels[t] is the target predicted from positions < t. The first
token of an example is never trained (nothing precedes it), which also keeps packed
examples from learning to predict one example's start from another's end.

prompt/response formats (a Format with split: alpaca, completion, text, ...) tokenize
prompt + response as one text and mask the prompt's tokens, so the response is
tokenized exactly as it would be in running text (tokenizing it alone would give
SentencePiece tokenizers a spurious leading space). If tokenizing the prompt alone does not give a prefix of
the joint tokens, a token straddles the boundary: generation would start from
different tokens than training saw. That is recorded as a `boundary` problem for
the mask checker. Char tokenizer, completion prompt "Q: 2+2=", completion "4":
    input_ids = [<s>, Q, :, ' ', 2, +, 2, =, 4, </s>]
    labels    = [-100] * 8                + [4, </s>]
text "hi": input_ids = [<s>, h, i, </s>], labels = [-100, h, i, </s>].

chat formats (a Format with to_messages: messages, sharegpt, input_output, ...) render
the conversation with the chat template and find each assistant reply by rendering
prefixes: reply i spans tokens
[len(tok(render(msgs[:i], add_generation_prompt))), len(tok(render(msgs[:i+1])))),
which works for any Jinja template, with or without generation tags. ChatML,
[user "hi", assistant "yo"] (char tokenizer; <|im_end|> is the reply's end token):
    input_ids = [<s>, <|im_start|>, u,s,e,r,\\n, h,i, <|im_end|>, \\n, <|im_start|>, a,s,s,i,s,t,a,n,t,\\n,
                 y, o, <|im_end|>, \\n]
    labels    = [-100] * 22 + [y, o, <|im_end|>, \\n]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from finetune.data.formats import FORMATS, get_format
from finetune.data.formats.alpaca import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT  # noqa: F401  (re-exported)
from finetune.data.records import has_reply, record_problem, to_messages
from finetune.errors import DataError

IGNORE_INDEX = -100

CHAT_FORMATS = tuple(name for name, f in FORMATS.items() if f.chat)


@dataclass
class Encoded:
    """One tokenized record, with what the mask checker needs to judge it."""

    input_ids: list[int]
    labels: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each trained reply
    boundary: str | None = None  # how prompt and response tokenization disagree, if they do


def _encode_many(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    # One batched call: for short texts the per-call overhead costs more than the tokenizing.
    if not texts:
        return []
    # verbose=False: long examples are expected here (truncation comes later); no "longer than maximum" warning.
    return [list(x) for x in tokenizer(list(texts), add_special_tokens=add_special_tokens, verbose=False)["input_ids"]]


def _appends_eos(tokenizer: Any) -> bool:
    """Whether add_special_tokens=True also appends eos (some tokenizers do; a rendered prefix must not end in it)."""
    cached = getattr(tokenizer, "_finetune_appends_eos", None)
    if cached is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        cached = eos is not None and len(ids) > 0 and ids[-1] == eos
        try:
            tokenizer._finetune_appends_eos = cached
        except AttributeError:  # a tokenizer that refuses attributes: ask again next time
            pass
    return cached


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Tokenize chat-template output as the template wrote it: no second BOS (templates like Llama 3's
    write one), and no eos appended by the tokenizer (the template decides where turns end)."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = isinstance(bos, str) and bool(bos) and text.startswith(bos)
    ids = list(tokenizer(text, add_special_tokens=not has_bos, verbose=False)["input_ids"])
    if not has_bos and ids and _appends_eos(tokenizer) and not text.endswith(tokenizer.eos_token or "\0"):
        ids.pop()
    return ids


def render(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise DataError(
            f"{where}: the chat template failed on this conversation: {type(exc).__name__}: {exc}",
            hint="check the roles and their order (many templates require user/assistant alternation)",
        ) from None


def _check_tool_calls_rendered(msgs: list[dict], text: str, where: str) -> None:
    """DataError when the chat template left out a tool call: the model would be trained on a reply
    without the call it made. Templates disagree on an assistant turn with no text (content null):
    transformers drops a null content before rendering, and some templates (DeepSeek's) then skip
    the call. Every called function's name must appear in the rendered conversation."""
    for i, m in enumerate(msgs):
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str) and name and name not in text:
                raise DataError(
                    f"{where}: the chat template dropped the tool call '{name}' of message {i} (its content: "
                    f"{m.get('content')!r}): the reply would be trained without the call",
                    hint="use a template that renders tool calls for this conversation (data.template, or the model's "
                    "own tokenizer), or give the message content text; data.skip_bad_rows=true skips such records",
                )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _show(tokenizer: Any, ids: list[int]) -> str:
    return repr(tokenizer.convert_ids_to_tokens(ids))


def encode_prompt_response(records: list[dict], fmt: str, tokenizer: Any, train_on: str) -> list[Encoded | None]:
    """Prompt/response formats (alpaca, completion, text, ...). None for a record with an empty response (nothing to learn)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos_token, so the model could not learn to stop", hint="use one that has")
    f = get_format(fmt)
    texts = [f.texts(r) for r in records]
    prompts = _encode_many(tokenizer, [p for p, _ in texts], True)
    joints = _encode_many(tokenizer, [p + r for p, r in texts], True)
    out: list[Encoded | None] = []
    for (prompt_text, response), p, j in zip(texts, prompts, joints):
        if not response.strip():
            out.append(None)
            continue
        if p and j and p[-1] == eos and j[-1] == eos:  # tokenizers that append eos themselves
            p, j = p[:-1], j[:-1]
        boundary = None
        k = len(p)
        if j[:k] != p:
            k = _common_prefix(p, j)
            boundary = (
                f"the prompt alone ends in tokens {_show(tokenizer, p[k:][-4:])} but prompt + response has "
                f"{_show(tokenizer, j[k : k + 4])} there: a token straddles the end of the prompt "
                f"(prompt ends with {prompt_text[-12:]!r}, response starts with {response[:12]!r})"
                + ("; strip the response's leading whitespace" if response[:1].isspace() else "")
                + ("; move the prompt's trailing whitespace to the response" if prompt_text[-1:] in (" ", "\t") else "")
            )
        ids = j + [eos]
        labels = ([IGNORE_INDEX] * k + ids[k:]) if train_on != "all" else list(ids)
        labels[0] = IGNORE_INDEX
        out.append(Encoded(ids, labels, [(k, len(ids))], boundary))
    return out


def encode_chat(rec: dict, fmt: str, tokenizer: Any, train_on: str, where: str, max_len: int | None = None) -> Encoded | None:
    """Chat formats (messages, sharegpt, input_output, ...). None when the conversation has no assistant reply to learn from.

    Replies with neither text nor tool calls are not trained (learning to say nothing
    teaches nothing); neither are assistant turns before the first user turn (a greeting
    has nothing to answer). Prefixes past max_len are not rendered: truncation drops them.
    """
    msgs = to_messages(rec, fmt)
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    trainable = [i for i, m in enumerate(msgs) if i > first_user and has_reply(m)]
    if not trainable:
        return None
    full_text = render(tokenizer, msgs, where)
    _check_tool_calls_rendered(msgs, full_text, where)
    ids = encode_rendered(tokenizer, full_text)
    labels = [IGNORE_INDEX] * len(ids) if train_on != "all" else list(ids)
    spans: list[tuple[int, int]] = []
    boundary: str | None = None
    for i in trainable[-1:] if train_on == "last" else trainable:
        start_text = render(tokenizer, msgs[:i], where, add_generation_prompt=True)
        start = encode_rendered(tokenizer, start_text)
        if max_len is not None and len(start) >= max_len:
            if not spans:
                # Its first reply already starts beyond data.max_seq_len: nothing of it would be
                # trained. Dropped and counted, like an alpaca record whose prompt is too long.
                return None
            break  # this reply (and every later one) lies beyond the truncation point
        upto_text = render(tokenizer, msgs[: i + 1], where)
        upto = encode_rendered(tokenizer, upto_text)
        a, b = _common_prefix(ids, start), _common_prefix(ids, upto)
        if (a, b) != (len(start), len(upto)) and boundary is None:
            if full_text.startswith(start_text) and full_text.startswith(upto_text):
                # The text is consistent; the tokens are not: the reply's first characters
                # merge with the template's text before them (e.g. a reply starting with "\n").
                k = a
                boundary = (
                    f"reply {i} starts with {msgs[i]['content'][:12]!r}, which merges with the template's "
                    f"{start_text[-12:]!r} into token(s) {_show(tokenizer, ids[k : k + 2])}: the prompt the model "
                    "sees at generation ends differently than in training"
                )
            else:
                # Templates that rewrite earlier turns (e.g. strip reasoning from all but the
                # last reply) render a prefix unlike the start of the whole: no exact mask exists.
                boundary = (
                    f"the chat template renders the conversation up to message {i} differently from the start of "
                    "the whole conversation, so the reply's tokens cannot be located exactly"
                )
        spans.append((a, b))
        labels[a:b] = ids[a:b]
    labels[0] = IGNORE_INDEX
    return Encoded(ids, labels, spans, boundary)


def encode_records(
    records: list[dict], fmt: str, tokenizer: Any, train_on: str, wheres: list[str], max_len: int | None = None
) -> list[Encoded | None]:
    """Records of one format (already checked by record_problem) -> Encoded, or None to drop."""
    if get_format(fmt).chat:
        return [encode_chat(r, fmt, tokenizer, train_on, w, max_len) for r, w in zip(records, wheres)]
    return encode_prompt_response(records, fmt, tokenizer, train_on)


def prompt_and_answer(record: dict, fmt: str, tokenizer: Any) -> tuple[list[int], str]:
    """The prompt ids exactly as training saw them, and the expected answer, for generation-based eval.

    Prompt/response formats: (tok(prompt), response), e.g. alpaca: (tok(alpaca prompt), output);
    chat formats: (tok(render(turns before the last assistant reply, add_generation_prompt)),
    that reply's content). `record` is one of load_records' (data.columns already applied).
    """
    f = get_format(fmt)
    if not f.answers:
        names = [name for name, other in FORMATS.items() if other.answers]
        scored = ", ".join(names[:-1]) + " or " + names[-1]
        raise DataError(
            f"data.format={fmt} has no prompt/answer split, so exact-match eval cannot score it",
            hint=f"use eval.exact_match_path with {scored} data, or set eval.exact_match_path=null",
        )
    problem = record_problem(record, fmt, {})
    if problem:
        raise DataError(f"record {problem[0]}", hint=problem[1])
    if not f.chat:
        prompt, answer = f.texts(record)
        return _encode_many(tokenizer, [prompt], True)[0], answer
    msgs = to_messages(record, fmt)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        hint = "each conversation needs an assistant turn after a user turn"
        raise DataError("record has no assistant reply after a prompt to score", hint)
    text = render(tokenizer, msgs[:last], "record", add_generation_prompt=True)
    return encode_rendered(tokenizer, text), msgs[last]["content"] or ""


def generation_prompt(text: str, fmt: str, tokenizer: Any, context: str = "") -> list[int]:
    """The tokens training put before a response, for a user's free text (`finetune generate`).

    The format's prompt_record turns the text into a record with an empty answer, whose
    prompt is built as prompt_and_answer builds it; a format without answers (text) has
    the text itself as its prompt, to be continued (training saw BOS + text).
    """
    f = get_format(fmt)
    record = f.prompt_record(text, context)
    if not f.answers:
        prompt, response = f.texts(record)
        return _encode_many(tokenizer, [prompt + response], True)[0]
    return prompt_and_answer(record, fmt, tokenizer)[0]
