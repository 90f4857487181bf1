"""A weight group whose receivers are more members than servers: what a TP-2 vLLM server is.

Two trainer ranks (`StreamSender` threads) stream one version into groups of three receiving
members: a real rollout server (`python -m grpo_rollout serve`, torch engine, member 0, told over
HTTP) and two real processes that run the generic member receiver (`stream_member.receive`, as
each vLLM worker does) into torch engines of their own, as members 1 and 2 — one server's two
workers. Checked: the server and both members take the version, every member's weights are
bitwise the trainer's, and the trainer's stream plan numbers the members as they report them.
"""

import asyncio
import hashlib
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from grpo_trainer.generation import member_ranks
from grpo_trainer.weight_sync import StreamSender, owned_items, tied_aliases
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import HealthResponse, WeightStreamRequest

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, running_servers

pytestmark = pytest.mark.slow
TOKEN = "stream-members-token"

MEMBER = """
import hashlib, json, sys, torch
from grpo_rollout import stream_member
from grpo_wire import weight_stream
from grpo_rollout.engines.base import EngineConfig, streamed_update
from grpo_rollout.engines.torch_engine import TorchEngine
from grpo_wire.protocol import WeightStreamRequest

req = WeightStreamRequest.model_validate_json(sys.argv[1])
engine = TorchEngine(EngineConfig(model_path=sys.argv[3], device="cpu"))
out = stream_member.receive(
    weight_stream.ReceiverLink(), req, int(sys.argv[2]), torch.device("cpu"), streamed_update(engine)
)
state = engine.model.state_dict()
digest = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
          for k, v in state.items()}
print(json.dumps({"outcome": out.to_dict(), "digest": digest}))
"""


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in state.items()
    }


def test_a_server_and_two_worker_members_take_one_version_through_groups_of_three(tmp_path: Path):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", tied=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items() if k not in tied_aliases(model)}
    senders = [StreamSender("127.0.0.1", free_port(), 0, world=2, timeout_s=120)]
    senders.append(StreamSender("127.0.0.1", senders[0].port, 1, world=2, timeout_s=120))
    epoch, members = random.getrandbits(40), 3

    (tmp_path / "servers").mkdir()
    with running_servers(model_dir, tmp_path / "servers", TOKEN, count=1) as (urls, _):

        async def health() -> HealthResponse:
            async with RolloutClient(urls, TOKEN) as client:
                return (await client.health())[urls[0]]

        assert asyncio.run(health()).stream_members == 1  # the torch engine: its process receives
        first, total = member_ranks([1, 2])  # the server, then a two-worker server
        assert (first, total) == ([0, 1], members)

        def request(first_member: int) -> WeightStreamRequest:
            return WeightStreamRequest(
                version=1, epoch=epoch, store_host="127.0.0.1", store_port=senders[0].port,
                backend="gloo", feeders=min(2, members), members=members, first_member=first_member,
                timeout_s=120, tensors=shapes,
            )  # fmt: skip

        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    MEMBER,
                    request(1).model_dump_json(),
                    str(first[1] + i),
                    str(model_dir),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        errors: list[BaseException] = []

        def send(rank: int) -> None:
            try:
                senders[rank].send(
                    iter(owned_items(model, rank, 2, 1)),
                    epoch=epoch,
                    members=members,
                    backend="gloo",
                    dtype=torch.float32,
                    bucket_bytes=64 << 10,
                    device=torch.device("cpu"),
                )
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=send, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()

        async def tell():
            async with RolloutClient(urls, TOKEN) as client:
                return await asyncio.wait_for(client.stream_weights({urls[0]: request(first[0])}), 120)

        result = asyncio.run(tell())
        for t in threads:
            t.join(120)
        outs = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
        assert not errors, errors
        assert result.live == {urls[0]: 1} and not result.failed, result
        assert asyncio.run(health()).weight_version == 1
    expected = digest(model.state_dict())
    for out in outs:
        assert out["outcome"]["kind"] == "live", out["outcome"]
        assert out["outcome"]["loaded"] and out["outcome"]["received_bytes"] > 0
        assert out["digest"] == expected
