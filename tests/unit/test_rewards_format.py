"""Built-in format reward: <think>...</think><answer>...</answer> (grpo_rollout.rewards.builtin.format)."""

import itertools
import re

import pytest
from grpo_rollout.rewards.builtin.format import think_answer_format, well_formed


def test_format_reward():
    completions = [
        "<think>a\nb</think>\n<answer>3</answer>",
        "  <think></think><answer></answer>  ",
        "<answer>3</answer>",
        "<think>a</think><answer>3</answer> trailing",
        "<think>a</think>",
    ]
    assert think_answer_format(["p"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_agrees_with_the_r1_regex_on_every_short_arrangement_of_the_tags():
    r1 = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)
    parts = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x"]
    for n in range(1, 6):
        for combo in itertools.product(parts, repeat=n):
            text = "".join(combo)
            assert well_formed(text) is (r1.match(text.strip()) is not None), repr(text)


@pytest.mark.timeout(60, method="thread")
def test_an_unterminated_completion_of_many_seams_is_read_in_one_pass():
    # The R1 regex backtracks over every seam here: minutes for a few megabytes.
    completion = "<think>" + "</think><answer>" * 200_000 + "x"
    assert think_answer_format(["p"], [completion]) == [0.0]
    assert think_answer_format(["p"], [completion + "</answer>"]) == [1.0]
