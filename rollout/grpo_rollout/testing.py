"""Tiny random HF models with a character-level tokenizer, built offline, for the rollout tests.

The rollout tests (and anyone who needs a model directory without a download) call
`build_tiny_model(dir)`; nothing here is used at serving time. Random weights are enough: the
tests check mechanics (batched sampling, log-probs, weight swaps), not quality.
"""

import contextlib
import string
from collections.abc import Iterator
from pathlib import Path

CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_char_tokenizer():
    """A PreTrainedTokenizerFast with one token per printable ASCII character, <pad>/<eos>/<unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_model(
    directory: str | Path,
    *,
    arch: str = "qwen3_moe",
    seed: int = 0,
    tied: bool = False,
    head_dim: int = 16,
) -> Path:
    """Save a tiny random `qwen3_moe` (4 experts, top-2) or `qwen2` causal LM and its tokenizer;
    `tied`: the output head is the input embedding (`tie_word_embeddings`); `head_dim` (qwen3_moe):
    vLLM's CPU attention refuses 16, the torch engine's tests keep it small."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3MoeConfig

    tokenizer = build_char_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
    )
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=head_dim,
            **common,
        )
    elif arch == "qwen2":
        config = Qwen2Config(intermediate_size=128, **common)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose qwen3_moe or qwen2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out = Path(directory)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_contract(
    path: str | Path,
    model_dir: str | Path,
    *,
    ports: list[int],
    rewards: list[dict] | None = None,
    reward_timeout: float = 10.0,
    max_batch_size: int = 64,
    engine: str = "torch",
    vllm: dict | None = None,
) -> Path:
    """A run contract (job.json) for rollout servers on loopback `ports` serving `model_dir`
    with `engine` (`vllm`: the `spec.rollout.vllm` fields in their YAML spelling)."""
    from grpo_operator.api.contract import RolloutTopology, RunContract, TrainerTopology
    from grpo_operator.api.spec import GRPOJobSpec

    spec = GRPOJobSpec.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "dataset": {"path": "/dev/null"},
            "reward": {
                "functions": rewards or [{"builtin": "exact_match"}],
                "timeoutSeconds": reward_timeout,
            },
            "rollout": {
                "engine": engine,
                "replicas": len(ports),
                "maxBatchSize": max_batch_size,
                **({"vllm": vllm} if vllm else {}),
            },
        }
    )
    contract = RunContract(
        job_name="test",
        namespace="default",
        spec=spec,
        trainer=TrainerTopology(
            service="test-trainer",
            replicas=1,
            processes_per_pod=1,
            world_size=1,
            expert_parallel_size=1,
            data_parallel_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            backend="gloo",
        ),
        rollout=RolloutTopology(
            service="test-rollout",
            replicas=len(ports),
            port=ports[0],
            endpoints=[f"http://127.0.0.1:{p}" for p in ports],
        ),
        checkpoint_dir="/tmp/unused",
    )
    out = Path(path)
    out.write_text(contract.model_dump_json(by_alias=True))
    return out


_PORTS_PER_WORKER = 1500
_next_port: list[int] = []


def free_port() -> int:
    """A loopback port nobody listens on, for a process the test starts next.

    Not the kernel's pick: bind(0) hands out ephemeral ports, which any outgoing connection (or
    a concurrent test session's `free_port()`) can take before our process binds it. The ports
    come from a block below the ephemeral range (32768 on Linux), walked from a random start;
    each pytest-xdist worker, when a developer runs with `-n`, has its own block."""
    import os
    import random
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    first = 17000 + (worker % 10) * _PORTS_PER_WORKER
    if not _next_port:
        _next_port.append(random.randrange(_PORTS_PER_WORKER))
    for _ in range(_PORTS_PER_WORKER):
        port = first + _next_port[0] % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {first}..{first + _PORTS_PER_WORKER - 1}")


def start_server(
    contract: str | Path,
    port: int,
    token: str,
    *,
    drain_seconds: float = 10.0,
    extra_pythonpath: str | None = None,
    log_path: str | Path | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
):
    """Start `python -m grpo_rollout serve` as a real child process on 127.0.0.1:port, under
    `python` (default: this interpreter; the vllm tests use the vllm venv's) with `env` added."""
    import os
    import subprocess
    import sys

    child_env = dict(
        os.environ, GRPO_CONTRACT=str(contract), GRPO_TOKEN=token, HF_HUB_OFFLINE="1", GRPO_POD_INDEX="0"
    )
    child_env.update(env or {})
    if extra_pythonpath:
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (extra_pythonpath, child_env.get("PYTHONPATH")) if p
        )
    cmd = [python or sys.executable, "-m", "grpo_rollout", "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", "1", "--drain-seconds", str(drain_seconds)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    return subprocess.Popen(cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc, timeout: float = 120.0) -> None:
    """Poll GET /health until 200; fail early, with the exit code, if the server process died."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server {url} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"rollout server {url} not ready after {timeout}s")


@contextlib.contextmanager
def running_servers(
    model_dir: str | Path, work: Path, token: str, count: int = 2
) -> Iterator[tuple[list, list]]:
    """`count` real rollout servers of one contract, ready; (urls, processes). Stopped servers
    (SIGSTOP in a test) are continued before the kill, so none is left behind."""
    import signal

    ports = [free_port() for _ in range(count)]
    contract = write_contract(work / "servers.json", model_dir, ports=ports, max_batch_size=32)
    procs = [start_server(contract, p, token, drain_seconds=3.0, log_path=work / f"{p}.log") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield urls, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)
