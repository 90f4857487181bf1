"""`grpo-operator validate --check-paths`: each path field and reward import path, as the CLI prints
it (`FILE:LINE: field: message`), read relative to the manifest's folder and through `--pvc`."""

from pathlib import Path

import pytest
from grpo_operator.cli import main

JOB = """\
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata:
  name: paths
spec:
  model:
    path: {model}
  dataset:
    path: {dataset}
  reward:
    functions:
      - builtin: exact_match
{functions}
  checkpoint:
    path: {checkpoint}
"""


def manifest(tmp_path: Path, functions: str = "", **paths: str) -> Path:
    values = {"model": "model", "dataset": "train.jsonl", "checkpoint": "ckpt", **paths}
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(functions=functions, **values))
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"\0")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    return tmp_path


def validate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["validate", "--check-paths", *args])
    return code, capsys.readouterr().err


def test_paths_relative_to_the_manifest_resolve(inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--check-paths", str(manifest(inputs))]) == 0
    assert capsys.readouterr().out == f"{inputs / 'job.yaml'}: valid\n"


def test_each_broken_path_is_an_error_naming_file_line_and_field(
    inputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (inputs / "empty.jsonl").write_text("")
    (inputs / "a-file").write_text("x")
    job = manifest(inputs, model="train.jsonl", dataset="empty.jsonl", checkpoint="a-file")
    code, err = validate(capsys, str(job))
    assert code == 1
    assert (
        f"{job}:7: spec.model.path: train.jsonl (read as {inputs / 'train.jsonl'}): is a file; expected"
        in err
    )
    assert (
        f"{job}:9: spec.dataset.path: empty.jsonl (read as {inputs / 'empty.jsonl'}): is an empty file" in err
    )
    assert f"{job}:15: spec.checkpoint.path: a-file (read as {inputs / 'a-file'}): is a file" in err
    code, err = validate(capsys, str(manifest(inputs, model="nowhere")))
    assert code == 1 and "spec.model.path: nowhere" in err and "does not exist" in err


def test_without_the_flag_paths_are_not_read(inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(manifest(inputs, model="nowhere"))]) == 0


def test_pvc_paths_are_read_through_pvc_folders_and_warned_about_without(
    inputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = manifest(inputs, model="pvc://data/model", dataset="pvc://data/missing.jsonl")
    code, err = validate(capsys, str(job))
    assert code == 0
    assert "warning: spec.model.path: pvc://data/model: not checked: pass --pvc data=DIR" in err
    code, err = validate(capsys, str(job), "--pvc", f"data={inputs}")
    assert code == 1
    assert "spec.dataset.path: pvc://data/missing.jsonl (read as" in err and "does not exist" in err
    assert "spec.model.path" not in err
    assert main(["validate", str(job), "--pvc", f"data={inputs}"]) == 2  # --pvc alone: says to add the flag
    assert "add --check-paths" in capsys.readouterr().err


def test_reward_import_paths_are_imported_in_a_child(
    inputs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins = inputs / "plugins"
    plugins.mkdir()
    (plugins / "my_rewards.py").write_text("def score(prompts, completions, **columns):\n    return [0.0]\n")
    (plugins / "broken_rewards.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    functions = "\n".join(
        f"      - function: {f}"
        for f in ("my_rewards:score", "my_rewards:absent", "broken_rewards:score", "only_in_image:score")
    )
    job = manifest(inputs, functions=functions)
    code, err = validate(capsys, str(job))
    assert code == 1
    assert "spec.reward.functions[1]" not in err  # importable and callable
    assert (
        f"{job}:14: spec.reward.functions[2].function: my_rewards:absent: module 'my_rewards' has no callable"
        in err
    )
    assert (
        "spec.reward.functions[3].function: broken_rewards:score: importing module 'broken_rewards' raised "
        in err
    )
    assert "RuntimeError: needs a GPU" in err
    assert (
        "warning: spec.reward.functions[4].function: only_in_image:score: not checked offline: module "
        "'only_in_image' is not importable here" in err
    )
