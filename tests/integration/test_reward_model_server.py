"""The reward model server over real HTTP: two `python -m grpo_rollout reward` children serving the tiny
classifier, and the rollout servers' client (`RewardModelClient`) spreading batches over them.

Checks one finite score per item, that the same text scores the same on either replica, the token, the
metrics, and that a replica killed mid-run costs no item: its batches go to the other. With every
replica down the client raises `reward_unavailable` by its deadline rather than scoring 0.
"""

import math
import threading
import time

import pytest
from grpo_rollout.rewards.model_client import ModelClientConfig, RewardModelClient, RewardModelUnavailable
from grpo_wire.protocol import ScoreItem

from tests.support.ports import free_port
from tests.support.reward import (
    build_reward_classifier,
    metric,
    score,
    start_reward_server,
    write_reward_contract,
)
from tests.support.rollout import stop_server, wait_ready

pytestmark = pytest.mark.slow
TOKEN = "reward-token"
ITEMS = [
    {"prompt": "3+4=", "completion": "7"},
    {"prompt": [{"role": "user", "content": "what is 12*7?"}], "completion": "84, I think"},
    {"prompt": "x", "completion": "", "columns": {"answer": "1"}},
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return build_reward_classifier(tmp_path_factory.mktemp("rm"))


@pytest.fixture
def pair(classifier, tmp_path):
    """Two reward servers of one contract, ready; (urls, processes)."""
    ports = [free_port(), free_port()]
    contract = write_reward_contract(
        tmp_path / "job.json", classifier, {"path": str(classifier), "batchSize": 2}, reward_ports=ports
    )
    procs = [start_reward_server(contract, i, TOKEN, log_path=tmp_path / f"r{i}.log") for i in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield urls, procs
    finally:
        for proc in procs:
            stop_server(proc)


def test_each_replica_scores_each_item_once_the_same_and_counts_them(pair, classifier):
    (a, b), _ = pair
    status, first = score(a, ITEMS, TOKEN)
    assert status == 200, first
    assert len(first["scores"]) == len(ITEMS) and first["errors"] == [None] * len(ITEMS)
    assert all(math.isfinite(s) for s in first["scores"])
    assert first["model"] == str(classifier)
    _, again = score(b, [ITEMS[1], ITEMS[0]], TOKEN)  # the other replica, another order and batch
    assert again["scores"] == pytest.approx([first["scores"][1], first["scores"][0]], abs=1e-5)
    assert metric(a, "grpo_reward_items_scored_total") == len(ITEMS)
    assert metric(a, "grpo_reward_parse_failures_total") == 0

    assert score(a, ITEMS, token=None)[1]["code"] == "unauthorized"
    assert score(a, ITEMS, token="wrong")[0] == 401
    status, body = score(a, [{"prompt": "x"}], TOKEN)
    assert (status, body["code"]) == (422, "bad_request") and "completion" in body["message"]


def test_a_replica_killed_mid_run_loses_no_item(pair):
    urls, procs = pair
    items = [ScoreItem(prompt=f"{i}+{i}=", completion=str(2 * i) * (1 + i % 5)) for i in range(600)]
    client = RewardModelClient(ModelClientConfig(tuple(urls), TOKEN, batch_size=2, timeout_s=10))
    alone, _ = RewardModelClient(ModelClientConfig((urls[1],), TOKEN, batch_size=2, timeout_s=10)).score(
        items[:6]
    )

    def kill_once_busy() -> None:  # after the first replica answered some batches, mid-run
        deadline = time.monotonic() + 30
        while metric(urls[0], "grpo_reward_items_scored_total") < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        stop_server(procs[0])

    killer = threading.Thread(target=kill_once_busy)
    killer.start()
    t0 = time.monotonic()
    scores, errors = client.score(items)
    killer.join()
    assert procs[0].poll() is not None, "the first replica was not killed during the run"
    assert len(scores) == len(items) and errors == [None] * len(items)
    assert all(math.isfinite(s) for s in scores)
    assert scores[:6] == pytest.approx(alone, abs=1e-5)  # in order, whichever replica scored them
    assert client.retries >= 1
    assert time.monotonic() - t0 < 30


def test_with_every_replica_down_the_client_raises_unavailable_by_its_deadline():
    dead = tuple(f"http://127.0.0.1:{free_port()}" for _ in range(2))
    client = RewardModelClient(ModelClientConfig(dead, TOKEN, batch_size=4, timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(RewardModelUnavailable) as e:
        client.score([ScoreItem(prompt="p", completion="c")] * 10)
    assert 1.4 < time.monotonic() - t0 < 5  # 3 x timeoutSeconds
    assert e.value.status == 502 and e.value.code == "reward_unavailable"
    assert (
        "did not score 10 of 10" in e.value.message and "spec.reward.model.timeoutSeconds" in e.value.message
    )
    assert all(ep in e.value.message for ep in dead)
