"""`grpo-operator preview` and `validate --check-paths` on the data users bring: a verl-prepared Parquet
file (chat messages, the answer in reward_model.ground_truth) through the tiny model's own template,
run as a user runs them (the CLI, in a subprocess)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpo_trainer.tiny_model import TinyConfig, build_tokenizer, save_untrained

CLI = [sys.executable, "-m", "grpo_operator.cli"]


@pytest.fixture
def job(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    save_untrained(tmp_path / "model", TinyConfig())
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        }
        for i in range(1, 12)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    manifest = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPOJob",
        "metadata": {"name": "verl-shaped"},
        "spec": {
            "model": {"path": "model"},
            "dataset": {
                "path": "train.parquet",
                "columns": {"answer": "reward_model.ground_truth"},
                "systemPrompt": "Answer with a number.",
            },
            "reward": {"functions": [{"builtin": "math"}, {"builtin": "countdown"}]},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def preview(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "preview", str(job), *args], capture_output=True, text=True, timeout=120)


def test_preview_shows_prompts_as_the_model_receives_them_with_the_columns_each_reward_gets(
    job: Path,
) -> None:
    done = preview(job, "-n", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    first = report["prompts"][0]
    assert first["row"].endswith("train.parquet: row 1")
    assert first["text"] == "<|system|>Answer with a number.<|end|><|user|>What is 1 + 1?<|end|><|assistant|>"
    assert first["tokens"] == len(build_tokenizer()(first["text"], add_special_tokens=False).input_ids)
    assert first["columns"]["answer"] == "2"  # mapped from reward_model.ground_truth
    assert first["missing"] == {"countdown": ["numbers", "target"]}  # said, before a run scores 0
    assert report["rewards"] == {"math": ["answer"], "countdown": ["numbers", "target"]}
    assert len(report["prompts"]) == 2 and report["lengths"]["prompts"] == 11 and not report["warnings"]
    table = preview(job, "-n", "1")
    assert (
        table.returncode == 0
        and "What is 1 + 1?" in table.stdout
        and "countdown needs column(s)" in table.stdout
    )


def test_prompts_longer_than_the_servers_take_are_a_warning_of_validate_and_preview(job: Path) -> None:
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["rollout"] = {"engine": "vllm", "vllm": {"maxModelLen": 64}}
    manifest["spec"]["algorithm"] = {"maxNewTokens": 20}  # room for 44 prompt tokens; these have 41-43
    manifest["spec"]["dataset"]["systemPrompt"] = "Answer with a whole number."  # + 6: 47-49
    job.write_text(yaml.safe_dump(manifest))
    report = json.loads(preview(job, "-n", "0", "--json").stdout)
    assert report["lengths"]["over_limit"] == 11 and report["lengths"]["limit"] == 44, report["lengths"]
    done = subprocess.run(
        [*CLI, "validate", "--check-paths", str(job)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr  # a warning, the file is valid
    assert "warning: spec.dataset.path: 11 of 11 prompts are longer than 44 tokens" in done.stderr


def test_a_row_the_template_cannot_take_fails_validate_and_preview_naming_the_file_and_row(job: Path) -> None:
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["dataset"]["chatTemplate"] = "none"
    manifest["spec"]["dataset"].pop("systemPrompt")
    job.write_text(yaml.safe_dump(manifest))
    done = preview(job)
    assert done.returncode == 2
    assert (
        "train.parquet: row 1: prompt 1 is a list of chat messages, but spec.dataset.chatTemplate is none"
        in done.stderr
    )
    done = subprocess.run(
        [*CLI, "validate", "--check-paths", str(job)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "spec.dataset: " in done.stderr and "row 1" in done.stderr, done.stderr


def test_preview_shows_the_tools_as_the_template_describes_them(job: Path) -> None:
    """spec.tools reach the template's `tools` argument, described in the sandbox as the servers do."""
    from transformers import AutoTokenizer

    model = job.parent / "model"
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = (  # a template that lists its tools, as Qwen's writes them into the system turn
        "{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    )
    tok.save_pretrained(model)
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["tools"] = [{"builtin": "calculator"}]
    job.write_text(yaml.safe_dump(manifest))
    done = preview(job, "-n", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompts"][0]["text"].startswith("[tool calculator]<|system|>")


def test_the_columns_preview_says_each_builtin_reads_are_the_ones_it_reads() -> None:
    """preview's table (the trainer may not import the rewards) pinned to the rewards themselves."""
    from grpo_operator.api.spec import BuiltinReward
    from grpo_rollout.rewards.base import load_function
    from grpo_trainer.preview import BUILTIN_COLUMNS

    assert set(BUILTIN_COLUMNS) == {str(b) for b in BuiltinReward}
    for name, columns in BUILTIN_COLUMNS.items():
        fn = load_function(name)
        given = {c: [[1, 2] if c == "numbers" else "3"] for c in columns}
        assert len(fn(["p"], ["3"], **given)) == 1  # all it needs
        for missing in columns:
            with pytest.raises(KeyError, match=missing):
                fn(["p"], ["3"], **{c: v for c, v in given.items() if c != missing})


def test_a_budget_with_no_room_for_a_reply_is_a_warning_of_validate_and_preview(job: Path) -> None:
    """Issue 46: an environment's two-turn episodes under maxNewTokens 8 end after one turn; said
    before the run (the template's 4 tokens around a reply and two one-token turns leave 2 of 8);
    at 32 there is room, and nothing is said."""
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["environment"] = {"class": "are_you_sure:AreYouSure"}
    manifest["spec"]["algorithm"] = {"maxNewTokens": 32}
    job.write_text(yaml.safe_dump(manifest))
    assert not json.loads(preview(job, "-n", "0", "--json").stdout)["warnings"]
    manifest["spec"]["algorithm"] = {"maxNewTokens": 8}
    job.write_text(yaml.safe_dump(manifest))
    done = subprocess.run(
        [*CLI, "validate", "--check-paths", str(job)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr  # a warning: the file is valid
    assert (
        "warning: spec.algorithm.maxNewTokens: 8 tokens hold every turn of an episode and every reply in it; "
        "after two one-token model turns and the chat template's 4 tokens around a reply, 2 are left for "
        "the environment's reply (fewer than 16)"
    ) in done.stderr, done.stderr
