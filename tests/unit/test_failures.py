"""What a failed reconcile pass says about itself, and how long the next one waits."""

import json

from grpo_operator.controller import failures
from grpo_operator.controller.kube import ApiException


class Taken(RuntimeError):
    reason = "ChildConflict"


def test_backoff_doubles_from_five_seconds_up_to_five_minutes():
    assert [failures.backoff_seconds(n) for n in range(1, 8)] == [5, 10, 20, 40, 80, 160, 300]
    assert failures.backoff_seconds(10**6) == 300  # no float overflow after days of failures


def test_an_api_refusal_quotes_the_api_servers_message():
    refusal = 'StatefulSet "j-trainer" is invalid: spec.template...image: Required value'
    e = ApiException(status=422, reason="Unprocessable Entity")
    e.body = json.dumps({"message": refusal})
    assert failures.describe(e) == ("ReconcileFailed", f"the API server answered 422: {refusal}")


def test_an_error_that_names_its_reason_keeps_it_and_long_messages_are_cut():
    assert failures.describe(Taken("ServiceAccount j-trainer is not ours")) == (
        "ChildConflict",
        "Taken: ServiceAccount j-trainer is not ours",
    )
    reason, message = failures.describe(TypeError("x" * 5000))
    assert reason == "ReconcileFailed" and len(message) == failures.MAX_MESSAGE
