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
the conversation once with the chat template and train each assistant reply's text in
that rendering: from the end of the generation prompt before it through its end-of-turn
marker, up to the next message (replies.py finds that text, for templates that render
every prefix of a conversation as the start of the whole and for those that do not).
ChatML, [user "hi", assistant "yo"] (char tokenizer; <|im_end|> is the reply's end token):
    input_ids = [<s>, <|im_start|>, u,s,e,r,\\n, h,i, <|im_end|>, \\n, <|im_start|>, a,s,s,i,s,t,a,n,t,\\n,
                 y, o, <|im_end|>, \\n]
    labels    = [-100] * 22 + [y, o, <|im_end|>, \\n]
A reply edge inside a token (the reply's first characters merge with the template's
text before them) is a `boundary` problem, as for prompt/response formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data.formats import FORMATS, get_format
from finetune.data.formats.alpaca import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT  # noqa: F401  (re-exported)
from finetune.data.images import ImageText, image_paths, image_token_ids, processor_of, replacements, resolve_images
from finetune.data.records import has_reply, record_problem, to_messages
from finetune.data.replies import Conversation, common_prefix, encode_rendered, render
from finetune.errors import DataError

IGNORE_INDEX = -100

CHAT_FORMATS = tuple(name for name, f in FORMATS.items() if f.chat)


@dataclass
class Encoded:
    """One tokenized record, with what the mask checker needs to judge it."""

    input_ids: list[int]
    labels: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each trained reply
    boundary: str | None = None  # how prompt and response tokenization disagree, or why a reply is not placed exactly
    images: list[str] = field(default_factory=list)  # absolute paths, in the order their tokens appear


def _encode_many(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    # One batched call: for short texts the per-call overhead costs more than the tokenizing.
    if not texts:
        return []
    # verbose=False: long examples are expected here (truncation comes later); no "longer than maximum" warning.
    return [list(x) for x in tokenizer(list(texts), add_special_tokens=add_special_tokens, verbose=False)["input_ids"]]


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
            k = common_prefix(p, j)
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


def encode_chat(
    rec: dict, fmt: str, tokenizer: Any, train_on: str, where: str, max_len: int | None = None, folder: Path | None = None
) -> Encoded | None:
    """Chat formats (messages, sharegpt, input_output, ...). None when the conversation has no assistant reply to learn from.
    folder: the data file's, which relative image paths start from."""
    msgs = to_messages(rec, fmt)
    if image_paths(msgs) or processor_of(tokenizer) is not None:
        return encode_with_images(msgs, tokenizer, train_on, where, max_len, folder)
    return encode_messages(msgs, tokenizer, train_on, where, max_len)


def encode_with_images(
    msgs: list[dict], tokenizer: Any, train_on: str, where: str, max_len: int | None, folder: Path | None
) -> Encoded | None:
    """A conversation with image parts (finetune/data/images.py): rendered and masked in the text the model
    reads, each image's placeholder expanded as the processor expands it; image tokens never trained."""
    paths = image_paths(msgs)
    msgs = resolve_images(msgs, folder, where)
    text = _with_images(msgs, tokenizer, where)
    rendered = text.placeholders(msgs)
    if rendered != len(paths):
        raise DataError(
            f"{where}: the record has {len(paths)} image(s) but the chat template renders {rendered} image placeholder(s)",
            hint='give each image its own {"type": "image", "path": ...} part in a user turn; '
            "the model's chat template decides where image parts may stand",
        )
    enc = encode_messages(msgs, text, train_on, where, max_len)
    if enc is None:
        return None
    image_ids = image_token_ids(processor_of(tokenizer))  # not None: _with_images refused a text-only model
    trained = [k for k, t in enumerate(enc.input_ids) if t in image_ids and enc.labels[k] != IGNORE_INDEX]
    if trained and train_on != "all":
        raise DataError(
            f"{where}: an image lies inside a trained reply (token {trained[0]}): the model would learn to write image tokens",
            hint="put images in user turns; an assistant reply is text",
        )
    for k in trained:  # data.train_on=all trains the prompts too, never the image features
        enc.labels[k] = IGNORE_INDEX
    enc.images = image_paths(msgs)
    return enc


def encode_messages(msgs: list[dict], tokenizer: Any, train_on: str, where: str, max_len: int | None = None) -> Encoded | None:
    """A conversation [{"role", "content", ...}, ...] -> Encoded; None when it has no assistant reply to learn from.

    Replies with neither text nor tool calls are not trained (learning to say nothing
    teaches nothing); neither are assistant turns before the first user turn (a greeting
    has nothing to answer). Replies past max_len are not placed: truncation drops them.
    A reply that cannot be placed exactly is left untrained and reported as `boundary`.
    """
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    trainable = [i for i, m in enumerate(msgs) if i > first_user and has_reply(m)]
    if not trainable:
        return None
    conv = Conversation(tokenizer, msgs, where)
    _check_tool_calls_rendered(msgs, conv.text, where)
    ids = conv.ids
    labels = [IGNORE_INDEX] * len(ids) if train_on != "all" else list(ids)
    spans: list[tuple[int, int]] = []
    problems: dict[int, str] = {}  # reply index -> why its tokens are not exactly its own
    placed: list[int] = []  # replies whose tokens are exactly their own
    for i in trainable[-1:] if train_on == "last" else trainable:
        start = conv.start(i)
        if isinstance(start, str):
            problems[i] = start  # left untrained: never guessed
            continue
        a, a_straddled = conv.token_at(start)
        if max_len is not None and a >= max_len:
            if not spans and not problems:
                # Its first reply already starts beyond data.max_seq_len: nothing of it would be
                # trained. Dropped and counted, like an alpaca record whose prompt is too long.
                return None
            break  # this reply (and every later one) lies beyond the truncation point
        end = conv.end(i)
        if isinstance(end, str):
            problems[i] = end
            continue
        b, b_straddled = conv.token_at(end)
        merged = _merge_problem(
            tokenizer, msgs[i], i, conv, (start, a) if a_straddled else None, (end, b) if b_straddled else None
        )
        if merged:
            problems[i] = merged
        else:
            placed.append(i)
        spans.append((a, b))
        labels[a:b] = ids[a:b]
    labels[0] = IGNORE_INDEX
    return Encoded(ids, labels, spans, _boundary(problems, trainable[-1] in placed))


def _merge_problem(
    tokenizer: Any, msg: dict, i: int, conv: Conversation, start: tuple[int, int] | None, end: tuple[int, int] | None
) -> str | None:
    """Why reply i's edges fall inside tokens of the whole: start/end are (character, token index) of an
    edge that a token straddles, or None."""
    if start is not None:
        (at, k), content = start, msg["content"] or ""
        return (
            f"reply {i} starts with {content[:12]!r}, which merges with the template's {conv.text[:at][-12:]!r} into "
            f"token(s) {_show(tokenizer, conv.ids[k : k + 2])}: the prompt the model sees at generation ends "
            "differently than in training" + ("; strip the replies' leading whitespace" if content[:1].isspace() else "")
        )
    if end is not None:
        (at, k), after = end, conv.text[end[0] : end[0] + 12]
        return f"the end of reply {i} merges with the text after it ({after!r}) into token(s) {_show(tokenizer, conv.ids[k : k + 2])}"
    return None


def _boundary(problems: dict[int, str], last_placed: bool) -> str | None:
    """The first reply problem of a conversation, naming train_on=last when the final reply is placed exactly."""
    if not problems:
        return None
    hint = "; data.train_on=last trains only the final reply, which is placed exactly" if last_placed else ""
    return problems[min(problems)] + hint


def encode_records(
    records: list[dict],
    fmt: str,
    tokenizer: Any,
    train_on: str,
    wheres: list[str],
    max_len: int | None = None,
    folders: Sequence[Path | None] | None = None,
) -> list[Encoded | None]:
    """Records of one format (already checked by record_problem) -> Encoded, or None to drop.
    folders: each record's data file folder (relative image paths start there)."""
    if get_format(fmt).chat:
        folders = folders or [None] * len(records)
        return [encode_chat(r, fmt, tokenizer, train_on, w, max_len, d) for r, w, d in zip(records, wheres, folders)]
    return encode_prompt_response(records, fmt, tokenizer, train_on)


def prompt_and_answer(record: dict, fmt: str, tokenizer: Any) -> tuple[list[int], str]:
    """The prompt ids exactly as training saw them, and the expected answer, for generation-based eval.

    Prompt/response formats: (tok(prompt), response), e.g. alpaca: (tok(alpaca prompt), output);
    chat formats: (tok(render(turns before the last assistant reply, add_generation_prompt)),
    that reply's content); preference pairs: as their sides' format, with the chosen response.
    `record` is one of load_records' (data.columns already applied).
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
    if f.pairs is not None:  # a preference pair: its prompt, and the chosen response as the answer
        side_fmt, chosen, _ = f.pairs(record)
        return prompt_and_answer(chosen, side_fmt, tokenizer)
    if not f.chat:
        prompt, answer = f.texts(record)
        return _encode_many(tokenizer, [prompt], True)[0], answer
    msgs = to_messages(record, fmt)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        hint = "each conversation needs an assistant turn after a user turn"
        raise DataError("record has no assistant reply after a prompt to score", hint)
    turns = msgs[:last]
    text = render(_with_images(turns, tokenizer, "record"), turns, "record", add_generation_prompt=True)
    return encode_rendered(tokenizer, text), msgs[last]["content"] or ""


def _with_images(msgs: list[dict], tokenizer: Any, where: str) -> Any:
    """What renders this conversation: the tokenizer, or for a vision-language model the ImageText that expands
    its images' placeholders as training did (image paths already absolute)."""
    processor, paths = processor_of(tokenizer), image_paths(msgs)
    if processor is None and not paths:
        return tokenizer
    if processor is None:
        raise DataError(
            f"{where}: the record has {len(paths)} image(s), but the model is text-only (no image processor in its folder)",
            hint="use a vision-language model (model.path), or remove the image parts",
        )
    return ImageText(tokenizer, processor, replacements(processor, image_paths(resolve_images(msgs, None, where)), where))


def prompt_images(record: dict, fmt: str) -> list[str]:
    """The image files of a chat record's prompt (the turns before its last reply), as prompt_and_answer renders them."""
    if not get_format(fmt).chat:
        return []
    msgs = to_messages(record, fmt)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
    return image_paths(msgs[:last])


def generation_prompt(text: str, fmt: str, tokenizer: Any, context: str = "", images: Sequence[str] = ()) -> list[int]:
    """The tokens training put before a response, for a user's free text (`finetune generate`).

    The format's prompt_record turns the text into a record with an empty answer, whose
    prompt is built as prompt_and_answer builds it; a format without answers (text) has
    the text itself as its prompt, to be continued (training saw BOS + text). images: absolute
    paths put before the text in the user turn (a chat format and a vision-language model).
    """
    f = get_format(fmt)
    record = f.prompt_record(text, context)
    if images:
        if not f.chat or "messages" not in record:
            raise DataError(f"--image needs a chat format (data.format=messages), not {fmt}", hint="drop --image")
        user = record["messages"][0]
        parts = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": user["content"]}]
        record = {**record, "messages": [{**user, "content": parts}, *record["messages"][1:]]}
    if not f.answers:
        prompt, response = f.texts(record)
        return _encode_many(tokenizer, [prompt + response], True)[0]
    return prompt_and_answer(record, fmt, tokenizer)[0]
