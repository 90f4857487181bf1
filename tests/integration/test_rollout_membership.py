"""Rollout servers joining and leaving while trainer rank 0's Generator runs, with real servers.

Two `python -m grpo_rollout serve` processes on loopback; the Generator follows a run contract
file (`grpo_trainer.membership.ContractFileSource`) that the test rewrites, as the operator or
the local runtime would. A server that joins behind the live weight version is caught up over
HTTP before it gets any prompt; one that leaves gets no more; one that leaves while it holds
prompts and never answers has them re-sent after the client's leave grace.
"""

import asyncio
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_trainer.data import Row
from grpo_trainer.generation import Generator
from grpo_trainer.membership import ContractFileSource
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import Prompt, Sampling

from tests.support.rollout import build_tiny_model, running_servers, write_contract

pytestmark = pytest.mark.slow
TOKEN = "membership-test-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), arch="qwen2")


@pytest.fixture
def two_servers(model_dir: Path, tmp_path: Path):
    with running_servers(model_dir, tmp_path, TOKEN) as servers:
        yield servers


def generate_requests(url: str) -> dict[str, float]:
    """The server's /generate request counts by HTTP status, from its /metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpo_rollout_requests_total{") and 'endpoint="/generate"' in line:
            status = line.split('code="', 1)[1].split('"', 1)[0]
            out[status] = float(line.rsplit(" ", 1)[1])
    return out


def wait_until(what: str, cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_a_joining_server_is_caught_up_before_work_and_a_leaving_one_gets_none(
    two_servers, model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    urls, _ = two_servers
    members = tmp_path / "job.json"
    write_contract(members, model_dir, ports=[int(urls[0].rsplit(":", 1)[1])])
    algo = AlgorithmSpec(group_size=2, prompts_per_step=8, max_new_tokens=4)
    gen = Generator([urls[0]], TOKEN, algo, source=ContractFileSource(members), poll_s=0.2)
    try:
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        gen.push({k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}, 3)
        assert gen.members == [urls[0]]

        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        write_contract(members, model_dir, ports=ports)  # server 1 joins, still at version 0
        wait_until("server 1 admitted", lambda: gen.members == urls)
        with urllib.request.urlopen(f"{urls[1]}/health", timeout=5) as resp:
            assert b'"weight_version":3' in resp.read().replace(b" ", b"")

        rows = [(i, Row(f"{i} plus {i} is ", {"answer": str(2 * i)}, i)) for i in range(8)]
        out = gen.submit(rows, step=1, min_version=3).result(timeout=120)
        assert len(out.completion_tokens) == 8 * 2 and out.weight_version == 3
        joined = generate_requests(urls[1])
        assert joined.get("200", 0) >= 1, joined  # it got work ...
        assert "409" not in joined, joined  # ... and never any it was too old for

        write_contract(members, model_dir, ports=ports[1:])  # server 0 leaves
        wait_until("server 0 gone", lambda: gen.members == urls[1:])
        before = generate_requests(urls[0])
        out = gen.submit(rows, step=2, min_version=3).result(timeout=120)
        assert len(out.completion_tokens) == 8 * 2 and out.weight_version == 3
        assert generate_requests(urls[0]) == before
    finally:
        gen.close()


def test_prompts_held_by_a_server_that_left_and_hangs_are_re_sent(two_servers) -> None:
    urls, procs = two_servers
    batch = [Prompt(id=f"p{i}", text=f"{i} plus {i} is ", columns={"answer": str(2 * i)}) for i in range(16)]
    sampling = Sampling(max_new_tokens=300, seed=3, temperature=0.7)

    async def go():
        async with RolloutClient(urls, TOKEN, leave_grace_s=1.0) as client:
            task = asyncio.ensure_future(client.generate(batch, n=4, sampling=sampling))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                health = await client.health()
                if all(not isinstance(h, str) and h.in_flight > 0 for h in health.values()):
                    break
                await asyncio.sleep(0.05)
            procs[1].send_signal(signal.SIGSTOP)  # hung: it will never answer
            client.set_endpoints(urls[:1])
            return await asyncio.wait_for(task, timeout=120), client.resent_prompts

    results, resent = asyncio.run(go())
    assert [r.prompt_id for r in results] == [p.id for p in batch]
    assert all(len(r.completions) == 4 for r in results)
    assert resent >= 1
