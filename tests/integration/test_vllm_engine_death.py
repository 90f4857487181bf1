"""A vLLM engine that dies under a real rollout server (vLLM's CPU build, `.venv-vllm`): its
`EngineCore` child process is killed (SIGKILL, as the kernel's OOM killer would), and the server
must say so and leave, and a client must stop sending it work.

Checked: the request that meets the dead engine is answered `engine_dead` (HTTP 500) with how the
core ended; the client re-sends those prompts to the other server and marks the dead one out for
good (no cooldown, no retry); /health answers 503 `failed` with the same error while the server
lingers; the process then exits with `EXIT_ENGINE_DEAD`, its log stating the engine's error.
The trainer's generator, which had only that server, waits for a replacement instead of retrying
it, and generates as soon as a new process on that address is ready (a restarted pod). And a model
whose heads CPU attention refuses (the demo's old head_dim 16) stops the server at start.
"""

import asyncio
import concurrent.futures
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_rollout.__main__ import EXIT_ENGINE_DEAD
from grpo_trainer.generation import Generator
from grpo_wire.client import GenerateError, RolloutClient
from grpo_wire.protocol import Prompt, PromptResult, Sampling

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, start_server, stop_server, wait_ready, write_contract
from tests.support.vllm import VLLM_ENV, vllm_venv_python

pytestmark = pytest.mark.slow
TOKEN = "engine-death-token"
PROMPTS = [Prompt(id=str(i), text=f"{i}+{i}=", columns={"answer": str(2 * i)}) for i in range(6)]
SAMPLING = Sampling(temperature=1.0, max_new_tokens=8, seed=1)


def engine_core(server_pid: int) -> psutil.Process:
    """The vLLM EngineCore process under the server (vLLM titles it `VLLM::EngineCore`)."""
    for child in psutil.Process(server_pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError(f"no EngineCore process under the rollout server {server_pid}")


def health(url: str) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None  # gone


def test_a_killed_engine_core_fails_the_server_and_the_client_stops_using_it(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", arch="qwen3_moe", head_dim=32)
    vllm_port, torch_port = free_port(), free_port()
    vllm_url, torch_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{torch_port}"
    vllm_opts = {"enforceEager": True, "maxModelLen": 128}
    vllm_job = write_contract(tmp_path / "vllm.json", model, ports=[vllm_port], engine="vllm", vllm=vllm_opts)
    torch_job = write_contract(tmp_path / "torch.json", model, ports=[torch_port])
    log = tmp_path / "vllm.log"
    python = str(vllm_venv_python())
    server = start_server(vllm_job, vllm_port, TOKEN, python=python, env=VLLM_ENV, log_path=log)
    other = start_server(torch_job, torch_port, TOKEN, log_path=tmp_path / "torch.log")
    try:
        try:
            wait_ready(vllm_url, server, timeout=600)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{log.read_text(errors='replace')[-4000:]}") from None
        wait_ready(torch_url, other)

        async def generate(urls: list[str]) -> tuple[list[PromptResult], dict[str, str]]:
            async with RolloutClient(urls, TOKEN) as client:
                return await client.generate(PROMPTS, n=2, sampling=SAMPLING), client.dead

        served, dead = asyncio.run(generate([vllm_url]))
        assert len(served) == len(PROMPTS) and not dead  # the engine serves before it dies

        engine_core(server.pid).send_signal(signal.SIGKILL)
        seen: list[tuple[int, dict] | None] = []

        def probe() -> None:  # what a readiness probe sees until the server is gone
            while server.poll() is None:
                seen.append(health(vllm_url))
                time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        trainer = Generator([vllm_url], TOKEN, AlgorithmSpec())  # the trainer's view: this server only
        waiting = concurrent.futures.ThreadPoolExecutor(1)
        rewards = waiting.submit(trainer.rewards, PROMPTS, 2, SAMPLING, min_version=0)
        results, dead = asyncio.run(generate([vllm_url, torch_url]))  # both servers, vLLM first
        prober.join(timeout=60)
        assert server.wait(timeout=60) == EXIT_ENGINE_DEAD, log.read_text(errors="replace")[-3000:]

        assert not rewards.done()  # waiting for a replacement, not failing nor hammering the dead one
        replacement = start_server(torch_job, vllm_port, TOKEN, log_path=tmp_path / "replacement.log")
        try:
            assert len(rewards.result(timeout=120)) == len(PROMPTS)  # served once it is ready
        finally:
            replacement.kill()
            replacement.wait(timeout=60)
            trainer.close()
            waiting.shutdown(wait=False)

        assert len(results) == len(PROMPTS)  # every prompt served, by the torch server
        assert list(dead) == [vllm_url], dead
        assert "engine_dead" in dead[vllm_url] and "killed by signal 9" in dead[vllm_url], dead
        answers = list(filter(None, seen))
        first = next(
            (i for i, (st, body) in enumerate(answers) if st == 503 and body["state"] == "failed"), None
        )
        assert first is not None, f"/health never said failed: {answers[-5:]}"
        assert "killed by signal 9" in answers[first][1]["error"], answers[first]
        assert all(st == 503 for st, _ in answers[first:])  # never healthy again (the first
        # probes may come before vLLM's monitor noticed the death)
        text = log.read_text(errors="replace")
        assert "EngineDead: test-rollout-0: the vllm engine died: vLLM's engine core process ended" in text

        async def only_dead() -> None:  # no live server left: at once, naming the engine's death
            async with RolloutClient([vllm_url], TOKEN) as client:
                client.dead[vllm_url] = dead[vllm_url]
                t0 = time.monotonic()
                with pytest.raises(GenerateError) as e:
                    await client.generate(PROMPTS, n=2, sampling=SAMPLING)
                assert e.value.all_dead and time.monotonic() - t0 < 1.0
                assert "killed by signal 9" in str(e.value)

        asyncio.run(only_dead())
    finally:
        for proc in (server, other):
            stop_server(proc)


def test_a_head_width_cpu_attention_refuses_stops_the_server_at_start(tmp_path: Path) -> None:
    """vLLM's CPU attention refuses head_dim 16 at the first forward (the engine core then died with
    "Unsupported CPU attention configuration: head_dim=16", reported through `vllm_errors` until
    the engine checked it): the server now refuses at start, naming the field and the fix."""
    model = build_tiny_model(tmp_path / "model", arch="qwen3_moe", head_dim=16)
    port = free_port()
    vllm = {"enforceEager": True, "maxModelLen": 128}
    job = write_contract(tmp_path / "job.json", model, ports=[port], engine="vllm", vllm=vllm)
    log = tmp_path / "vllm.log"
    server = start_server(job, port, TOKEN, python=str(vllm_venv_python()), env=VLLM_ENV, log_path=log)
    try:
        with pytest.raises(RuntimeError, match="exited with code"):
            wait_ready(f"http://127.0.0.1:{port}", server, timeout=600)
        text = log.read_text(errors="replace")
        assert "spec.model.path: head_dim 16 is not served by vLLM's CPU attention" in text, text[-3000:]
        assert "--head-dim 32" in text
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=60)
