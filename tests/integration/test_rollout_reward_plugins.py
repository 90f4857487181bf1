"""A rollout server whose reward plugins raise and hang keeps serving (real process, real HTTP).

The job's reward list mixes a built-in with a plugin that raises on some completions and one that
hangs past `reward.timeoutSeconds`: samples get 0 from the broken functions with the reason in
their reward details, the built-in still counts, and the next request is served as usual.
"""

import asyncio
import textwrap
import time

import pytest
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import Prompt, Sampling

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, start_server, wait_ready, write_contract

pytestmark = pytest.mark.slow
TOKEN = "plugin-test-token"
PLUGINS = """
import time

def raise_on_even(prompts, completions, index, **columns):
    if any(i % 2 == 0 for i in index):
        raise ValueError(f"cannot score prompt {[i for i in index if i % 2 == 0][0]}")
    return [1.0] * len(completions)

def hang_once(prompts, completions, **columns):
    if prompts[0].startswith("slow"):
        time.sleep(3600)
    return [0.5] * len(completions)
"""


@pytest.fixture
def server(tmp_path):
    (tmp_path / "grpo_job_rewards.py").write_text(textwrap.dedent(PLUGINS))
    model = build_tiny_model(tmp_path / "model", arch="qwen2")
    port = free_port()
    rewards = [
        {"builtin": "exact_match", "weight": 2.0},
        {"function": "grpo_job_rewards:raise_on_even"},
        {"function": "grpo_job_rewards:hang_once"},
    ]
    contract = write_contract(tmp_path / "job.json", model, ports=[port], rewards=rewards, reward_timeout=1.0)
    proc = start_server(
        contract, port, TOKEN, extra_pythonpath=str(tmp_path), log_path=tmp_path / "server.log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)
        print((tmp_path / "server.log").read_text()[-3000:])


def test_raising_and_hanging_plugins_score_zero_with_reasons_and_the_server_goes_on(server):
    sampling = Sampling(max_new_tokens=4, seed=2)
    batch = [Prompt(id=str(i), text=f"q{i}", columns={"index": i}) for i in range(4)]

    async def go(prompts):
        async with RolloutClient([server], TOKEN) as client:
            return await client.generate(prompts, n=2, sampling=sampling)

    first = asyncio.run(go(batch))
    even = {d.name: d for d in first[0].completions[0].reward_details}
    assert even["grpo_job_rewards:raise_on_even"].error == "ValueError: cannot score prompt 0"
    assert even["grpo_job_rewards:hang_once"].score == 0.5
    odd = {d.name: d for d in first[1].completions[0].reward_details}
    assert (
        odd["grpo_job_rewards:raise_on_even"].error is None
        and odd["grpo_job_rewards:raise_on_even"].score == 1.0
    )

    t0 = time.monotonic()
    (slow,) = asyncio.run(go([Prompt(id="s", text="slow one", columns={"index": 3})]))
    assert time.monotonic() - t0 < 30
    details = {d.name: d for d in slow.completions[0].reward_details}
    assert "timed out after 1s" in details["grpo_job_rewards:hang_once"].error
    assert slow.completions[0].reward == 1.0  # raise_on_even still counted

    # Same seed and prompts: same samples, so each first completion is now the right answer; the
    # hanging plugin's worker was killed and a fresh one serves this request.
    answered = [
        Prompt(id=p.id, text=p.text, columns={"index": 1, "answer": r.completions[0].text})
        for p, r in zip(batch, first, strict=True)
    ]
    again = asyncio.run(go(answered))
    assert [r.completions[0].reward for r in again] == [2.0 + 1.0 + 0.5] * 4


def test_a_missing_plugin_stops_the_server_at_start_with_its_name(tmp_path):
    model = build_tiny_model(tmp_path / "model", arch="qwen2")
    port = free_port()
    rewards = [{"function": "no_such_reward_module:score"}]
    contract = write_contract(tmp_path / "job.json", model, ports=[port], rewards=rewards)
    proc = start_server(contract, port, TOKEN, log_path=tmp_path / "server.log")
    try:
        assert proc.wait(timeout=180) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "server.log").read_text()
    assert "spec.reward.functions[0].function: " in log  # the field, as validate --check-paths names it
    assert "cannot import module 'no_such_reward_module'" in log
