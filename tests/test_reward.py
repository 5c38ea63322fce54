"""Reward functions: the built-ins against references written out here (hypothesis for the digits
scorer and the math answer extractor, exact cases for ``\\boxed`` nesting), scoring a batch and every
way a sample fails, loading by name through the registry (a test plugin's function used by name) and
from a user's file, every loading error, and a check that none of it imports torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl_core import RewardFunction, hookimpl
from verl_core.descriptors import is_file_spec
from verl_core.errors import DuplicateNameError, RewardError, UnknownNameError
from verl_core.plugins import Registry
from verl_core.reward import RewardScores, catalog, load_reward_function, score_responses
from verl_core.reward.builtin import (
    digits,
    exact_match,
    extract_answer,
    extract_boxed,
    math_answer,
    parse_number,
)

REGISTRY = Registry.from_plugins(autoload=False)  # core's built-ins only
DIGIT = "0123456789"


def truth(value: object) -> dict[str, object]:
    return {"ground_truth": value, "data_source": "test"}


# -- digits ---------------------------------------------------------------------------------------


def digits_reference(response: str, truth_digits: str) -> float:
    """The formula, one position at a time: matching positions over the longer length."""
    answer = ""
    for char in response.lstrip():
        if char not in DIGIT:
            break
        answer += char
    matching = 0
    for i in range(min(len(answer), len(truth_digits))):
        if answer[i] == truth_digits[i]:
            matching += 1
    return matching / max(len(answer), len(truth_digits))


@settings(max_examples=300, deadline=None)
@given(
    truth_digits=st.text(DIGIT, min_size=1, max_size=8),
    answer=st.text(DIGIT, max_size=9),
    before=st.sampled_from(["", " ", "\n  "]),
    after=st.sampled_from(["", " ", "\n", " 999", "x7", ".5", "-1", " and 12"]),
)
def test_digits_scores_matching_positions_over_the_longer_length(truth_digits, answer, before, after):
    # Without an answer, digits that follow are the answer read: " 999" scores "999" as exact.
    assume(answer or not after.strip()[:1].isdigit())
    response = before + answer + after
    result = digits("prompt", response, truth(truth_digits))
    assert result["score"] == pytest.approx(digits_reference(response, truth_digits), abs=1e-12)
    assert result["exact"] == (1.0 if answer == truth_digits else 0.0)
    assert (result["score"] == 1.0) == (answer == truth_digits)
    assert 0.0 <= result["score"] <= 1.0


@pytest.mark.parametrize(
    ("response", "truth_digits", "score"),
    [
        ("321", "321", 1.0),
        (" 321\n", "321", 1.0),
        ("3215", "321", 3 / 4),  # a length mismatch costs
        ("32", "321", 2 / 3),
        ("123", "321", 1 / 3),
        ("", "321", 0.0),
        ("the answer is 321", "321", 0.0),  # read from the start only
        ("32 1", "321", 2 / 3),
    ],
)
def test_digits_exact_cases(response, truth_digits, score) -> None:
    assert digits("", response, truth(truth_digits))["score"] == pytest.approx(score)


def test_digits_reads_integer_and_nested_ground_truths_and_refuses_non_digit_ones() -> None:
    assert digits("", "42", truth(42)) == {"score": 1.0, "exact": 1.0}
    assert digits("", "42", {"reward_model": {"ground_truth": "42"}})["exact"] == 1.0  # verl's layout
    with pytest.raises(RewardError, match=r"'digits' needs a 'ground_truth' of the digits 0-9, got '4\.2'"):
        digits("", "42", truth("4.2"))
    with pytest.raises(RewardError, match="got ''"):
        digits("", "42", truth(" "))


# -- math_answer ----------------------------------------------------------------------------------


@st.composite
def rendered_numbers(draw: st.DrawFn) -> tuple[str, float]:
    """A number in one of the forms the extractor reads, and its value."""
    form = draw(st.sampled_from(["integer", "thousands", "decimal", "leading-dot", "fraction", "latex"]))
    sign = draw(st.sampled_from(["", "-"]))
    if form == "integer":
        n = draw(st.integers(0, 10**12))
        return f"{sign}{n}", float(f"{sign}{n}")
    if form == "thousands":
        n = draw(st.integers(1000, 10**12))
        return f"{sign}{n:,}", float(f"{sign}{n}")
    if form in ("decimal", "leading-dot"):
        whole = "" if form == "leading-dot" else str(draw(st.integers(0, 10**6)))
        fraction = draw(st.text(DIGIT, min_size=1, max_size=6))
        text = f"{sign}{whole}.{fraction}"
        return text, float(text)
    numerator, denominator = draw(st.integers(0, 999)), draw(st.integers(1, 999))
    value = (-1 if sign else 1) * numerator / denominator
    if form == "fraction":
        return f"{sign}{numerator}/{denominator}", value
    command = draw(st.sampled_from(["frac", "dfrac", "tfrac"]))
    return f"{sign}\\{command}{{{numerator}}}{{{denominator}}}", value


NOISE = st.sampled_from(["", "First 12 apples and 3.5 pears, ", "Steps: 1, 2, 3. ", "x2 - 7 = y; "])


@settings(max_examples=300, deadline=None)
@given(number=rendered_numbers(), noise=NOISE, end=st.sampled_from(["", ".", "!", " ", "\n"]))
def test_the_last_number_in_the_text_is_the_answer(number, noise, end) -> None:
    text, value = number
    response = f"{noise}So the answer is {text}{end}"
    assert extract_answer(response) == text
    parsed = parse_number(text)
    assert parsed is not None and math.isclose(parsed, value, rel_tol=1e-12, abs_tol=1e-300)
    assert math_answer("", response, truth(repr(value))) == {"score": 1.0, "answer_found": 1.0}
    wrong = value + max(1.0, abs(value))  # off by more than any tolerance
    assert math_answer("", response, truth(repr(wrong))) == {"score": 0.0, "answer_found": 1.0}


@settings(max_examples=200, deadline=None)
@given(number=rendered_numbers(), after=st.sampled_from(["", " (checked 3 times, 2 ways)", " = 17"]))
def test_the_last_boxed_answer_wins_over_any_number(number, after) -> None:
    text, value = number
    response = f"Try 5 first: \\boxed{{5}} is wrong. Finally \\boxed{{{text}}}{after}"
    assert extract_answer(response) == text
    assert math_answer("", response, truth(str(value)))["score"] == 1.0


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"so \boxed{a^{2} + b_{i}^{3}} holds", r"a^{2} + b_{i}^{3}"),
        (r"\boxed{1} or \boxed{2}", "2"),  # the last one
        (r"\boxed{3} and then \boxed{unclosed", "3"),  # an unclosed one is skipped
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        (r"\boxed{\boxed{7}}", "7"),
        (r"\boxed {42}", "42"),
        (r"\boxed{\text{yes}}", r"\text{yes}"),
        (r"\boxed{}", ""),
        (r"\boxed{x \\ y}", r"x \\ y"),  # a LaTeX line break is not an escaped brace
        ("no box here", None),
        (r"\boxed{{unbalanced}", None),
    ],
)
def test_boxed_content_has_balanced_braces(text, content) -> None:
    assert extract_boxed(text) == content


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("It costs 1,234.", "1,234"),
        ("1,234,567.25 in total", "1,234,567.25"),
        ("the list 1, 2, 3", "3"),
        ("between 3-4", "4"),  # a range, not -4
        ("-7 degrees", "-7"),
        ("(-7)", "-7"),
        ("3 apples and .5 kg", ".5"),
        (r"half: \frac{1}{2}", r"\frac{1}{2}"),
        ("3/4 of it", "3/4"),
        ("version v1.2 of x2", None),  # glued to words
        ("no digits", None),
    ],
)
def test_the_last_number_exact_cases(text, answer) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("answer", "ground_truth", "score"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{1/2}", "0.5", 1.0),
        (r"\boxed{$0.50$}", r"\frac{1}{2}", 1.0),
        (r"\boxed{.5}", "1/2", 1.0),
        (r"\boxed{1 000}", "1000", 1.0),  # spaces are stripped
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{1.0000001}", "1", 1.0),  # within the relative tolerance 1e-6
        (r"\boxed{1.00001}", "1", 0.0),
        (r"\boxed{0}", "0.0", 1.0),
        (r"\boxed{x + 1}", "x+1", 1.0),  # not numbers: normalised strings
        (r"\boxed{x+1}", "$x + 1$", 1.0),
        (r"\boxed{x+2}", "x+1", 0.0),
        (r"\boxed{1/0}", "1/0", 1.0),  # no number, the same string
        ("The answer is 72.", 72, 1.0),
        ("The answer is 71.", 72, 0.0),
    ],
)
def test_math_answer_compares_numbers_numerically_and_the_rest_as_strings(answer, ground_truth, score):
    assert math_answer("", answer, truth(ground_truth)) == {"score": score, "answer_found": 1.0}


def test_math_answer_reports_when_no_answer_was_found() -> None:
    assert math_answer("", "I do not know.", truth("3")) == {"score": 0.0, "answer_found": 0.0}


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e5", "1,23", "", "$", "1/0", "abc", "1.2.3"])
def test_parse_number_refuses_what_is_not_a_number_of_the_listed_forms(text) -> None:
    assert parse_number(text) is None


# -- exact_match and the ground truth -------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "ground_truth", "score"),
    [("Paris", "Paris", 1.0), ("  Paris\n", " Paris ", 1.0), ("paris", "Paris", 0.0), ("42", 42, 1.0)],
)
def test_exact_match(response, ground_truth, score) -> None:
    assert exact_match("", response, truth(ground_truth)) == score


@pytest.mark.parametrize("function", [exact_match, math_answer, digits])
def test_a_missing_ground_truth_names_the_key_and_the_columns_present(function) -> None:
    with pytest.raises(RewardError) as error:
        function("", "1", {"data_source": "gsm8k", "answer": "1"})
    message = str(error.value)
    assert f"'{function.__name__}'" in message and "'ground_truth'" in message and "is missing" in message
    assert "columns are: answer, data_source" in message
    with pytest.raises(RewardError, match="'ground_truth', which is None"):
        function("", "1", {"ground_truth": None})
    with pytest.raises(RewardError, match="columns are: none"):
        function("", "1", {})


# -- scoring a batch ------------------------------------------------------------------------------


def scored_by_rule(prompt, response, extra):
    """Floats, bools and dicts with metrics, depending on the row (for the scoring tests)."""
    kind = extra["kind"]
    if kind == "float":
        return 0.25
    if kind == "bool":
        return response == "yes"
    if kind == "fraction":
        return Fraction(1, 2)
    return {"score": 1.0, "length": len(response), "polite": response.endswith("please")}


def test_scores_and_the_means_of_the_metrics_over_the_samples_that_returned_them() -> None:
    kinds = ["float", "bool", "bool", "fraction", "dict", "dict"]
    responses = ["a", "yes", "no", "b", "ok please", "abc"]
    result = score_responses(scored_by_rule, ["p"] * 6, responses, [{"kind": kind} for kind in kinds])
    assert result.scores == [0.25, 1.0, 0.0, 0.5, 1.0, 1.0]
    assert all(type(score) is float for score in result.scores)
    assert result.metrics == {"length": (9 + 3) / 2, "polite": (1.0 + 0.0) / 2}
    assert result.step_metrics() == {"reward/length": 6.0, "reward/polite": 0.5}
    assert (result.num_errors, result.first_error) == (0, None)
    assert score_responses(scored_by_rule, [], [], []) == RewardScores([], {}, 0, None)


def test_numpy_scalars_and_zero_dimensional_arrays_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    returned = [np.float32(0.5), np.bool_(True), np.array(2.0), {"score": np.int64(3), "m": np.float64(1.5)}]
    result = score_responses(
        lambda p, r, e: returned[e["i"]], ["p"] * 4, ["r"] * 4, [{"i": i} for i in range(4)]
    )
    assert result.scores == [0.5, 1.0, 2.0, 3.0]
    assert result.metrics == {"m": 1.5}
    with pytest.raises(RewardError, match="which is a ndarray, not a number"):
        score_responses(lambda p, r, e: np.array([1.0, 2.0]), ["p"], ["r"], [{}])


def failing(prompt, response, extra):
    if extra["mode"] == "raise":
        raise ValueError("cannot parse the response")
    return extra["returns"]


BAD_RESULTS = [
    ("yes", ["returned 'yes'", "which is a str, not a number"]),
    (None, ["returned None", "which is a NoneType, not a number"]),
    (float("nan"), ["returned nan", "not a finite number"]),
    (-math.inf, ["returned -inf", "not a finite number"]),
    ([1.0], ["returned [1.0]", "a list, not a number"]),
    ({"acc": 1.0}, ["a dict without a 'score' key (its keys: 'acc')"]),
    ({"score": "1"}, ["whose 'score' is a str, not a number"]),
    ({"score": 1.0, "acc": math.nan}, ["whose 'acc' is nan, not a finite number"]),
    ({"score": 1.0, 3: 1.0}, ["whose key 3 is not a metric name"]),
]


@pytest.mark.parametrize(("returned", "expected"), BAD_RESULTS)
def test_a_result_that_is_not_a_score_names_the_function_the_sample_and_what_it_returned(returned, expected):
    extras = [{"mode": "return", "returns": 1.0}, {"mode": "return", "returns": returned}]
    with pytest.raises(RewardError) as error:
        score_responses(failing, ["p0", "p1"], ["r0", "r1"], extras, name="my_rewards.py:failing")
    message = str(error.value)
    assert message.startswith("reward function 'my_rewards.py:failing' failed on sample 1: ")
    assert "\n  prompt: 'p1'\n  response: 'r1'" in message
    assert "returns a number, or a dict with a 'score' key" in message
    for part in expected:
        assert part in message


def test_an_exception_names_the_sample_and_is_chained() -> None:
    extras = [{"mode": "return", "returns": 1}, {"mode": "raise"}]
    with pytest.raises(RewardError) as error:
        score_responses(failing, ["What is 2+2?", "Reverse 123."], ["4", "321"], extras)
    message = str(error.value)
    assert message.startswith("reward function 'failing' failed on sample 1: raised ValueError: cannot parse")
    assert "prompt: 'Reverse 123.'" in message and "response: '321'" in message
    assert isinstance(error.value.__cause__, ValueError)


def test_long_prompts_and_responses_are_shortened_to_their_start_and_end() -> None:
    prompt = "S" + "p" * 998 + "E"
    response = "<think>" + "r" * 5000 + "answer: 7"
    with pytest.raises(RewardError) as error:
        score_responses(failing, [prompt], [response], [{"mode": "raise"}])
    message = str(error.value)
    assert len(message) < 800
    prompt_line = next(line for line in message.splitlines() if line.startswith("  prompt: "))
    assert prompt_line.startswith("  prompt: 'Sppp") and prompt_line.endswith("ppE' (1000 characters)")
    assert " ... " in prompt_line
    assert "'<think>rrr" in message and "answer: 7' (5016 characters)" in message


def test_on_error_zero_scores_failures_zero_counts_them_and_keeps_the_first_message() -> None:
    extras = [
        {"mode": "return", "returns": {"score": 0.5, "acc": 1.0}},
        {"mode": "raise"},
        {"mode": "return", "returns": "bad"},
        {"mode": "return", "returns": {"score": 1.0, "acc": 0.0}},
    ]
    result = score_responses(failing, ["p"] * 4, ["r0", "r1", "r2", "r3"], extras, on_error="zero")
    assert result.scores == [0.5, 0.0, 0.0, 1.0]
    assert result.num_errors == 2
    assert result.metrics == {"acc": 0.5}  # over the two samples that returned it
    assert result.first_error.startswith("reward function 'failing' failed on sample 1: raised ValueError")


def test_scoring_refuses_a_bad_failure_mode_and_unequal_lists() -> None:
    with pytest.raises(ValueError, match="on_error='skip'.*fail, zero"):
        score_responses(failing, [], [], [], on_error="skip")
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 extras"):
        score_responses(failing, ["a", "b"], ["a"], [{}, {}])


# -- the registry ---------------------------------------------------------------------------------


def length_reward(prompt, response, extra):
    """A third party's reward: shorter is better."""
    return {"score": 1.0 / (1 + len(response)), "chars": len(response)}


def make_plugin(name: str, **hooks: Callable[[], list]) -> types.ModuleType:
    """A plugin module, as an entry point would name one."""
    module = types.ModuleType(name)
    for hook_name, implementation in hooks.items():
        setattr(module, hook_name, hookimpl(implementation))
    return module


REWARD_PLUGIN = make_plugin(
    "acme_rewards",
    # By import string, like a real plugin: imported only when the reward function is looked up.
    verl_reward_functions=lambda: [RewardFunction(name="acme_length", function=f"{__name__}:length_reward")],
)


def test_the_builtins_come_through_the_hook_and_load_by_name() -> None:
    registry = Registry.from_plugins()
    entries = {entry.name: entry for entry in registry.entries("reward_functions")}
    assert {name for name, entry in entries.items() if entry.plugin == "verl_core"} == {
        "exact_match",
        "math_answer",
        "digits",
    }
    assert [descriptor.name for descriptor in catalog.REWARD_FUNCTIONS] == [
        "exact_match",
        "math_answer",
        "digits",
    ]
    assert all(entry.status == "ok" and entry.distribution == "verl-core" for entry in entries.values())
    assert load_reward_function("exact_match", registry) is exact_match
    assert load_reward_function("math_answer", registry) is math_answer
    assert load_reward_function("digits", registry) is digits


def test_a_plugins_reward_function_is_used_by_name() -> None:
    registry = Registry.from_plugins([REWARD_PLUGIN], autoload=False)
    assert registry.entry("reward_functions", "acme_length").plugin == "acme_rewards"
    function = load_reward_function("acme_length", registry)
    result = score_responses(function, ["p", "p"], ["abc", ""], [{}, {}], name="acme_length")
    assert result.scores == [0.25, 1.0]
    assert result.step_metrics() == {"reward/chars": 1.5}


def test_an_unknown_name_lists_the_installed_ones_and_the_close_match() -> None:
    registry = Registry.from_plugins([REWARD_PLUGIN], autoload=False)
    with pytest.raises(UnknownNameError) as error:
        load_reward_function("exactmatch", registry)
    message = str(error.value)
    assert "Unknown reward function 'exactmatch' (from reward.function)" in message
    assert "(did you mean 'exact_match'?)" in message
    for name in ("exact_match", "math_answer", "digits", "acme_length"):
        assert name in message


def test_a_plugin_replacing_a_builtin_must_say_so() -> None:
    silent = make_plugin(
        "silent", verl_reward_functions=lambda: [RewardFunction(name="exact_match", function=length_reward)]
    )
    with pytest.raises(DuplicateNameError, match="'silent'.*'verl_core'|'verl_core'.*'silent'"):
        load_reward_function("exact_match", Registry.from_plugins([silent], autoload=False))
    explicit = make_plugin(
        "explicit",
        verl_reward_functions=lambda: [
            RewardFunction(name="exact_match", function=length_reward, override=True)
        ],
    )
    assert (
        load_reward_function("exact_match", Registry.from_plugins([explicit], autoload=False))
        is length_reward
    )


def test_a_registered_function_with_the_wrong_signature_is_refused_when_loaded() -> None:
    def two_arguments(response, ground_truth):
        return 1.0

    plugin = make_plugin(
        "wrong", verl_reward_functions=lambda: [RewardFunction(name="wrong_sig", function=two_arguments)]
    )
    with pytest.raises(RewardError) as error:
        load_reward_function("wrong_sig", Registry.from_plugins([plugin], autoload=False))
    message = str(error.value)
    assert "reward.function='wrong_sig'" in message and "plugin 'wrong'" in message
    assert (
        "(response, ground_truth)" in message and "cannot be called as fn(prompt, response, extra)" in message
    )


# -- loading from a file --------------------------------------------------------------------------

USER_FILE = '''
"""A user's reward functions."""
from math import sqrt

THRESHOLD = 0.5


def helper_score(prompt, response, extra):
    return {"score": float(response == extra["ground_truth"]), "root": sqrt(len(response))}


class Scorer:
    def __call__(self, prompt, response, extra):
        return 1.0


scorer = Scorer()


def score_with_defaults(prompt, response, extra, *, weight=2.0):
    return weight
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("exact_match", False),
        ("rewards.py:score", True),
        ("path/to/rewards.py:score", True),
        ("C:\\runs\\rewards.py:score", True),  # the last ':' splits
        ("rewards.py", False),
        ("rewards.txt:score", False),
        ("my_package.rewards:score", False),
    ],
)
def test_is_file_spec(spec, expected) -> None:
    assert is_file_spec(spec) is expected


def test_a_function_in_a_user_file_is_loaded_by_relative_and_absolute_path(tmp_path, monkeypatch) -> None:
    file = write(tmp_path / "runs" / "rewards.py", USER_FILE)
    monkeypatch.chdir(tmp_path)
    function = load_reward_function("runs/rewards.py:helper_score")
    assert function("p", "abcd", {"ground_truth": "abcd"}) == {"score": 1.0, "root": 2.0}
    assert load_reward_function(f"{file}:score_with_defaults")("p", "r", {}) == 2.0
    assert load_reward_function(f"{file}:scorer")("p", "r", {}) == 1.0  # any callable object
    assert function.__module__.startswith("verl_core_reward_file_rewards_")
    assert str(tmp_path / "runs") not in sys.path  # imported from its path, not through sys.path


def test_user_files_shadow_nothing_and_same_names_stay_apart(tmp_path) -> None:
    first = write(tmp_path / "a" / "math.py", "def score(prompt, response, extra):\n    return 1.0\n")
    second = write(tmp_path / "b" / "math.py", "def score(prompt, response, extra):\n    return 2.0\n")
    score_a = load_reward_function(f"{first}:score")
    score_b = load_reward_function(f"{second}:score")
    assert (score_a("", "", {}), score_b("", "", {})) == (1.0, 2.0)
    assert score_a.__module__ != score_b.__module__
    assert sys.modules["math"].sqrt(4.0) == 2.0  # the standard library's math is untouched


def test_a_missing_file_names_the_path_and_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as error:
        load_reward_function("missing/rewards.py:score")
    message = str(error.value)
    assert "reward.function='missing/rewards.py:score'" in message
    assert f"no file missing/rewards.py (resolved to {tmp_path / 'missing' / 'rewards.py'})" in message
    assert f"relative paths are relative to the working directory, {tmp_path}" in message


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("rewards.txt:score", "'rewards.txt' is not a .py file"),
        (
            "my_package.rewards:score",
            "'my_package.rewards' is not a .py file; a function of an installed package",
        ),
        ("rewards.py", "names a file but no function in it: write 'rewards.py:function_name'"),
        ("rewards.py:", "names no function after ':'"),
        ("runs/rewards", "looks like a path but names no .py file and function"),
        ("", "expected a registered name ('exact_match'"),
    ],
)
def test_a_value_that_is_neither_a_name_nor_a_file_spec_says_what_is_expected(spec, expected) -> None:
    with pytest.raises(RewardError) as error:
        load_reward_function(spec, REGISTRY)
    assert expected in str(error.value)
    assert f"reward.function={spec!r}" in str(error.value)


def test_a_file_that_raises_on_import_is_named_and_the_cause_chained(tmp_path) -> None:
    file = write(tmp_path / "broken.py", "import json\n\nTABLE = 1 / 0\n")
    with pytest.raises(RewardError) as error:
        load_reward_function(f"{file}:score")
    assert f"importing {file} raised ZeroDivisionError: division by zero" in str(error.value)
    assert isinstance(error.value.__cause__, ZeroDivisionError)
    # Not left half-imported (another test's broken.py may be loaded: this file's module is the point).
    assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(file.resolve())]

    syntax = write(tmp_path / "syntax.py", "def score(prompt, response, extra)\n    return 1\n")
    with pytest.raises(RewardError, match="importing .*syntax.py raised SyntaxError") as error:
        load_reward_function(f"{syntax}:score")
    assert isinstance(error.value.__cause__, SyntaxError)


def test_a_missing_function_lists_what_the_file_defines_and_the_close_match(tmp_path) -> None:
    file = write(tmp_path / "rewards.py", USER_FILE)
    with pytest.raises(RewardError) as error:
        load_reward_function(f"{file}:helper_scor")
    message = str(error.value)
    assert f"{file} defines no 'helper_scor'" in message
    assert (
        "Its functions: Scorer, helper_score, score_with_defaults, scorer." in message
    )  # not the imported sqrt
    assert "(did you mean 'helper_score'?)" in message


def test_an_object_that_is_not_callable_or_takes_other_arguments_is_refused(tmp_path) -> None:
    file = write(tmp_path / "rewards.py", USER_FILE + "\ndef one(response):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"'THRESHOLD' in .*rewards.py is a float \(0.5\), not a function"):
        load_reward_function(f"{file}:THRESHOLD")
    with pytest.raises(RewardError) as error:
        load_reward_function(f"{file}:one")
    message = str(error.value)
    assert f"'one' in {file} has the signature (response)" in message
    assert "def score(prompt: str, response: str, extra: dict)" in message
    with pytest.raises(RewardError, match=r"'Scorer' in .* has the signature \(\), which cannot be called"):
        load_reward_function(f"{file}:Scorer")  # the class: an instance of it would be a reward function


# -- staying light --------------------------------------------------------------------------------

LIGHT_CHECK = """
import json, sys
import verl_core.reward
from verl_core.plugins import Registry
from verl_core.reward import load_reward_function, score_responses
registry = Registry.from_plugins(autoload=False)
names = registry.names("reward_functions")
scores = [
    score_responses(load_reward_function(name, registry), ["p"], ["42"], [{"ground_truth": "42"}]).scores[0]
    for name in names
]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "cattrs", "yaml", "transformers"))
print(json.dumps({"names": names, "scores": scores, "heavy": heavy}))
"""


def test_listing_loading_and_scoring_the_builtins_imports_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LIGHT_CHECK], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(result.stdout)
    assert report["names"] == ["digits", "exact_match", "math_answer"]
    assert report["scores"] == [1.0, 1.0, 1.0]
    assert report["heavy"] == []
