"""The trainer's rollout client against two real servers: failover, hand-back, weight push, errors.

Servers are `python -m grpo_rollout serve` child processes on loopback; one is killed (SIGKILL,
like a lost node) or terminated (SIGTERM, like a Spot interruption) while it holds prompts, and
every prompt must still come back with its n completions, served by the other.
"""

import asyncio
import signal

import pytest
import torch
from grpo_wire.client import GenerateError, RolloutClient, ServerError, bucketize
from grpo_wire.protocol import Prompt, Sampling

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, running_servers

pytestmark = pytest.mark.slow
TOKEN = "client-test-token"
N = 8
# Long enough that a request is still running when its server is stopped.
SAMPLING = Sampling(max_new_tokens=300, seed=11, temperature=0.7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), arch="qwen2")


@pytest.fixture
def two_servers(model_dir, tmp_path):
    # A drain of 1 s leaves running work under the service's 2 s margin: a SIGTERM hands it back
    # at once, so a drained server's prompts are always resent (with 3 s a request that ended within
    # the first second needed none, and the test failed by timing).
    with running_servers(model_dir, tmp_path, TOKEN, drain_seconds=1.0) as servers:
        yield servers


def prompts(count: int) -> list[Prompt]:
    return [
        Prompt(id=f"p{i}", text=f"{i} plus {i} is ", columns={"answer": str(2 * i)}) for i in range(count)
    ]


async def wait_busy(client: RolloutClient, timeout: float = 30.0) -> None:
    """Until every server reports a request in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        health = await client.health()
        if all(not isinstance(h, str) and h.in_flight > 0 for h in health.values()):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("servers never got busy")


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "drained"])
def test_prompts_of_a_lost_server_are_served_by_the_other(two_servers, stop):
    urls, procs = two_servers
    batch = prompts(24)

    async def go():
        async with RolloutClient(urls, TOKEN) as client:
            task = asyncio.ensure_future(client.generate(batch, n=N, sampling=SAMPLING))
            await wait_busy(client)
            procs[1].send_signal(stop)
            return await task, client.resent_prompts

    results, resent = asyncio.run(go())
    assert [r.prompt_id for r in results] == [p.id for p in batch]
    assert all(len(r.completions) == N for r in results)
    assert resent >= 1
    if stop == signal.SIGTERM:
        assert procs[1].wait(timeout=15) == 0


def test_weight_push_skips_a_dead_server_and_versions_gate_generation(two_servers, model_dir):
    from transformers import AutoModelForCausalLM

    urls, procs = two_servers
    procs[1].kill()
    procs[1].wait(timeout=10)
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    buckets = bucketize({k: v + 0.1 * torch.randn_like(v) for k, v in state.items()}, bucket_bytes=32 * 1024)

    async def go():
        async with RolloutClient(urls, TOKEN, weights_timeout_s=30) as client:
            pushed = await client.push_weights(buckets, 5)
            # min_weight_version keeps a server with older weights out; the live one answers.
            results = await client.generate(
                prompts(2), n=2, sampling=Sampling(max_new_tokens=4), min_weight_version=5
            )
            return pushed, results

    pushed, results = asyncio.run(go())
    assert pushed.live == {urls[0]: 5}
    assert list(pushed.failed) == [urls[1]] and f"rollout server {urls[1]}" in pushed.failed[urls[1]]
    assert all(r.weight_version == 5 for r in results)

    async def ask(token: str, min_version: int):
        async with RolloutClient(urls[:1], token) as client:
            await client.generate(
                prompts(2), n=2, sampling=Sampling(max_new_tokens=4), min_weight_version=min_version
            )

    with pytest.raises(GenerateError, match="HTTP 409 weight_too_old"):
        asyncio.run(ask(TOKEN, 6))
    with pytest.raises(ServerError, match="HTTP 401 unauthorized") as info:
        asyncio.run(ask("wrong", 0))
    assert not info.value.retriable


def test_no_server_left_is_an_error_naming_every_server():
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there

    async def go():
        async with RolloutClient(urls, TOKEN, connect_timeout_s=2) as client:
            await client.generate(prompts(3), n=2, sampling=Sampling(max_new_tokens=4))

    with pytest.raises(GenerateError) as info:
        asyncio.run(go())
    assert "3 prompt(s) could not be generated" in str(info.value)
    assert all(f"rollout server {u}" in str(info.value) for u in urls)
