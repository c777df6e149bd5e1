"""Rewards of train.objective=grpo: what scores a sampled completion.

A reward is a function (completion: str, record: dict) -> float, where `record` is the data record
the prompt came from (its columns, e.g. `answer`); marked @reward(batched=True), (completions: list[str],
records: list[dict]) -> list[float], one call per micro-batch; @reward(weight=...) weighs yours as a recipe
weighs a built-in. A run's rewards come from two places only:

    train.rewards           the built-ins below, by name, with a weight and options (from_spec)
    your own Python         Trainer(reward_fns=[...]) or `finetune run --rewards FILE.py`
                            (load_reward_file); a recipe never names code to import

Built-ins (the record's `column` holds the answer):

    exact_match  1.0 if the completion equals the answer, both stripped of surrounding whitespace;
                 case and punctuation count ("Paris." is not "Paris"), else 0.0
    contains     1.0 if the stripped answer occurs in the completion as whole words: a word
                 boundary is required where the answer starts or ends with a letter, digit or _
                 ("4" is not found in "42"), else 0.0
    format       1.0 if re.search(pattern, completion) finds the pattern, else 0.0
    numeric      1.0 if the LAST number in the completion equals the answer's number, else 0.0;
                 numbers may be negative, decimal (.5, 2.50), with thousands commas (1,234) or
                 fractions (3/4), compared exactly as fractions: "0.5" == "1/2" == "2/4"
    length       0.0 up to `target` characters, then -(len - target) / target, floored at -1.0:
                 a completion twice the target or longer scores -1.0
    json         1.0 if the stripped completion parses as JSON (Python's json.loads), else 0.0
    model        a reward model's score of (prompt, completion): `path`, `bits: 4`, `max_length` (reward_model.py)

score() runs every reward on every completion: a (n, k) tensor of each reward and the (n,)
weighted total; metrics report each as rewards/<name>, so names are unique per run.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from finetune.errors import ConfigError, FinetuneError, RewardError

if TYPE_CHECKING:
    from finetune.config.sections import RewardSpec

RewardFn = Callable[[str, Mapping[str, Any]], float]
NEED_ONE = (
    "train.objective=grpo needs at least one reward: train.rewards in the recipe, Trainer(reward_fns=...), "
    "or finetune run --rewards FILE.py"
)
SHOWN_CHARS = 200  # how much of a prompt or completion an error quotes
_MANTISSA = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER = rf"-?{_MANTISSA}(?:/\d+)?"
# Not inside a word or another number: "v2", "1.2.3"'s tail and "5-3"'s minus are no numbers of their own.
NUMBER_IN_TEXT = re.compile(rf"(?<![\w.]){_NUMBER}")
NUMBER_ALONE = re.compile(rf"\s*{_NUMBER}\s*")
_module_ids = itertools.count(1)


@dataclass(frozen=True)
class Reward:
    """One reward of a run: `name` (metrics: rewards/<name>), its `weight` in the total, and `fn`; batched: fn takes
    the micro-batch's lists (completions, records) and returns a list of floats."""

    name: str
    weight: float
    fn: Callable[..., Any]
    batched: bool = False


def reward(weight: float = 1.0, batched: bool = False, name: str | None = None) -> Callable[[Callable], Callable]:
    """Marks your reward function (Trainer(reward_fns=...) or a --rewards file): its weight in the total, whether it
    scores a whole micro-batch in one call, and its metric name (default: the function's).

        @reward(weight=0.5)
        def reward_format(completion: str, record: dict) -> float: ...

        @reward(batched=True)                   # one call per micro-batch: a model, a service, a vectorised check
        def reward_judge(completions: list[str], records: list[dict]) -> list[float]: ...
    """
    if not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
        raise ConfigError([f"@reward(weight={weight!r}): a weight is a finite number"])

    def mark(fn: Callable) -> Callable:
        fn.reward_weight, fn.reward_batched = float(weight), bool(batched)
        if name is not None:
            fn.reward_name = name
        return fn

    return mark


def answer_of(record: Mapping[str, Any], column: str) -> Any:
    """The record's value in `column`; a RewardError naming the column and the keys it has."""
    if column not in record:
        raise RewardError(
            f"the record has no column '{column}' (it has {sorted(record)})",
            hint="set train.rewards[].column to the column holding the answer, or add it to every record",
        )
    if record[column] is None:
        raise RewardError(f"the record's '{column}' is empty (None)", hint="give every record an answer")
    return record[column]


def to_fraction(text: str) -> Fraction | None:
    """A number as written ("-1,234.5", "3/4", ".5") as an exact fraction; None if it is not one."""
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number in `text`, or None when it has none (or ends in one like 1/0)."""
    found = NUMBER_IN_TEXT.findall(text)
    return to_fraction(found[-1]) if found else None


def record_number(value: Any, column: str) -> Fraction:
    """The answer as a fraction: a number, or a string that is one number and nothing else."""
    number = None
    if isinstance(value, bool):  # True is an int to Python, but no answer to a sum
        pass
    elif isinstance(value, numbers.Integral):
        number = Fraction(int(value))
    elif isinstance(value, numbers.Real) and math.isfinite(value):
        number = Fraction(repr(float(value)))  # via repr: the 0.1 a user wrote, not its binary neighbour
    elif isinstance(value, str) and NUMBER_ALONE.fullmatch(value):
        number = to_fraction(value.strip())
    if number is not None:
        return number
    raise RewardError(
        f"numeric reward: the record's '{column}' is {value!r}, not a number",
        hint="give the answer as one number (42, -3.5, 1,234, 3/4), or use exact_match or contains",
    )


def exact_match(column: str) -> RewardFn:
    def reward(completion: str, record: Mapping[str, Any]) -> float:
        return float(completion.strip() == str(answer_of(record, column)).strip())

    return reward


def contains(column: str) -> RewardFn:
    def reward(completion: str, record: Mapping[str, Any]) -> float:
        answer = str(answer_of(record, column)).strip()
        if not answer:
            raise RewardError(f"contains reward: the record's '{column}' is blank", hint="give every record an answer")
        start = r"\b" if re.match(r"\w", answer[0]) else ""
        end = r"\b" if re.match(r"\w", answer[-1]) else ""
        return float(re.search(start + re.escape(answer) + end, completion) is not None)

    return reward


def format_reward(pattern: re.Pattern[str]) -> RewardFn:
    def reward(completion: str, record: Mapping[str, Any]) -> float:
        return float(pattern.search(completion) is not None)

    return reward


def numeric(column: str) -> RewardFn:
    def reward(completion: str, record: Mapping[str, Any]) -> float:
        expected = record_number(answer_of(record, column), column)
        return float(last_number(completion) == expected)

    return reward


def length(target: int) -> RewardFn:
    def reward(completion: str, record: Mapping[str, Any]) -> float:
        return -min(1.0, max(0, len(completion) - target) / target)

    return reward


def json_reward(completion: str, record: Mapping[str, Any]) -> float:
    try:
        json.loads(completion.strip())
    except ValueError:  # json.JSONDecodeError, and a completion Python cannot decode
        return 0.0
    return 1.0


def from_spec(spec: RewardSpec, where: str = "train.rewards") -> Reward:
    """The built-in reward a recipe's RewardSpec names; a ConfigError when an option it needs is missing."""
    says = f"{where} ({spec.name})"
    if spec.name in ("exact_match", "contains", "numeric"):
        if not spec.column:
            raise ConfigError([f"{says} needs `column`: the record's column holding the answer, e.g. column: answer"])
        make = {"exact_match": exact_match, "contains": contains, "numeric": numeric}[spec.name]
        fn = make(spec.column)
    elif spec.name == "format":
        if not spec.pattern:
            raise ConfigError([f"{says} needs `pattern`: a regular expression the completion must contain"])
        try:
            fn = format_reward(re.compile(spec.pattern))
        except re.error as exc:
            raise ConfigError(
                [f"{says}: `pattern` {spec.pattern!r} is not a regular expression: {exc}. Fix the pattern"]
            ) from None
    elif spec.name == "length":
        if spec.target is None or spec.target < 1:
            raise ConfigError([f"{says} needs `target` >= 1: the characters a completion may have before the penalty"])
        fn = length(spec.target)
    elif spec.name == "json":
        fn = json_reward
    elif spec.name == "model":
        if not spec.path:
            raise ConfigError([f"{says} needs `path`: a sequence-classification reward model (local folder or hub id)"])
        from finetune.objectives.reward_model import RewardModel

        return Reward(
            name="model", weight=float(spec.weight), fn=RewardModel(spec.path, spec.bits, spec.max_length, says), batched=True
        )
    else:
        raise ConfigError(
            [
                f"{says}: no built-in reward is called {spec.name!r}; use exact_match, contains, format, numeric, length, json or model"
            ]
        )
    return Reward(name=spec.name, weight=float(spec.weight), fn=fn)


def name_of(fn: Callable[..., Any]) -> str:
    """A metric-safe name of a user's function: its __name__ ("<lambda>" -> "lambda")."""
    raw = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"\W+", "_", raw).strip("_") or "reward"


def unique_names(rewards: Sequence[Reward]) -> list[Reward]:
    """The second reward called `contains` becomes contains_2, the third contains_3: one metric each."""
    taken: set[str] = set()
    out = []
    for reward in rewards:
        name, n = reward.name, 1
        while name in taken:
            n += 1
            name = f"{reward.name}_{n}"
        taken.add(name)
        out.append(reward if name == reward.name else replace(reward, name=name))
    return out


def build_rewards(specs: Iterable[RewardSpec], user_fns: Iterable[Callable[..., Any]] = ()) -> list[Reward]:
    """The recipe's built-ins, then the user's functions (weight 1.0 each unless @reward says), uniquely named.

    Every bad spec is reported at once in one ConfigError; none at all is an error too."""
    rewards, problems = [], []
    for i, spec in enumerate(specs):
        try:
            rewards.append(from_spec(spec, where=f"train.rewards[{i}]"))
        except ConfigError as exc:
            problems.extend(exc.problems)
    for fn in user_fns:
        if not callable(fn):
            problems.append(f"reward_fns: {fn!r} is not a function; give functions (completion: str, record: dict) -> float")
        else:  # @reward's marks, else weight 1.0, one completion a call
            named = getattr(fn, "reward_name", None) or name_of(fn)
            weight, batched = getattr(fn, "reward_weight", 1.0), getattr(fn, "reward_batched", False)
            rewards.append(Reward(name=named, weight=weight, fn=fn, batched=batched))
    if problems:
        raise ConfigError(problems)
    if not rewards:
        raise ConfigError([NEED_ONE])
    return unique_names(rewards)


def clip(text: str) -> str:
    """`text` quoted, cut to SHOWN_CHARS characters for an error message."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def run_one(reward: Reward, completion: str, record: Mapping[str, Any], prompt: str) -> float:
    """One reward of one completion as a finite float; a RewardError naming them when it is not."""
    where = f"reward '{reward.name}'\n  prompt: {clip(prompt)}\n  completion: {clip(completion)}"
    try:
        value = reward.fn(completion, record)
    except Exception as exc:
        hint = exc.hint if isinstance(exc, FinetuneError) else "fix the function: it gets (completion: str, record: dict)"
        raise RewardError(f"{where}\n  raised {type(exc).__name__}: {exc}", hint=hint) from exc
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(
            f"{where}\n  returned {value!r} ({type(value).__name__}), not a finite number",
            hint="a reward returns a finite float (a tensor: return x.item())",
        )
    return float(value)


def run_batched(
    reward: Reward, completions: Sequence[str], records: Sequence[Mapping[str, Any]], prompts: Sequence[str]
) -> list[float]:
    """A batched reward of a micro-batch's completions: one finite float each, or a RewardError naming the one."""
    where = f"reward '{reward.name}' (batched, {len(completions)} completions)"
    try:
        values = reward.fn(list(completions), list(records))
    except Exception as exc:
        hint = exc.hint if isinstance(exc, FinetuneError) else "fix the function: it gets (completions: list, records: list)"
        raise RewardError(f"{where}\n  raised {type(exc).__name__}: {exc}", hint=hint) from exc
    values = values.tolist() if hasattr(values, "tolist") and not isinstance(values, list) else values  # torch, numpy
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{type(values).__name__}"
        raise RewardError(f"{where}\n  returned {got}", hint="a batched reward returns a list of one float per completion")
    for i, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"{where}\n  returned {value!r} for completion {i}\n  prompt: {clip(prompts[i])}\n"
                f"  completion: {clip(completions[i])}",
                hint="a reward returns finite floats",
            )
    return [float(v) for v in values]


def score(
    rewards: Sequence[Reward], completions: Sequence[str], records: Sequence[Mapping[str, Any]], prompts: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reward of each completion, (n, k) float32, and their weighted total, (n,) float32."""
    if not len(completions) == len(records) == len(prompts):
        raise ValueError(f"score: {len(completions)} completions, {len(records)} records, {len(prompts)} prompts")
    columns = [
        run_batched(r, completions, records, prompts)
        if r.batched
        else [run_one(r, c, rec, p) for c, rec, p in zip(completions, records, prompts)]
        for r in rewards
    ]
    each = torch.tensor(columns, dtype=torch.float64).reshape(len(rewards), len(completions)).T
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float64)
    return each.float(), (each @ weights).float()


def load_reward_file(path: str | Path) -> list[Callable[..., Any]]:
    """The reward functions of the user's own Python file (`finetune run --rewards FILE.py` only).

    This runs the file's code, so only a flag the user types reaches it; a recipe never names code.
    The rewards are the module's REWARDS list if it has one, else every top-level function whose
    name starts with reward_, in the order the file defines them."""
    path = Path(path)
    if not path.is_file():
        raise RewardError(f"--rewards: no file {str(path)!r}", hint="give the path of a .py file defining reward_* functions")
    name = f"finetune_user_rewards_{next(_module_ids)}_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"--rewards: {str(path)!r} cannot be imported as Python", hint="give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardError(
            f"--rewards: importing {str(path)!r} raised {type(exc).__name__}: {exc}",
            hint=f"run `python {path}` to see the traceback",
        ) from exc
    return rewards_of(module, path)


def rewards_of(module: Any, path: Path) -> list[Callable[..., Any]]:
    """REWARDS if the module defines it, else its reward_* functions; an error when there are none."""
    found = getattr(module, "REWARDS", None)
    where = f"--rewards {str(path)!r}"
    if found is not None:
        if not isinstance(found, (list, tuple)) or not found:
            raise RewardError(f"{where}: REWARDS is {found!r}", hint="make REWARDS a non-empty list of functions")
        bad = [i for i, fn in enumerate(found) if not callable(fn)]
        if bad:
            raise RewardError(f"{where}: REWARDS[{bad[0]}] is {found[bad[0]]!r}, not a function", hint="list functions only")
        return list(found)
    fns = [fn for key, fn in vars(module).items() if key.startswith("reward_") and callable(fn) and not isinstance(fn, type)]
    if not fns:
        raise RewardError(
            f"{where} defines no rewards",
            hint="define a REWARDS list of functions, or functions named reward_* taking (completion: str, record: dict)",
        )
    return fns
