"""The collective weight transport end to end: two trainer ranks stream to real rollout servers.

Two sender threads play trainer ranks (each sends its half of every tensor, `owned_items` at
world 2); the servers are real `python -m grpo_rollout serve` processes with the torch engine,
told over HTTP (`/weights/stream`) to join the groups. Checked: the streamed weights are exactly
those pushed over HTTP (same seed, same samples and log-probs), a version missing a piece never
goes live, a server that starts late joins the groups of the next version (a new epoch), a stream
a sender broke is called off at the servers still up (they answer at once, not at the groups'
timeout), and a server told to stop mid-stream finishes the stream before it exits.
"""

import asyncio
import contextlib
import random
import signal
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch
from grpo_trainer.weight_sync import StreamSender, owned_items, tied_aliases
from grpo_wire import weight_stream
from grpo_wire.client import RolloutClient, bucketize
from grpo_wire.protocol import Prompt, Sampling, WeightStreamRequest

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model, running_servers, start_server, wait_ready

pytestmark = pytest.mark.slow
TOKEN = "weight-stream-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), arch="qwen2", tied=True)


def trained(model_dir: Path) -> torch.nn.Module:
    """The policy after some training: every weight moved."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def stream(senders, urls, version, epoch, model, *, skip: str | None = None, midway=None, timeout_s=60):
    """Stream `model` as `version` from both senders to `urls`; the servers' answers by URL.
    `midway()` runs as rank 0 forwards its MIDWAY-th bucket; a sender's error is then expected.
    As in the trainer, a server failing calls the stream off. The servers must answer within 60 s."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items() if k not in tied_aliases(model)}
    store = dict(store_host="127.0.0.1", store_port=senders[0].store.port)
    shared = dict(**store, backend="gloo", timeout_s=timeout_s, feeders=min(2, len(urls)))
    requests = {
        url: WeightStreamRequest(
            version=version, epoch=epoch, members=len(urls), first_member=i, tensors=shapes, **shared
        )
        for i, url in enumerate(urls)
    }
    errors = []

    def send(rank: int) -> None:
        try:
            items = [it for it in owned_items(model, rank, 2, 1) if it[0] != skip]
            senders[rank].send(
                items,
                epoch=epoch,
                members=len(urls),
                backend="gloo",
                dtype=torch.float32,
                bucket_bytes=64 << 10,
                device=torch.device("cpu"),
            )
        except BaseException as e:
            errors.append(e)

    async def tell():
        async with RolloutClient(urls, TOKEN) as client:
            call_off = lambda *_: senders[0].call_off(epoch)  # noqa: E731
            return await asyncio.wait_for(client.stream_weights(requests, call_off), 60)

    threads = [threading.Thread(target=send, args=(r,), name=f"rank-{r}") for r in range(2)]
    with _calling(midway):
        for t in threads:
            t.start()
        result = asyncio.run(tell())
        for t in threads:
            t.join(60)
    stuck = [t for t in threads if t.is_alive()]
    frames = sys._current_frames()
    where = "".join(f"\n{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])) for t in stuck)
    assert not stuck, f"a sender still waits on its group (errors: {errors}){where}"
    assert (midway is not None) or not errors, errors
    return result


MIDWAY = 4


@contextlib.contextmanager
def _calling(fn):
    """Run `fn` once, as rank 0's thread forwards its MIDWAY-th bucket (the version is then
    half-way: the tiny model at 64 KiB buckets takes over ten)."""
    if fn is None:
        yield
        return
    real, calls = weight_stream.send_bucket, []

    def send_bucket(*args, **kwargs):
        if threading.current_thread().name == "rank-0":
            calls.append(1)
            if len(calls) == MIDWAY:
                fn()
        return real(*args, **kwargs)

    weight_stream.send_bucket = send_bucket
    try:
        yield
    finally:
        weight_stream.send_bucket = real


def sample(url: str, seed: int = 5):
    async def go():
        async with RolloutClient([url], TOKEN) as client:
            out = await client.generate(
                [Prompt(id="p", text="1+2=")], n=4, sampling=Sampling(max_new_tokens=8, seed=seed)
            )
            return [(c.token_ids, c.logprobs) for c in out[0].completions]

    return asyncio.run(go())


def live(url: str) -> int:
    async def go():
        async with RolloutClient([url], TOKEN) as client:
            return (await client.health())[url].weight_version

    return asyncio.run(go())


def test_streamed_weights_are_exact_go_live_only_whole_and_late_servers_join_the_next_epoch(
    model_dir, tmp_path
):
    model = trained(model_dir)
    port = free_port()
    senders = [StreamSender("127.0.0.1", port, 0, world=2, timeout_s=60)]
    senders.append(StreamSender("127.0.0.1", port, 1, world=2, timeout_s=60))
    with running_servers(model_dir, tmp_path, TOKEN, count=2) as (urls, _):
        before = sample(urls[0])
        result = stream(senders, urls, 1, random.getrandbits(40), model)
        assert result.live == {u: 1 for u in urls} and not result.failed
        streamed = sample(urls[0])
        assert streamed != before  # the new weights are in use

        async def push_http():  # the same weights over HTTP to the other server
            async with RolloutClient([urls[1]], TOKEN) as client:
                tied = tied_aliases(model)  # sent once, as the embedding
                state = {k: v for k, v in model.state_dict().items() if k not in tied}
                return await client.push_weights(bucketize(state), 2)

        asyncio.run(push_http())
        assert sample(urls[1]) == streamed  # bitwise the same weights: the same samples and log-probs

        epoch = random.getrandbits(40)
        result = stream(senders, urls, 3, epoch, model, skip="model.norm.weight")
        assert result.live == {} and all("incomplete" in why for why in result.failed.values())
        assert [live(u) for u in urls] == [1, 2]  # version 3 never went live

        late_port = free_port()
        late_url = f"http://127.0.0.1:{late_port}"
        late = start_server(tmp_path / "servers.json", late_port, TOKEN, drain_seconds=3.0)
        try:
            wait_ready(late_url, late)
            assert live(late_url) == 0
            everyone = [*urls, late_url]
            result = stream(senders, everyone, 4, random.getrandbits(40), model)  # groups formed again
            assert result.live == {u: 4 for u in everyone}
            assert sample(late_url) == streamed
        finally:
            late.kill()
            late.wait(timeout=30)


def test_a_server_lost_mid_stream_is_called_off_at_the_survivor_which_takes_the_next_epoch(
    model_dir, tmp_path
):
    """What the trainer's retry relies on: a member killed mid-stream breaks that version's groups
    (it may go live at no server); whoever sees it break calls the stream off, so the senders and the
    server still up stop waiting (the groups' 300 s timeout would outlast the 60 s `stream` allows)
    and the survivor joins new groups for the next try. A stream called off before a server starts
    it is refused there without joining."""
    model = trained(model_dir)
    port = free_port()
    senders = [StreamSender("127.0.0.1", port, rank, world=2, timeout_s=300) for rank in (0, 1)]
    with running_servers(model_dir, tmp_path, TOKEN, count=2) as (urls, procs):
        epoch = random.getrandbits(40)
        result = stream(senders, urls, 1, epoch, model, midway=procs[1].kill, timeout_s=300)
        assert urls[1] in result.failed and urls[1] not in result.live
        assert live(urls[0]) in (0, 1)  # whole or not at all
        assert result.live == {urls[0]: 1} or urls[0] in result.failed, result
        result = stream(senders, urls[:1], 2, random.getrandbits(40), model)
        assert result.live == {urls[0]: 2} and not result.failed

        called_off = random.getrandbits(40)
        shapes = {k: list(v.shape) for k, v in model.state_dict().items() if k not in tied_aliases(model)}
        request = WeightStreamRequest(
            version=3, epoch=called_off, members=1, first_member=0, tensors=shapes, backend="gloo",
            store_host="127.0.0.1", store_port=senders[0].store.port, timeout_s=300, feeders=1,
        )  # fmt: skip

        async def streamed_after_its_call_off():
            async with RolloutClient(urls[:1], TOKEN) as client:
                return await asyncio.wait_for(client.stream_weights({urls[0]: request}), 60)

        senders[1].call_off(called_off)  # no sender will come: without the call-off it waits 300 s
        result = asyncio.run(streamed_after_its_call_off())
        assert "weight_stream_cancelled" in result.failed[urls[0]] and live(urls[0]) == 2


def test_a_server_told_to_stop_mid_stream_finishes_it_first(model_dir, tmp_path):
    """A rollout pod scaled away or preempted while a version streams: leaving mid-stream would break
    the groups for every server, so its drain lets the stream end; both servers take the version."""
    model = trained(model_dir)
    port = free_port()
    senders = [StreamSender("127.0.0.1", port, rank, world=2, timeout_s=60) for rank in (0, 1)]
    with running_servers(model_dir, tmp_path, TOKEN, count=2) as (urls, procs):
        stop = lambda: procs[1].send_signal(signal.SIGTERM)  # noqa: E731
        result = stream(senders, urls, 1, random.getrandbits(40), model, midway=stop)
        assert result.live == {u: 1 for u in urls} and not result.failed, result
        assert procs[1].wait(timeout=60) == 0
