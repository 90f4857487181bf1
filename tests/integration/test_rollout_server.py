"""The rollout server over real HTTP: a `python -m grpo_rollout serve` child process on loopback.

Checks what the trainer relies on: n completions per prompt whose log-probs equal a teacher-forced
forward pass of the same weights, rewards wired to dataset columns, weight pushes that change the
samples and the version, the token, the size limits, and a SIGTERM drain that hands work back.
"""

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from grpo_wire.client import RolloutClient, WeightSyncError, bucketize
from grpo_wire.protocol import MAX_GENERATE_BODY_BYTES, Prompt, PromptResult, Sampling

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, start_server, wait_ready, write_contract

pytestmark = pytest.mark.slow
TOKEN = "s3cret-job-token"
PROMPTS = [Prompt(id="a", text="1+1="), Prompt(id="b", text="what is 12*7?"), Prompt(id="c", text="x")]


def http(method: str, url: str, body: bytes | None = None, token: str | None = TOKEN, headers=None):
    """(status, parsed JSON or text, headers) of one plain HTTP call."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), e.headers
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode(), hdrs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), arch="qwen3_moe")


@pytest.fixture
def launch(model_dir, tmp_path):
    """Start servers on fresh ports; every one is stopped at the end of the test."""
    procs = []

    def _launch(drain_seconds: float = 10.0, max_batch_size: int = 64) -> tuple[str, object]:
        port = free_port()
        contract = write_contract(
            tmp_path / f"job-{port}.json", model_dir, ports=[port], max_batch_size=max_batch_size
        )
        proc = start_server(
            contract, port, TOKEN, drain_seconds=drain_seconds, log_path=tmp_path / f"{port}.log"
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        return url, proc

    yield _launch
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def shared(model_dir, tmp_path_factory):
    """One server for the tests that do not change its weights or stop it."""
    tmp = tmp_path_factory.mktemp("shared")
    port = free_port()
    proc = start_server(write_contract(tmp / "job.json", model_dir, ports=[port]), port, TOKEN)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def generate(url: str, prompts: list[Prompt], n: int, sampling: Sampling) -> list[PromptResult]:
    async def go():
        async with RolloutClient([url], TOKEN) as client:
            return await client.generate(prompts, n=n, sampling=sampling)

    return asyncio.run(go())


def assert_teacher_forced(model, results: list[PromptResult], temperature: float) -> None:
    for r in results:
        for c in r.completions:
            ids = torch.tensor([r.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()  # [T, V]
            expected = torch.log_softmax(logits / temperature, -1).gather(
                1, torch.tensor(c.token_ids)[:, None]
            )
            assert torch.allclose(torch.tensor(c.logprobs), expected.squeeze(1), atol=1e-4)


def test_generate_returns_n_completions_whose_logprobs_match_teacher_forcing(shared, model_dir):
    from transformers import AutoModelForCausalLM

    sampling = Sampling(temperature=0.8, max_new_tokens=16, seed=7)
    results = generate(shared, PROMPTS, 4, sampling)
    assert [r.prompt_id for r in results] == ["a", "b", "c"]
    assert all(len(r.completions) == 4 and r.weight_version == 0 for r in results)
    assert all(c.reward_details[0].name == "exact_match" for r in results for c in r.completions)
    assert_teacher_forced(AutoModelForCausalLM.from_pretrained(model_dir).eval(), results, temperature=0.8)

    # Same seed, same samples: give each prompt its first completion as the answer -> reward 1 there.
    with_answers = [
        Prompt(id=p.id, text=p.text, columns={"answer": r.completions[0].text})
        for p, r in zip(PROMPTS, results, strict=True)
    ]
    again = generate(shared, with_answers, 4, sampling)
    assert [[c.token_ids for c in r.completions] for r in again] == [
        [c.token_ids for c in r.completions] for r in results
    ]
    assert all(r.completions[0].reward == 1.0 for r in again)


def test_work_endpoints_need_the_job_token(shared):
    body = json.dumps({"request_id": "r", "prompts": [{"id": "a", "text": "x"}], "n": 1}).encode()
    for token in (None, "wrong"):
        status, payload, _ = http("POST", f"{shared}/generate", body, token=token)
        assert (status, payload["code"]) == (401, "unauthorized")
        status, payload, _ = http("POST", f"{shared}/weights", b"", token=token)
        assert status == 401
    assert http("GET", f"{shared}/health", token=None)[0] == 200
    assert http("GET", f"{shared}/metrics", token=None)[0] == 200


def test_oversize_and_malformed_requests_are_refused_clearly(shared):
    big = b"{" + b" " * (MAX_GENERATE_BODY_BYTES + 1) + b"}"
    status, payload, _ = http("POST", f"{shared}/generate", big)
    assert (status, payload["code"]) == (413, "too_large")

    many = {"request_id": "r", "prompts": [{"id": str(i), "text": "x"} for i in range(1025)], "n": 1}
    status, payload, _ = http("POST", f"{shared}/generate", json.dumps(many).encode())
    assert (status, payload["code"]) == (422, "bad_request") and "at most 1024" in payload["message"]

    status, payload, _ = http("POST", f"{shared}/generate", json.dumps({"protocol_version": 9}).encode())
    assert (status, payload["code"]) == (422, "protocol_mismatch") and "protocol 9" in payload["message"]

    status, payload, _ = http("POST", f"{shared}/generate", b"not json")
    assert status == 422 and "not JSON" in payload["message"]


def test_metrics_count_tokens_and_requests(shared):
    generate(shared, PROMPTS[:1], 2, Sampling(max_new_tokens=4, seed=1))
    _, text, _ = http("GET", f"{shared}/metrics", token=None)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["grpo_rollout_tokens_generated_total"]) >= 2
    assert float(lines['grpo_rollout_requests_total{code="200",endpoint="/generate"}']) >= 1
    assert lines["grpo_rollout_weight_version"] == "0.0"


def test_weight_push_changes_samples_and_version(launch, model_dir):
    from transformers import AutoModelForCausalLM

    url, _ = launch()
    sampling = Sampling(temperature=1.0, max_new_tokens=12, seed=3)
    before = generate(url, PROMPTS, 2, sampling)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    new = {k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
    buckets = bucketize(new, bucket_bytes=64 * 1024)
    assert len(buckets) > 2

    async def push(buckets, version):
        async with RolloutClient([url], TOKEN) as client:
            return await client.push_weights(buckets, version)

    assert asyncio.run(push(buckets, 1)).live == {url: 1}
    assert http("GET", f"{url}/health", token=None)[1]["weight_version"] == 1
    after = generate(url, PROMPTS, 2, sampling)
    assert all(r.weight_version == 1 for r in after)
    assert [c.token_ids for r in after for c in r.completions] != [
        c.token_ids for r in before for c in r.completions
    ]
    model.load_state_dict(new)
    assert_teacher_forced(model, after, temperature=1.0)

    with pytest.raises(WeightSyncError, match="unknown parameter name"):
        asyncio.run(push(bucketize({"model.bogus.weight": torch.zeros(2)}), 2))
    assert http("GET", f"{url}/health", token=None)[1]["weight_version"] == 1
    assert asyncio.run(push(buckets[-1:], 1)).live == {url: 1}  # re-sending the live version is harmless


def test_sigterm_drains_hands_back_unfinished_prompts_and_exits_zero(launch):
    url, proc = launch(drain_seconds=4.0, max_batch_size=64)
    prompts = [{"id": str(i), "text": f"{i}+{i}="} for i in range(32)]
    body = {"request_id": "long", "prompts": prompts, "n": 16, "sampling": {"max_new_tokens": 512, "seed": 0}}
    answer: dict = {}
    worker = threading.Thread(
        target=lambda: answer.update(r=http("POST", f"{url}/generate", json.dumps(body).encode()))
    )
    worker.start()
    deadline = time.monotonic() + 30
    while http("GET", f"{url}/health", token=None)[1]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, health, _ = http("GET", f"{url}/health", token=None)
    assert (status, health["state"]) == (503, "draining")
    status, refused, headers = http(
        "POST", f"{url}/generate", json.dumps({**body, "prompts": prompts[:1]}).encode()
    )
    assert (status, refused["code"], headers["Retry-After"]) == (503, "draining", "5")

    worker.join(timeout=30)
    status, response, _ = answer["r"]
    assert status == 200
    done = [r["prompt_id"] for r in response["results"]]
    assert response["unfinished_prompt_ids"], "a 32x16x512 request cannot finish in a 4 s drain on CPU"
    assert sorted(done + response["unfinished_prompt_ids"], key=int) == [p["id"] for p in prompts]
    assert all(len(r["completions"]) == 16 for r in response["results"])
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 4.0 + 5.0
