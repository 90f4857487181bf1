"""Wire protocol bounds, the routing payload, the weight-bucket header round trip (grpo_wire.protocol)."""

import base64

import pytest
import torch
from grpo_rollout.engines.routing import encode_routing
from grpo_wire.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_SEQUENCES_PER_REQUEST,
    PROTOCOL_VERSION,
    Completion,
    GenerateRequest,
    PromptResult,
    WeightBucket,
)
from pydantic import ValidationError


def request(prompts: int, n: int = 2, **kw) -> dict:
    return {"request_id": "r", "prompts": [{"id": str(i), "text": "x"} for i in range(prompts)], "n": n, **kw}


def test_a_valid_request_fills_sampling_defaults():
    req = GenerateRequest.model_validate(request(3))
    assert req.protocol_version == PROTOCOL_VERSION == 3
    assert (req.sampling.temperature, req.sampling.top_p) == (1.0, 1.0)


@pytest.mark.parametrize(
    "body, fragment",
    [
        (request(MAX_PROMPTS_PER_REQUEST + 1), "at most 1024"),
        (request(100, n=MAX_SEQUENCES_PER_REQUEST // 100 + 1), "sequences per request"),
        (request(1, protocol_version=1), "protocol_version"),
        (request(1, extra_field=1), "extra_field"),
        (request(1, sampling={"top_p": 0}), "top_p"),
        ({**request(2), "prompts": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, "unique"),
    ],
)
def test_out_of_bounds_requests_are_rejected_by_name(body, fragment):
    with pytest.raises(ValidationError, match=fragment):
        GenerateRequest.model_validate(body)


def test_completion_needs_one_logprob_per_token():
    with pytest.raises(ValidationError, match="2 token_ids but 1 logprobs"):
        Completion(text="ab", token_ids=[1, 2], logprobs=[-0.1], finish_reason="length", reward=0.0)


def test_weight_bucket_round_trips_through_headers():
    meta = WeightBucket(version=7, index=2, count=3)
    headers = meta.to_headers()
    assert all(isinstance(v, str) for v in headers.values())
    assert WeightBucket.from_headers(headers) == meta


@pytest.mark.parametrize(
    "headers, fragment",
    [
        (
            {"X-Grpo-Weight-Version": "1", "X-Grpo-Bucket-Index": "3", "X-Grpo-Bucket-Count": "3"},
            "out of range",
        ),
        ({"X-Grpo-Weight-Version": "0", "X-Grpo-Bucket-Index": "0", "X-Grpo-Bucket-Count": "1"}, "version"),
        ({"X-Grpo-Bucket-Index": "0", "X-Grpo-Bucket-Count": "1"}, "version"),
        ({"X-Grpo-Weight-Version": "x", "X-Grpo-Bucket-Index": "0", "X-Grpo-Bucket-Count": "1"}, "version"),
    ],
)
def test_bad_bucket_headers_fail_validation(headers, fragment):
    with pytest.raises(ValidationError, match=fragment):
        WeightBucket.from_headers(headers)


def result_with_routing(routing: dict, prompt: int = 3, completion: int = 2) -> dict:
    completion_body = {
        "text": "x",
        "token_ids": list(range(completion)),
        "logprobs": [-1.0] * completion,
        "finish_reason": "length",
        "reward": 0.0,
        "routing": routing,
    }
    return {"prompt_id": "p", "prompt_token_ids": list(range(prompt)), "completions": [completion_body]}


@pytest.mark.parametrize("num_experts, dtype", [(8, "uint8"), (300, "int16")])
def test_routing_round_trips_compactly_through_json(num_experts: int, dtype: str) -> None:
    idx = torch.randint(0, num_experts, (4, 3, 2))  # prompt 3 + completion 2 - 1 tokens, 3 layers, k 2
    routing = encode_routing(idx, num_experts)
    assert routing.dtype == dtype and routing.shape == (4, 3, 2)
    assert len(routing.raw()) == idx.numel() * (1 if dtype == "uint8" else 2)
    wire = PromptResult.model_validate(result_with_routing(routing.model_dump())).model_dump_json()
    back = PromptResult.model_validate_json(wire).completions[0].routing
    assert back is not None
    decoded = torch.frombuffer(bytearray(back.raw()), dtype=getattr(torch, dtype)).view(back.shape)
    assert torch.equal(decoded.long(), idx)


GOOD = {"shape": [4, 1, 2], "dtype": "uint8", "data": base64.b64encode(bytes(8)).decode()}


@pytest.mark.parametrize(
    "routing, fragment",
    [
        ({**GOOD, "data": base64.b64encode(bytes(7)).decode()}, "has 7 bytes"),
        ({**GOOD, "data": "not base64!"}, "not base64"),
        ({**GOOD, "dtype": "int64"}, "dtype"),
        ({**GOOD, "shape": [4, 0, 2], "data": ""}, "layers >= 1"),
        (
            {**GOOD, "shape": [5, 1, 2], "data": base64.b64encode(bytes(10)).decode()},
            "prompt \\+ completion - 1 = 4",
        ),
    ],
)
def test_malformed_routing_is_rejected(routing: dict, fragment: str) -> None:
    PromptResult.model_validate(result_with_routing(GOOD))
    with pytest.raises(ValidationError, match=fragment):
        PromptResult.model_validate(result_with_routing(routing))


def test_routing_is_asked_for_per_request() -> None:
    assert GenerateRequest.model_validate(request(1)).return_routing is False
    assert GenerateRequest.model_validate(request(1, return_routing=True)).return_routing is True


def test_a_generate_error_says_when_every_failed_server_shares_one_code() -> None:
    """What the trainer tells a failing reward model (every server 502 reward_unavailable) from a
    mixed failure, which its generic retry path handles."""
    from grpo_wire.client import GenerateError

    failures = {"a": "HTTP 502 reward_unavailable", "b": "HTTP 502 reward_unavailable"}
    both = GenerateError(4, failures, codes={"a": "reward_unavailable", "b": "reward_unavailable"})
    assert both.only("reward_unavailable") and not both.only("engine_dead")
    mixed = GenerateError(4, {**failures, "c": "no answer"}, codes=both.codes)
    assert not mixed.only("reward_unavailable")
    assert not GenerateError(4, {}).only("reward_unavailable")  # no server failed: nothing shared
