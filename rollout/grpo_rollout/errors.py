"""The refusal a rollout server answers with: an HTTP status and a protocol error code.

Raised by the service and its parts (`grpo_rollout.receiver`); `grpo_rollout.server` turns it into
an `ErrorResponse`.
"""


class ServiceError(Exception):
    """A refusal with its HTTP status and protocol error code."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


def loading() -> ServiceError:
    return ServiceError(503, "loading", "server is still loading its model", retry_after=5)
