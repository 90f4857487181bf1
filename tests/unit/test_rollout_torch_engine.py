"""The torch engine's decode loop against teacher forcing, EOS handling, routing and weight swaps.

A tiny random model is built offline; log-probs and MoE routing recorded while sampling
(left-padded batches, KV cache, several chunks) must equal a plain full-sequence forward pass of
the same model.
"""

import threading

import numpy as np
import pytest
import torch
from grpo_rollout import stream_member
from grpo_rollout.engines.base import EngineConfig, create_engine
from grpo_rollout.engines.routing import RoutingRecorder
from grpo_rollout.engines.sampling import policy_logprobs
from grpo_trainer.weight_sync import StreamSender
from grpo_wire import weight_stream
from grpo_wire.protocol import Sampling, WeightStreamRequest
from safetensors.torch import save

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model

PROMPTS = ["1+1=", "what is 12 * 7?", "a", "hello world, how are you"]


def tiny_engine(tmp_path_factory, arch: str):
    path = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
    return create_engine("torch", EngineConfig(model_path=str(path), max_batch_size=5))


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def dense_engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory, "qwen2")


@pytest.fixture(params=["moe", "dense"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


def teacher_forced(engine, prompt_ids: list[int], completion: list[int], sampling: Sampling) -> torch.Tensor:
    """Log-probs of `completion` from one unpadded forward pass over prompt + completion."""
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = engine.model(ids).logits[
            0, len(prompt_ids) - 1 : -1
        ]  # [T, V] predicting each completion token
    logp = policy_logprobs(logits, sampling.temperature, sampling.top_p)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampled_logprobs_match_teacher_forcing(engine, temperature, top_p):
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=12, seed=3)
    out = engine.generate(PROMPTS, 3, sampling, lambda: False)  # 12 sequences in chunks of 1 prompt (5 // 3)
    assert [len(p.samples) for p in out] == [3, 3, 3, 3]
    for prompt, result in zip(PROMPTS, out, strict=True):
        assert result.prompt_token_ids == engine.tokenizer(prompt)["input_ids"]
        for s in result.samples:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            expected = teacher_forced(engine, result.prompt_token_ids, s.token_ids, sampling)
            assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4), (s.logprobs, expected)


def teacher_forced_routing(engine, prompt_ids: list[int], fed: list[int]) -> torch.Tensor:
    """[tokens, layers, k] experts of one unpadded forward, each token's slots sorted by expert id."""
    recorder = RoutingRecorder(engine.model)
    with recorder.recording(), torch.no_grad():
        engine.model(torch.tensor([prompt_ids + fed]))
        return recorder.take().long().sort(-1).values


def test_recorded_routing_is_what_a_teacher_forced_forward_chooses(moe_engine):
    engine = moe_engine
    sampling = Sampling(temperature=1.3, max_new_tokens=12, seed=4)
    plain = engine.generate(PROMPTS, 3, sampling, lambda: False)
    out = engine.generate(PROMPTS, 3, sampling, lambda: False, routing=True)
    for p_plain, result in zip(plain, out, strict=True):
        for s_plain, s in zip(p_plain.samples, result.samples, strict=True):
            assert (s.token_ids, s.logprobs) == (s_plain.token_ids, s_plain.logprobs)  # recording is passive
            assert s.routing is not None and s.routing.dtype == "uint8"
            got = np.frombuffer(s.routing.raw(), dtype=np.uint8).reshape(s.routing.shape)
            want = teacher_forced_routing(engine, result.prompt_token_ids, s.token_ids[:-1])
            assert got.shape == (len(result.prompt_token_ids) + len(s.token_ids) - 1, 2, 2)
            assert torch.equal(torch.from_numpy(got.copy()).long().sort(-1).values, want)


def test_routing_of_a_dense_model_is_a_clear_error(dense_engine):
    with pytest.raises(ValueError, match="needs an MoE model"):
        dense_engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=2), lambda: False, routing=True)


def test_samples_stop_at_eos_or_length(engine):
    sampling = Sampling(max_new_tokens=40, seed=0, temperature=1.5)
    samples = [s for p in engine.generate(PROMPTS, 16, sampling, lambda: False) for s in p.samples]
    eos = set(engine.eos_ids.tolist())
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "with ~100 tokens and 40 steps some of 64 samples must draw EOS"
    for s in stopped:
        assert s.token_ids[-1] in eos and not eos & set(s.token_ids[:-1])
        assert s.text == engine.tokenizer.decode(s.token_ids[:-1], skip_special_tokens=True)
    for s in samples:
        if s.finish_reason == "length":
            assert len(s.token_ids) == 40 and not eos & set(s.token_ids)


def test_seed_makes_samples_repeat(engine):
    def texts(seed):
        return [
            s.text
            for p in engine.generate(PROMPTS, 2, Sampling(max_new_tokens=8, seed=seed), lambda: False)
            for s in p.samples
        ]

    assert texts(5) == texts(5)
    assert texts(5) != texts(6)


def test_stop_request_hands_every_prompt_back(engine):
    assert engine.generate(PROMPTS, 2, Sampling(max_new_tokens=8), lambda: True) == [None] * len(PROMPTS)


def bucket(tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors)


def test_load_weights_rejects_bad_versions_without_changing_anything(engine):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name, tensor = next(iter(before.items()))
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.load_weights([bucket({name: tensor + 1}), bucket({"model.nope.weight": torch.zeros(1)})])
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights([bucket({name: tensor + 1, "lm_head.weight": torch.zeros(1, 1)})])
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())


def test_load_weights_changes_what_is_sampled(engine):
    sampling = Sampling(max_new_tokens=10, seed=1)
    before = engine.generate(PROMPTS[:2], 2, sampling, lambda: False)
    state = engine.model.state_dict()
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in state.items() if "lm_head" in k or "embed" in k}
    assert engine.load_weights([bucket(new)]) == len(new)
    after = engine.generate(PROMPTS[:2], 2, sampling, lambda: False)
    assert [s.token_ids for p in after for s in p.samples] != [s.token_ids for p in before for s in p.samples]
    s = after[0].samples[0]
    assert torch.allclose(
        torch.tensor(s.logprobs),
        teacher_forced(engine, after[0].prompt_token_ids, s.token_ids, sampling),
        atol=1e-4,
    )


def test_empty_prompt_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate([""], 1, Sampling(max_new_tokens=2), lambda: False)


def test_unknown_engine_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'tpu'; choose one of \['torch', 'vllm'\]"):
        create_engine("tpu", EngineConfig(model_path="/nonexistent"))


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_a_streamed_version_lands_in_the_live_weights_in_place_when_the_dtypes_agree(
    tmp_path_factory, monkeypatch, wire
):
    """Through the server's own member (`LocalMember`) over a real gloo group: pieces that travel
    alone are received straight into the parameters when the wire carries their dtype (float32
    here), and through `load_bucket` when it does not; the version is exact and live either way."""
    monkeypatch.setattr(weight_stream, "DIRECT_BYTES", 1024)  # the tiny model's large tensors go alone
    engine = tiny_engine(tmp_path_factory, "qwen2")
    state = engine.model.state_dict()
    storage = {k: v.data_ptr() for k, v in state.items()}
    new = {k: torch.randn_like(v) for k, v in state.items()}
    name = "model.embed_tokens.weight"
    engine.begin_update({name: list(state[name].shape)})
    spot = engine.destination(name, 8, 100, wire, torch.device("cpu"))
    assert (spot is not None) == (wire == torch.float32)
    assert spot is None or (spot.numel() == 400 and spot.data_ptr() == state[name].data_ptr() + 32)
    assert engine.destination(name, state[name].numel() - 4, 100, torch.float32, torch.device("cpu")) is None
    engine.abort_update()

    sender = StreamSender("127.0.0.1", free_port(), 0, timeout_s=30)  # one trainer rank, feeding
    port = sender.port
    req = WeightStreamRequest(
        version=2, epoch=1, store_host="127.0.0.1", store_port=port, backend="gloo", feeders=1,
        members=1, first_member=0, timeout_s=30, tensors={k: list(v.shape) for k, v in new.items()},
    )  # fmt: skip
    errors: list[BaseException] = []

    def send() -> None:
        try:
            items = [(k, 0, v.reshape(-1)) for k, v in new.items()]
            sender.send(iter(items), epoch=1, members=1, backend="gloo", dtype=wire, bucket_bytes=64 << 10,
                        device=torch.device("cpu"))  # fmt: skip
        except BaseException as e:
            errors.append(e)

    sending = threading.Thread(target=send)
    sending.start()
    outcome = stream_member.LocalMember(engine, weight_stream.ReceiverLink()).receive_stream(
        req, refused=False
    )
    sending.join(30)
    assert not errors and outcome.kind == "live", (errors, outcome)
    after = engine.model.state_dict()
    for k, v in new.items():
        assert torch.equal(after[k], v.to(wire).to(v.dtype)), k
        assert after[k].data_ptr() == storage[k]  # the same live tensors, written over
