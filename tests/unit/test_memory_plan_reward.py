"""The reward role's memory plan (spec.reward.model): a dense reward model's shape from its config.json,
its parts on one GPU, and `grpo-operator plan --reward-model-config`."""

import json
from pathlib import Path

import pytest
from grpo_operator import memory_plan
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.cli import main
from grpo_operator.memory_plan import GIB, reward

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "model-configs"

# Skywork-Reward-Llama-3.1-8B's config.json, the fields the plan reads: 7.50 B parameters (no LM head).
LLAMA_RM = {
    "architectures": ["LlamaForSequenceClassification"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "id2label": {"0": "LABEL_0"},
}


def spec(**model) -> GRPOJobSpec:
    return GRPOJobSpec.model_validate(
        {
            "model": {"path": "/m", "dtype": "bfloat16"},
            "dataset": {"path": "/d"},
            "reward": {"model": {"path": "/rm", "instanceType": "p5.48xlarge", **model}},
        }
    )


def test_a_dense_classifier_has_its_parameters_and_no_lm_head():
    shape = reward.shape(LLAMA_RM)
    assert round(shape.total / 1e9, 2) == 7.50 and shape.lm_head == 4096 and shape.experts == 0


def test_classifier_and_judge_rows_on_one_h100():
    rm = memory_plan.plan_reward(LLAMA_RM, spec(), gpu_bytes=80 * GIB)
    assert rm.role == "reward" and rm.fits and set(rm.parts) == {"weights", "activations", "runtime"}
    assert rm.parts["weights"].bytes == reward.shape(LLAMA_RM).total * 2  # bf16
    judge = memory_plan.plan_reward(LLAMA_RM | {"architectures": ["LlamaForCausalLM"]},
                                    spec(kind="generative", prompt="Rate {completion}", batchSize=256),
                                    gpu_bytes=80 * GIB)  # fmt: skip
    assert {"kv_cache", "logits"} <= set(judge.parts) and judge.fits is False
    assert "reward: " in judge.verdict() and "kv_cache" in judge.verdict()


def test_a_judge_on_vllm_splits_weights_activations_and_kv_over_its_tensor_parallel_gpus():
    judge = {"kind": "generative", "prompt": "Rate {completion}", "batchSize": 64}
    causal = LLAMA_RM | {"architectures": ["LlamaForCausalLM"]}
    one = memory_plan.plan_reward(causal, spec(**judge, engine="vllm"), gpu_bytes=80 * GIB)
    four = memory_plan.plan_reward(
        causal, spec(**judge, engine="vllm", tensorParallelSize=4), gpu_bytes=80 * GIB
    )
    for part in ("weights", "activations", "kv_cache"):
        assert four.parts[part].bytes == one.parts[part].bytes // 4, part
    assert four.parts["runtime"].bytes == one.parts["runtime"].bytes  # each GPU has its own context
    assert "/ tensorParallelSize 4" in four.parts["weights"].formula
    assert any("engine vllm over 4 GPU(s)" in n for n in four.notes)


def test_cli_prints_the_reward_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rm = tmp_path / "rm.json"
    rm.write_text(json.dumps(LLAMA_RM))
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: grpo.dev/v1alpha1\nkind: GRPOJob\nmetadata: {name: j}\nspec:\n"
        "  model: {path: s3://bucket/policy, dtype: bfloat16}\n  dataset: {path: s3://bucket/d.jsonl}\n"
        "  trainer: {instanceType: p5.48xlarge}\n  rollout: {instanceType: p5.48xlarge}\n"
        "  reward: {model: {path: s3://bucket/rm, instanceType: p5.48xlarge}}\n"
    )
    policy = ["--model-config", CONFIGS / "qwen3-30b-a3b.config.json"]
    code = main(["plan", str(job), *map(str, policy), "--reward-model-config", str(rm), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["reward"]["fits"] is True and 13.9 < out["reward"]["parts"]["weights"]["gib"] < 14.0
    assert out["reward"]["gpu_gib"] == out["rollout"]["gpu_gib"]  # one GPU of the same p5
    assert code in (0, 1)
    main(["plan", str(job), *map(str, policy), "--json"])  # no reward config at hand: a note, no row
    out, err = capsys.readouterr()
    assert "reward" not in json.loads(out) and "--reward-model-config" in err


def test_validate_warns_of_a_reward_server_that_cannot_fit(tmp_path: Path) -> None:
    from grpo_operator.validation.check import memory_problems

    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(
        json.dumps(LLAMA_RM | {"architectures": ["LlamaForCausalLM"]})
    )
    text = (
        "apiVersion: grpo.dev/v1alpha1\nkind: GRPOJob\nmetadata: {name: j}\nspec:\n"
        "  model: {path: s3://bucket/policy, dtype: bfloat16}\n  dataset: {path: s3://bucket/d.jsonl}\n"
        "  reward:\n    model: {path: rm, instanceType: p5.48xlarge, kind: generative,\n"
        "            prompt: 'Rate {completion}', batchSize: 512}\n"
    )
    _, warnings = memory_problems(text, str(tmp_path / "job.yaml"))
    (problem,) = [w for w in warnings if w.path == "spec.reward.model"]
    assert "reward: " in problem.message and "does NOT fit" in problem.message
    fits = text.replace("batchSize: 512", "batchSize: 1")
    assert not [
        w for w in memory_problems(fits, str(tmp_path / "job.yaml"))[1] if w.path == "spec.reward.model"
    ]
