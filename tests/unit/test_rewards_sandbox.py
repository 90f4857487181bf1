"""The reward worker's confinement (grpo_rollout.rewards.sandbox, .child, .worker), on real processes.

Each reward here misbehaves the way the issue describes (allocates without bound, reads the job
token, leaves processes behind, floods or prints on the answer channel) and the test checks that it
costs only its own score: the worker says why, and nothing it started outlives a kill.
"""

import json
import sys
import textwrap

import pytest
from grpo_rollout.rewards import sandbox
from grpo_rollout.rewards.base import Unjudged
from grpo_rollout.rewards.worker import (
    ANSWER_BASE_BYTES,
    ANSWER_BYTES_PER_SCORE,
    ANSWER_BYTES_PER_UNJUDGED,
    PluginError,
    PluginTimeout,
    PluginWorker,
)

from tests.support.reward_processes import alive, in_session

PLUGINS = """
import json, os, subprocess, sys, time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]

def hog(prompts, completions, **columns):
    chunks = []
    while True:
        chunks.append(bytearray(1 << 20))

def token(prompts, completions, **columns):
    return [float(len(os.environ["GRPO_TOKEN"]))] * len(completions)

def keyed(prompts, completions, **columns):  # a hosted judge's key: from the file, never the env
    from grpo_rollout.rewards.credentials import credential
    in_env = 100.0 if "OPENAI_API_KEY" in os.environ else 0.0
    return [float(len(credential("judge-key"))) + in_env] * len(completions)

def chatty(prompts, completions, **columns):
    print("a line on stdout, where the answers used to go", flush=True)
    return [1.0] * len(completions)

def flood(prompts, completions, **columns):
    return [0.0] * 1_000_000

class Opens:  # unpickling this creates the file it names
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))

def forge(prompts, completions, marker, **columns):
    import gc, io, pickle
    (channel,) = [o for o in gc.get_objects() if isinstance(o, io.BufferedWriter) and o.mode == "wb"]
    channel.write(pickle.dumps(Opens(marker[0])) + b"\\n")
    channel.flush()
    return [1.0]

def answer_unjudged(prompts, completions, unjudged, **columns):  # writes the answer line itself
    import gc, io
    (channel,) = [o for o in gc.get_objects() if isinstance(o, io.BufferedWriter) and o.mode == "wb"]
    answer = {"ok": True, "scores": [0.0], "unjudged": json.loads(unjudged[0])}
    channel.write(json.dumps(answer).encode() + b"\\n")
    channel.flush()
    os._exit(0)

def spawn_and_hang(prompts, completions, pidfile, **columns):
    forked = os.fork()  # stays in the worker's process group
    if forked == 0:
        time.sleep(3600)
        os._exit(0)
    # A daemon: its parent exits at once and it left the session, as a sandboxing reward might do.
    quiet = "stdout=s.DEVNULL, stderr=s.DEVNULL"  # or run() would wait for the daemon's pipes to close
    daemon = f"import subprocess as s; print(s.Popen({SLEEPER!r}, start_new_session=True, {quiet}).pid)"
    spawner = subprocess.run([sys.executable, "-c", daemon], capture_output=True, text=True, check=True)
    with open(pidfile[0], "w") as f:
        json.dump({"forked": forked, "daemon": int(spawner.stdout)}, f)
    time.sleep(3600)
"""


@pytest.fixture(scope="module", autouse=True)
def plugin_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox_plugins")
    (root / "grpo_sandbox_plugins.py").write_text(textwrap.dedent(PLUGINS))
    sys.path.insert(0, str(root))  # the worker is given the parent's sys.path
    yield
    sys.path.remove(str(root))


@pytest.fixture
def worker():
    w = PluginWorker(memory_bytes=256 << 20)
    yield w
    w.kill()


def call(w: PluginWorker, fn: str, timeout: float = 30.0, **columns) -> list[float | None]:
    return w.call(f"grpo_sandbox_plugins:{fn}", ["p"], ["c"], {k: [v] for k, v in columns.items()}, timeout)


def test_child_env_drops_the_token_and_secret_looking_names():
    parent = {
        "PATH": "/usr/bin",
        "GRPO_CONTRACT": "/etc/grpo/job.json",
        "GRPO_TOKEN": "t",
        "HF_TOKEN": "t",
        "AWS_SECRET_ACCESS_KEY": "t",
        "OPENAI_API_KEY": "t",
        "db_password": "t",
        "OMP_NUM_THREADS": "16",
    }
    env = sandbox.child_env(parent, ["/plugins", "", "/site"])
    assert env == {
        "PATH": "/usr/bin",
        "GRPO_CONTRACT": "/etc/grpo/job.json",
        "PYTHONPATH": "/plugins:/site",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def test_memory_limit_defaults_to_4_gib_and_refuses_nonsense():
    assert sandbox.memory_limit({}) == 4096 << 20
    assert sandbox.memory_limit({"GRPO_REWARD_MEMORY_MB": "256"}) == 256 << 20
    for bad in ("lots", "-1", "0", "1.5"):
        with pytest.raises(ValueError, match="GRPO_REWARD_MEMORY_MB"):
            sandbox.memory_limit({"GRPO_REWARD_MEMORY_MB": bad})


def test_a_reward_allocating_without_bound_fails_alone_and_the_worker_goes_on(worker):
    with pytest.raises(PluginError, match="MemoryError: over the reward worker's 256 MiB memory limit"):
        call(worker, "hog")
    assert call(worker, "chatty") == [1.0]
    assert worker.killed == 0  # the limit stopped the reward, not the process


def test_the_worker_never_sees_the_job_token(worker, monkeypatch):
    monkeypatch.setenv("GRPO_TOKEN", "rollout-token")
    with pytest.raises(PluginError, match="KeyError: 'GRPO_TOKEN'"):
        call(worker, "token")


def test_a_reward_reads_the_jobs_credentials_as_files_and_never_from_the_env(worker, monkeypatch, tmp_path):
    """spec.reward.credentialsSecret in a pod: the Secret's keys are files under $GRPO_REWARD_FILES,
    which the sandbox keeps, while a key in the env is stripped like the token."""
    (tmp_path / "judge-key").write_text("sk-0123456789\n")  # a Secret volume's file, newline and all
    monkeypatch.setenv("GRPO_REWARD_FILES", str(tmp_path))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-in-the-env")
    assert call(worker, "keyed") == [13.0]


def test_printing_does_not_corrupt_the_answers_and_a_flood_is_refused(worker):
    assert call(worker, "chatty") == [1.0]
    one_score = ANSWER_BASE_BYTES + ANSWER_BYTES_PER_SCORE + ANSWER_BYTES_PER_UNJUDGED
    with pytest.raises(PluginError, match=f"more than one line of at most {one_score} bytes"):
        call(worker, "flood")
    assert worker.killed == 1
    assert call(worker, "chatty") == [1.0]  # a fresh worker


def test_a_forged_answer_is_parsed_as_json_never_unpickled(worker, tmp_path):
    marker = tmp_path / "unpickled"
    with pytest.raises(PluginError, match="reward worker answered"):
        call(worker, "forge", marker=str(marker))
    assert not marker.exists()
    assert worker.killed == 1  # a worker that forged once is not trusted with the next call


def test_an_unjudged_score_comes_back_as_one(worker):
    (score,) = call(worker, "answer_unjudged", unjudged='[[0, "out of time"]]')
    assert isinstance(score, Unjudged) and score.reason == "out of time"


@pytest.mark.parametrize(
    "unjudged", ['[[1, "x"]]', "[[0, 7]]", '[[true, "x"]]', "[0]", '[[0, "x", 1]]', "{}"]
)
def test_a_malformed_unjudged_list_is_garbage(worker, unjudged):
    with pytest.raises(PluginError, match="reward worker answered garbage"):
        call(worker, "answer_unjudged", unjudged=unjudged)
    assert worker.killed == 1


def test_a_timeout_kills_the_worker_with_everything_it_started(worker, tmp_path):
    worker.check("grpo_sandbox_plugins:spawn_and_hang")
    assert worker._proc is not None
    session = worker._proc.pid  # start_new_session: the worker leads its session and group
    pidfile = tmp_path / "pids.json"
    with pytest.raises(PluginTimeout, match="timed out after 5s"):
        call(worker, "spawn_and_hang", timeout=5.0, pidfile=str(pidfile))
    pids = json.loads(pidfile.read_text())
    assert not alive(pids["forked"]) and not alive(pids["daemon"])
    assert not alive(session) and in_session(session) == []
