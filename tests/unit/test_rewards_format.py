"""Built-in format reward: <think>...</think><answer>...</answer> (grpo_rollout.rewards.format)."""

from grpo_rollout.rewards.format import think_answer_format


def test_format_reward():
    completions = [
        "<think>a\nb</think>\n<answer>3</answer>",
        "  <think></think><answer></answer>  ",
        "<answer>3</answer>",
        "<think>a</think><answer>3</answer> trailing",
        "<think>a</think>",
    ]
    assert think_answer_format(["p"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]
