"""GRPO rewards (finetune/objectives/rewards.py): each built-in on golden completions, the recipe's
options checked, weights and totals, unique metric names, the errors that name what failed, and
the user's reward file."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from finetune.config.sections import RewardSpec
from finetune.errors import ConfigError, RewardError
from finetune.objectives.rewards import NEED_ONE, Reward, build_rewards, from_spec, load_reward_file, score


def run(name: str, completion: str, record: dict | None = None, **options) -> float:
    return from_spec(RewardSpec(name=name, **options)).fn(completion, record or {})


@pytest.mark.parametrize(
    "completion, answer, expected",
    [("  Paris \n", "Paris", 1.0), ("Paris.", "Paris", 0.0), ("paris", "Paris", 0.0), ("42", 42, 1.0), ("4 2", "42", 0.0)],
)
def test_exact_match(completion, answer, expected):
    assert run("exact_match", completion, {"answer": answer}, column="answer") == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("it is 4.", "4", 1.0),
        ("the answer is 42", "4", 0.0),  # a word boundary after a digit
        ("in New York City", " New York ", 1.0),  # the answer is stripped
        ("a New Yorker", "New York", 0.0),
        ("i love new york", "New York", 0.0),  # case counts
        ("I use C++ daily", "C++", 1.0),  # ends in no word character: no boundary asked there
        ("xC++", "C++", 0.0),
        ("cost:$5", "$5", 1.0),
        ("cost: $50", "$5", 0.0),
    ],
)
def test_contains_matches_whole_words(completion, answer, expected):
    assert run("contains", completion, {"answer": answer}, column="answer") == expected


def test_format_searches_the_pattern():
    options = {"pattern": r"<answer>\d+</answer>"}
    assert run("format", "think... <answer>12</answer> done", **options) == 1.0
    assert run("format", "<answer>twelve</answer>", **options) == 0.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is 42.", "42", 1.0),
        ("1,234 apples", 1234, 1.0),
        ("we need -1,234.50 in total", "-1234.5", 1.0),
        ("x = -3", "-3", 1.0),
        ("5-3", "3", 1.0),  # a minus after a digit subtracts
        ("5-3", "-3", 0.0),
        ("half: 0.5", "1/2", 1.0),
        ("2/4", 0.5, 1.0),
        ("3/4", "0.75", 1.0),
        ("about .5 of it", "2/4", 1.0),
        ("0.1", 0.1, 1.0),  # the float the user wrote, not its binary neighbour
        ("12.50", " 12.5 ", 1.0),
        ("first 7 then 8", 7, 0.0),  # the last number counts
        ("first 7 then 8", 8, 1.0),
        ("1,2,3", 3, 1.0),
        ("version v2", 2, 0.0),  # inside a word: no number
        ("no number here", 0, 0.0),
        ("1/0", 0, 0.0),
    ],
)
def test_numeric_compares_the_last_number_as_a_fraction(completion, answer, expected):
    assert run("numeric", completion, {"answer": answer}, column="answer") == expected


@pytest.mark.parametrize("value", ["forty", "42 apples", True, float("nan")])
def test_numeric_refuses_a_record_value_that_is_no_number(value):
    with pytest.raises(RewardError, match=r"the record's 'answer' is .*not a number") as caught:
        run("numeric", "42", {"answer": value}, column="answer")
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize("chars, expected", [(0, 0.0), (10, 0.0), (11, -0.1), (15, -0.5), (20, -1.0), (45, -1.0)])
def test_length_penalty(chars, expected):
    assert run("length", "x" * chars, target=10) == pytest.approx(expected)


@pytest.mark.parametrize(
    "completion, expected", [('{"a": 1}', 1.0), (" [1, 2]\n", 1.0), ("{a: 1}", 0.0), ("", 0.0), ('{"a": 1} and', 0.0)]
)
def test_json_parses(completion, expected):
    assert run("json", completion) == expected


@pytest.mark.parametrize("name", ["exact_match", "contains", "numeric"])
def test_a_record_without_the_column_names_it_and_the_keys(name):
    with pytest.raises(RewardError) as caught:
        run(name, "42", {"question": "q", "solution": "42"}, column="answer")
    assert "no column 'answer'" in str(caught.value) and "['question', 'solution']" in str(caught.value)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"name": "exact_match"}, "train.rewards (exact_match) needs `column`"),
        ({"name": "contains"}, "train.rewards (contains) needs `column`"),
        ({"name": "numeric"}, "train.rewards (numeric) needs `column`"),
        ({"name": "format"}, "train.rewards (format) needs `pattern`"),
        (
            {"name": "format", "pattern": "(<answer>"},
            "`pattern` '(<answer>' is not a regular expression: missing ), unterminated subpattern",
        ),
        ({"name": "length"}, "train.rewards (length) needs `target`"),
    ],
)
def test_from_spec_says_which_option_is_missing(options, says):
    with pytest.raises(ConfigError) as caught:
        from_spec(RewardSpec(**options))
    assert len(caught.value.problems) == 1 and says in caught.value.problems[0]


def test_build_rewards_reports_every_bad_spec_and_needs_one():
    specs = [RewardSpec(name="json"), RewardSpec(name="contains"), RewardSpec(name="length")]
    with pytest.raises(ConfigError) as caught:
        build_rewards(specs)
    assert [p.split(" needs")[0] for p in caught.value.problems] == ["train.rewards[1] (contains)", "train.rewards[2] (length)"]
    with pytest.raises(ConfigError) as caught:
        build_rewards([], ())
    assert caught.value.problems == [NEED_ONE]


def contains(completion, record):
    return 0.0


def test_names_are_unique_and_user_functions_come_last_with_weight_one():
    specs = [
        RewardSpec(name="contains", column="answer"),
        RewardSpec(name="contains", column="alias", weight=0.5),
        RewardSpec(name="json", weight=-2),
    ]
    rewards = build_rewards(specs, [contains, lambda c, r: 1.0])
    assert [(r.name, r.weight) for r in rewards] == [
        ("contains", 1.0),
        ("contains_2", 0.5),
        ("json", -2.0),
        ("contains_3", 1.0),
        ("lambda", 1.0),
    ]
    assert rewards[3].fn is contains


def test_score_gives_each_reward_and_the_weighted_total():
    rewards = build_rewards(
        [RewardSpec(name="exact_match", column="answer", weight=2.0), RewardSpec(name="length", target=4, weight=0.5)],
        [lambda completion, record: len(record["answer"])],
    )
    completions = ["yes", "no way"]
    records = [{"answer": "yes"}, {"answer": "yes"}]
    each, total = score(rewards, completions, records, ["q1", "q2"])
    assert each.dtype == torch.float32 and total.dtype == torch.float32
    assert each.tolist() == [[1.0, 0.0, 3.0], [0.0, -0.5, 3.0]]
    assert total.tolist() == [2.0 * 1 + 0.5 * 0 + 3.0, 2.0 * 0 + 0.5 * -0.5 + 3.0]


def test_a_raising_reward_is_named_with_its_prompt_and_completion():
    def reward_ratio(completion, record):
        return 1 / len(record)

    prompt = "P" * 150 + "Q" * 350
    with pytest.raises(RewardError) as caught:
        score([Reward("reward_ratio", 1.0, reward_ratio)], ["my answer"], [{}], [prompt])
    said = str(caught.value)
    assert "reward 'reward_ratio'" in said and "raised ZeroDivisionError: division by zero" in said
    assert "'my answer'" in said and "P" * 150 + "Q" * 50 + "'... (500 characters)" in said and "Q" * 51 not in said
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_a_built_in_failing_in_score_keeps_its_message_and_hint():
    rewards = build_rewards([RewardSpec(name="numeric", column="answer")])
    with pytest.raises(RewardError) as caught:
        score(rewards, ["7"], [{"label": 7}], ["what is 3 + 4?"])
    assert "reward 'numeric'" in str(caught.value) and "no column 'answer' (it has ['label'])" in str(caught.value)
    assert "'what is 3 + 4?'" in str(caught.value) and caught.value.hint.startswith("set train.rewards[].column")


@pytest.mark.parametrize(
    "value, says", [(math.nan, "returned nan (float)"), (math.inf, "returned inf (float)"), ("1.0", "returned '1.0' (str)")]
)
def test_a_reward_returning_no_finite_number_is_an_error(value, says):
    def reward_bad(completion, record):
        return value

    with pytest.raises(RewardError) as caught:
        score([Reward("reward_bad", 1.0, reward_bad)], ["out"], [{}], ["in"])
    assert says in str(caught.value) and "reward 'reward_bad'" in str(caught.value) and "'out'" in str(caught.value)


def test_load_reward_file_takes_the_rewards_list(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "def short(completion, record):\n    return float(len(completion) < 5)\n\n"
        "def reward_unlisted(completion, record):\n    return 9.0\n\n"
        "REWARDS = [short, lambda completion, record: 2.0]\n"
    )
    fns = load_reward_file(path)
    assert [fn.__name__ for fn in fns] == ["short", "<lambda>"] and [fn("abc", {}) for fn in fns] == [1.0, 2.0]
    assert [r.name for r in build_rewards([], fns)] == ["short", "lambda"]


def test_load_reward_file_takes_reward_functions_in_file_order(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass reward_Config:\n    n: int = 1\n\n"
        "def reward_b(completion, record):\n    return 1.0\n\n"
        "def helper(completion, record):\n    return 0.0\n\n"
        "def reward_a(completion, record):\n    return 2.0\n"
    )
    assert [fn.__name__ for fn in load_reward_file(path)] == ["reward_b", "reward_a"]
    first, again = load_reward_file(path)[0], load_reward_file(path)[0]
    assert first.__module__ != again.__module__  # a second load does not replace the first's module
    assert sys.modules[first.__module__].reward_b is first and sys.modules[again.__module__].reward_b is again


def test_load_reward_file_errors(tmp_path):
    with pytest.raises(RewardError, match=r"--rewards: no file '.*nothing\.py'"):
        load_reward_file(tmp_path / "nothing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("def helper(completion, record):\n    return 1.0\n")
    with pytest.raises(RewardError, match="defines no rewards") as caught:
        load_reward_file(empty)
    assert "REWARDS" in caught.value.hint and "reward_*" in caught.value.hint
    broken = tmp_path / "broken.py"
    broken.write_text("def reward_x(:\n")
    with pytest.raises(RewardError, match=r"importing '.*broken\.py' raised SyntaxError"):
        load_reward_file(broken)
    listed = tmp_path / "listed.py"
    listed.write_text("REWARDS = [len, 'reward_x']\n")
    with pytest.raises(RewardError, match=r"REWARDS\[1\] is 'reward_x', not a function"):
        load_reward_file(listed)


def test_your_rewards_carry_their_weight_and_a_batched_one_scores_the_micro_batch_in_one_call(tmp_path):
    from finetune import reward

    calls: list[int] = []

    @reward(batched=True, weight=2.0, name="judge")
    def reward_judge(completions, records):
        import numpy as np

        calls.append(len(completions))
        return np.array([float(len(c)) for c in completions])  # an array (numpy, torch) is taken as a list

    @reward(weight=-0.5)
    def reward_short(completion, record):
        return float(len(completion) < 3)

    rewards = build_rewards([RewardSpec(name="exact_match", column="answer")], [reward_judge, reward_short])
    assert [(r.name, r.weight, r.batched) for r in rewards] == [
        ("exact_match", 1.0, False),
        ("judge", 2.0, True),
        ("reward_short", -0.5, False),
    ]
    each, total = score(rewards, ["ok", "fine", "no"], [{"answer": "ok"}] * 3, ["p1", "p2", "p3"])
    assert calls == [3]  # once for the three completions
    assert each.tolist() == [[1.0, 2.0, 1.0], [0.0, 4.0, 0.0], [0.0, 2.0, 1.0]]
    assert total.tolist() == [1.0 + 4.0 - 0.5, 8.0, 4.0 - 0.5]
    # the same marks from a --rewards file
    path = tmp_path / "mine.py"
    path.write_text("from finetune import reward\n\n@reward(weight=0.25)\ndef reward_a(completion, record):\n    return 1.0\n")
    assert [(r.name, r.weight) for r in build_rewards([], load_reward_file(path))] == [("reward_a", 0.25)]


@pytest.mark.parametrize(
    "returned, says",
    [([1.0], "returned 1 values"), (7.0, "returned float"), ([1.0, math.nan], "returned nan for completion 1")],
)
def test_a_batched_reward_returning_other_than_one_finite_float_each_is_named(returned, says):
    judge = Reward("judge", 1.0, lambda completions, records: returned, batched=True)
    with pytest.raises(RewardError) as caught:
        score([judge], ["first", "second"], [{}, {}], ["p", "q"])
    assert "reward 'judge' (batched, 2 completions)" in str(caught.value) and says in str(caught.value)
    if "completion 1" in says:
        assert "'second'" in str(caught.value) and "'q'" in str(caught.value)
    with pytest.raises(ConfigError, match="a weight is a finite number"):
        from finetune import reward

        reward(weight=math.inf)
