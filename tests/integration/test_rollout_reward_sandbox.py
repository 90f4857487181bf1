"""A rollout server's reward sandbox holds against plugins that bloat, fork or read the token (real HTTP).

The job's plugins allocate without bound, read $GRPO_TOKEN (which the server itself holds), and
fork a grandchild that lingers and then hang past `reward.timeoutSeconds`. Each scores 0 with the
reason in its reward details, a well-behaved plugin after them still counts, and no process they
started (nor any reward worker) is left once the call, and then the server, is over. The plugins
record their pids in files, since their answers are discarded.
"""

import asyncio
import json
import signal
import textwrap

import pytest
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import Prompt, Sampling

from tests.support.ports import free_port
from tests.support.reward_processes import alive, in_session
from tests.support.rollout import build_tiny_model, start_server, wait_ready, write_contract

pytestmark = pytest.mark.slow
TOKEN = "sandbox-test-token"
PLUGINS = """
import json, os, time

def record(name, **pids):
    with open(os.path.join({records!r}, name + ".json"), "w") as f:
        json.dump(dict(pids, worker=os.getpid()), f)

def hog(prompts, completions, **columns):
    record("hog")
    chunks = []
    while True:
        chunks.append(bytearray(1 << 20))

def steal_token(prompts, completions, **columns):
    record("steal_token")
    return [float(os.environ["GRPO_TOKEN"] == {token!r})] * len(completions)

def fork_and_hang(prompts, completions, **columns):
    forked = os.fork()
    if forked == 0:
        time.sleep(3600)
        os._exit(0)
    record("fork_and_hang", forked=forked)
    time.sleep(3600)

def well_behaved(prompts, completions, **columns):
    record("well_behaved")
    return [1.0] * len(completions)
"""
NAMES = ["hog", "steal_token", "fork_and_hang", "well_behaved"]


@pytest.fixture
def server(tmp_path, monkeypatch):
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "grpo_sandbox_rewards.py").write_text(
        textwrap.dedent(PLUGINS).format(records=str(records), token=TOKEN)
    )
    model = build_tiny_model(tmp_path / "model", arch="qwen2")
    port = free_port()
    rewards = [{"function": f"grpo_sandbox_rewards:{name}"} for name in NAMES]
    contract = write_contract(tmp_path / "job.json", model, ports=[port], rewards=rewards, reward_timeout=5.0)
    monkeypatch.setenv("GRPO_REWARD_MEMORY_MB", "256")  # the server passes it to its reward worker
    proc = start_server(
        contract, port, TOKEN, extra_pythonpath=str(tmp_path), log_path=tmp_path / "server.log"
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}", proc, records
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        print((tmp_path / "server.log").read_text()[-3000:])


def test_bloating_forking_and_token_reading_plugins_score_zero_and_leave_nothing_behind(server):
    url, proc, records = server

    async def go():
        async with RolloutClient([url], TOKEN) as client:
            prompt = Prompt(id="0", text="q", columns={})
            return await client.generate([prompt], n=1, sampling=Sampling(max_new_tokens=4, seed=1))

    (result,) = asyncio.run(go())
    (completion,) = result.completions
    details = {d.name.split(":")[1]: d for d in completion.reward_details}
    assert details["hog"].error == "MemoryError: over the reward worker's 256 MiB memory limit"
    assert details["steal_token"].error == "KeyError: 'GRPO_TOKEN'"
    assert details["fork_and_hang"].error.startswith("timed out after 5s")
    assert details["well_behaved"].error is None
    assert completion.reward == 1.0  # only the well-behaved plugin counted

    pids = {name: json.loads((records / f"{name}.json").read_text()) for name in NAMES}
    killed = pids["fork_and_hang"]["worker"]
    assert pids["hog"]["worker"] == pids["steal_token"]["worker"] == killed  # survived until the hang
    assert not alive(pids["fork_and_hang"]["forked"]) and not alive(killed)
    assert in_session(killed) == []

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    last = pids["well_behaved"]["worker"]  # the fresh worker, ended by the server's drain
    assert last != killed and not alive(last) and in_session(last) == []
