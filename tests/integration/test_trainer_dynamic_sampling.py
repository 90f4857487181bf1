"""Dynamic sampling against a real rollout server: every step trains promptsPerStep groups.

A `python -m grpo_rollout serve` child (tiny qwen2, torch engine) scores with a plugin reward
under which half the prompts saturate (every completion earns 1: zero variance, no signal).
Rank 0's `next_rollouts` must then draw further batches until the step has promptsPerStep
groups with unequal rewards, and the data position must advance by exactly what was drawn,
in whole batches, so a resumed run continues after the last prompt any step consumed.
"""

import textwrap
from collections import deque
from pathlib import Path

import pytest
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.contract import RunContract
from grpo_trainer.batch import score
from grpo_trainer.checkpoint import TrainState
from grpo_trainer.data import PromptOrder, Row
from grpo_trainer.generation import Generator
from grpo_trainer.loop import Run, next_rollouts

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, start_server, wait_ready, write_contract

pytestmark = pytest.mark.slow
TOKEN = "dynamic-sampling-token"
N, GROUP = 4, 4
REWARDS = """
def half_saturated(prompts, completions, kind, **columns):
    # "easy" prompts always earn 1; "hard" ones earn the parity of the first character
    return [1.0 if k == "easy" else float(ord(c[0]) % 2) if c else 0.0 for k, c in zip(kind, completions)]
"""


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "grpo_dyn_rewards.py").write_text(textwrap.dedent(REWARDS))
    model = build_tiny_model(tmp_path / "model", arch="qwen2")
    port = free_port()
    rewards = [{"function": "grpo_dyn_rewards:half_saturated"}]
    contract = write_contract(tmp_path / "job.json", model, ports=[port], rewards=rewards)
    proc = start_server(contract, port, TOKEN, extra_pythonpath=str(tmp_path), log_path=tmp_path / "log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield contract
    finally:
        proc.kill()
        proc.wait(timeout=30)


def rank0_run(contract_path: Path, algo: AlgorithmSpec) -> Run:
    """What `next_rollouts` reads of a run: the spec, the data order, the state, the generator."""
    contract = RunContract.model_validate_json(contract_path.read_text())
    contract = contract.model_copy(update={"spec": contract.spec.model_copy(update={"algorithm": algo})})
    rows = [Row(prompt=f"q{i}", columns={"kind": "easy" if i % 2 else "hard"}, line=i + 1) for i in range(64)]
    generator = Generator(contract.rollout.endpoints, TOKEN, algo)
    return Run(contract=contract, info=None, learner=None, order=PromptOrder(rows, seed=1),  # type: ignore[arg-type]
               state=TrainState(), generator=generator)  # fmt: skip


def test_every_step_trains_prompts_per_step_groups_and_the_position_follows_the_draws(server: Path) -> None:
    algo = AlgorithmSpec(
        groupSize=GROUP, promptsPerStep=N, maxNewTokens=4, maxStaleness=1, maxSteps=50,
        dynamicSampling=True, maxDynamicSamplingDraws=8,
    )  # fmt: skip
    run = rank0_run(server, algo)
    pending: deque = deque()
    drawn = []
    try:
        for _ in range(4):
            rollouts = next_rollouts(run, pending)
            _, kept = score(rollouts, algo)
            assert len(kept) == N * GROUP  # exactly promptsPerStep groups with a learning signal
            assert rollouts.prompts_drawn % N == 0 and rollouts.prompts_drawn >= len(rollouts) // GROUP
            drawn.append(rollouts.prompts_drawn)
            s = run.state  # as `loop` advances it (no weight pushes here: the servers stay at version 0)
            run.state = TrainState(step=s.step + 1, version=0, position=s.position + rollouts.prompts_drawn)
        for draw in pending:  # the prefetched draw: let it finish before the client closes
            draw.result(timeout=120)
    finally:
        run.generator.close()
    assert max(drawn) > N  # half the groups saturate: without refills the steps would shrink
    assert run.state.position == sum(drawn)
