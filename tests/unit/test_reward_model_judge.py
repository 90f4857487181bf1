"""The generative judge's two pure steps: the prompt template (errors name spec.reward.model.prompt)
and the score read from the judge's text (last match; group 1, else the whole match; none: 0 + why)."""

import re

import pytest
from grpo_rollout.reward_model.base import Misconfigured
from grpo_rollout.reward_model.judge import check_template, parse_score, render
from grpo_wire.protocol import ChatMessage, ScoreItem

ITEM = ScoreItem(prompt="3+4=", completion="7", columns={"answer": "7", "level": 2})


def test_render_fills_prompt_completion_and_columns():
    out = render("Q: {prompt} A: {completion} ref {answer} lvl {level}", ITEM)
    assert out == "Q: 3+4= A: 7 ref 7 lvl 2"


def test_render_a_chat_prompt_as_its_contents():
    item = ScoreItem(
        prompt=[ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")],
        completion="yo",
    )
    assert render("{prompt}|{completion}", item) == "be brief\nhi|yo"


def test_a_name_the_row_lacks_names_the_field_the_name_and_what_is_available():
    with pytest.raises(Misconfigured) as e:
        render("Q: {prompt} ref {reference}", ITEM)
    text = str(e.value)
    assert "spec.reward.model.prompt" in text and "{reference}" in text
    assert "['answer', 'completion', 'level', 'prompt']" in text


@pytest.mark.parametrize("template", ["rate {}", "rate {0}", "rate {completion"])
def test_positional_or_broken_templates_name_the_field(template):
    with pytest.raises(Misconfigured, match=r"spec\.reward\.model\.prompt"):
        check_template(template)
        render(template, ITEM)


@pytest.mark.parametrize(
    ("pattern", "text", "score"),
    [
        (r"(-?[0-9]+(?:\.[0-9]+)?)", "step 1: 3, step 2: 4. Final: 8.5", 8.5),  # the last match wins
        (r"Score: (\d+)/10", "Score: 3/10 ... revised Score: 9/10", 9.0),  # group 1
        (r"\d+", "between 2 and 7", 7.0),  # no group: the whole match
        (r"(-?\d+)", "it is -2", -2.0),
    ],
)
def test_parse_score_reads_the_last_match(pattern, text, score):
    assert parse_score(re.compile(pattern), text) == (score, None)


def test_a_text_without_a_score_scores_zero_and_says_why_with_its_first_200_chars():
    text = "no digits here " * 40
    score, error = parse_score(re.compile(r"(\d+)"), text)
    assert score == 0.0
    assert error is not None and error.startswith("no score in the judge's text: ")
    assert repr(text[:200]) in error and len(error) < 260


def test_a_match_that_is_not_a_number_scores_zero_with_an_error():
    score, error = parse_score(re.compile(r"grade ([A-F])"), "grade B")
    assert score == 0.0 and "'B' is not a number" in error
