"""The classifier kind: a model with more than one output is refused at load, naming
spec.reward.model.path and what it found; a one-output model scores one finite logit per item."""

import math
import subprocess
import sys

import pytest
from grpo_operator.api.spec import RewardModelSpec
from grpo_rollout.reward_model.base import LoadConfig, Misconfigured, load
from grpo_rollout.reward_model.classifier import classifier_input
from grpo_trainer.tiny_model import TinyConfig, build_reward_classifier, build_tokenizer
from grpo_wire.protocol import ScoreItem
from transformers import AutoConfig

CFG = TinyConfig(hidden=32, layers=1, max_positions=128)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer()
    build_reward_classifier(CFG, tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_two_label_classifier_is_refused_naming_the_field(tmp_path):
    tok = build_tokenizer()
    model = build_reward_classifier(CFG, tok)
    model.config.num_labels = 2  # e.g. a sentiment classifier: label probabilities, not a reward
    model.config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(Misconfigured) as e:
        load("classifier", LoadConfig(str(tmp_path), "cpu"), RewardModelSpec(path=str(tmp_path)))
    text = str(e.value)
    assert "spec.reward.model.path" in text and str(tmp_path) in text
    assert "2 outputs" in text and "LABEL_0" in text and "num_labels 1" in text


def test_one_finite_score_per_item_and_batching_does_not_change_it(classifier_dir):
    spec = RewardModelSpec(path=str(classifier_dir), batchSize=2)
    model = load("classifier", LoadConfig(str(classifier_dir), "cpu"), spec)
    items = [
        ScoreItem(prompt="3+4=", completion="7"),
        ScoreItem(
            prompt=[{"role": "user", "content": "a longer question here"}], completion="and a long answer"
        ),
        ScoreItem(prompt="3+4=", completion="7"),
    ]
    scores, errors = model.score(items)
    assert len(scores) == 3 and errors == [None] * 3 and all(math.isfinite(s) for s in scores)
    assert scores[0] == pytest.approx(scores[2], abs=1e-5)  # padded in a batch or alone: the same
    assert scores[0] != pytest.approx(scores[1], abs=1e-6)
    assert (
        classifier_input(model.tokenizer, items[1])
        == "<|user|>a longer question here<|end|><|assistant|>and a long answer<|end|>"
    )


@pytest.mark.slow
def test_the_cli_writes_a_tiny_reward_classifier_the_server_loads(tmp_path):
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(out), "--reward-classifier"]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    assert AutoConfig.from_pretrained(out).num_labels == 1
    model = load("classifier", LoadConfig(str(out), "cpu"), RewardModelSpec(path=str(out)))
    scores, _ = model.score([ScoreItem(prompt="1+1=", completion="2")])
    assert len(scores) == 1 and math.isfinite(scores[0])
