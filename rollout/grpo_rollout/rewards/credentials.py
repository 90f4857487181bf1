"""What reward functions, tools and environments read a credential with: `credential("openai-api-key")`.

spec.reward.credentialsSecret's keys are files in the rollout pods (`REWARD_FILES_MOUNT`, one per
key, the Secret mounted read-only), never env: the reward sandbox strips secret-looking variables
from its workers (`grpo_rollout.rewards.sandbox`), so a key put in env would not reach the reward
anyway, and would reach everything else in the pod. `$GRPO_REWARD_FILES` names the folder (the
sandbox keeps that name); locally, `grpo-operator run` points it at a folder of the user's.

    from grpo_rollout.rewards.credentials import credential

    def judge(prompt, completion, **columns):
        client = OpenAI(api_key=credential("openai-api-key"))
        ...
"""

import os
from pathlib import Path

from grpo_operator.api.spec import ENV_REWARD_FILES

FIELD = "spec.reward.credentialsSecret"


class CredentialError(LookupError):
    """The job mounts no credentials, or not this key; the message says which and what exists."""


def folder() -> Path:
    """Where this pod's reward credentials are; CredentialError when the job names none."""
    where = os.environ.get(ENV_REWARD_FILES)
    if not where:
        raise CredentialError(
            f"{FIELD} is not set: this job mounts no reward credentials (${ENV_REWARD_FILES} is unset)"
        )
    return Path(where)


def keys() -> list[str]:
    """The keys of the job's credentials Secret (a Secret volume's files; its ..data links left out)."""
    return sorted(p.name for p in folder().iterdir() if not p.name.startswith("."))


def credential(key: str) -> str:
    """The value of `key` in the job's credentials Secret, without a trailing newline."""
    if not key or "/" in key or key.startswith("."):
        raise CredentialError(f"{key!r} is not a key of a Secret (no '/', no leading '.')")
    path = folder() / key
    try:
        return path.read_text().rstrip("\r\n")
    except FileNotFoundError:
        raise CredentialError(f"{FIELD} has no key {key!r}; its keys: {keys()}") from None
