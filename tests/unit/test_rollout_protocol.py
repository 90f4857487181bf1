"""Wire protocol bounds and the weight-bucket header round trip (grpo_rollout.protocol)."""

import pytest
from grpo_rollout.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_SEQUENCES_PER_REQUEST,
    Completion,
    GenerateRequest,
    WeightBucket,
)
from pydantic import ValidationError


def request(prompts: int, n: int = 2, **kw) -> dict:
    return {"request_id": "r", "prompts": [{"id": str(i), "text": "x"} for i in range(prompts)], "n": n, **kw}


def test_a_valid_request_fills_sampling_defaults():
    req = GenerateRequest.model_validate(request(3))
    assert req.protocol_version == 1
    assert (req.sampling.temperature, req.sampling.top_p) == (1.0, 1.0)


@pytest.mark.parametrize(
    "body, fragment",
    [
        (request(MAX_PROMPTS_PER_REQUEST + 1), "at most 1024"),
        (request(100, n=MAX_SEQUENCES_PER_REQUEST // 100 + 1), "sequences per request"),
        (request(1, protocol_version=2), "protocol_version"),
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
