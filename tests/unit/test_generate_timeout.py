"""The /generate timeout follows the job (issue 20 item 9): a fixed 600 s cut long reasoning rollouts.

`rollout.generateTimeoutSeconds` when set (bounds admitted by the CRD like every field), else
derived from maxNewTokens and the decode waves a server may run; the trainer's Generator hands it
to the rollout client.
"""

from pathlib import Path

import pytest
import yaml
from grpo_operator import render, validation
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.roles import GENERATE_BASE_S, SLOW_DECODE_TOKENS_PER_S
from grpo_trainer.generation import Generator

ROOT = Path(__file__).resolve().parents[2]
P5EN = ROOT / "examples" / "p5en-qwen3-30b-a3b.yaml"


def p5en(**rollout: object) -> dict:
    raw = yaml.safe_load(P5EN.read_text())
    raw["spec"]["rollout"].update(rollout)
    return raw


def test_the_derived_timeout_covers_the_decode_waves_of_the_job():
    spec = GRPOJob.model_validate(p5en()).spec
    # 512 prompts x 8 x (maxStaleness 2 + 1) = 12,288 sequences over 8 servers x 256 = 6 waves of 4,096 tokens
    assert (
        spec.rollout.generate_timeout_s(spec.algorithm)
        == GENERATE_BASE_S + 6 * 4096 / SLOW_DECODE_TOKENS_PER_S
    )
    longer = spec.model_copy(
        update={"algorithm": spec.algorithm.model_copy(update={"max_new_tokens": 32768})}
    )
    assert (
        longer.rollout.generate_timeout_s(longer.algorithm)
        == GENERATE_BASE_S + 6 * 32768 / SLOW_DECODE_TOKENS_PER_S
    )
    fewer = GRPOJob.model_validate(p5en(minReplicas=2, maxReplicas=8)).spec  # autoscaled down to 2 servers
    assert (
        fewer.rollout.generate_timeout_s(fewer.algorithm)
        == GENERATE_BASE_S + 24 * 4096 / SLOW_DECODE_TOKENS_PER_S
    )


def test_the_field_overrides_the_derivation():
    spec = GRPOJob.model_validate(p5en(generateTimeoutSeconds=7200)).spec
    assert spec.rollout.generate_timeout_s(spec.algorithm) == 7200.0


@pytest.mark.parametrize("value", [59, 86401, "10m"])
def test_validate_refuses_a_timeout_out_of_bounds(tmp_path, value):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(p5en(generateTimeoutSeconds=value)))
    problems = validation.validate_file(path)
    assert [p.path for p in problems] == ["spec.rollout.generateTimeoutSeconds"]


def test_the_trainer_waits_for_generate_as_long_as_the_job_says():
    job = GRPOJob.model_validate(p5en(generateTimeoutSeconds=5400))
    contract = render.contract(job, name="j", namespace="ns")
    generator = Generator.for_contract(contract, "token", streams=False)
    try:
        assert generator._client.request_timeout_s == 5400.0
    finally:
        generator.close()
