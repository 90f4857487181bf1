"""Runs a job's interactive environment (spec.environment) in sandbox workers, one live instance per episode.

An environment is a user class, 'module:Name', built as `Name(**spec.environment.args)` once per episode:
`reset(row)` returns the episode's opening messages (the prompt the model answers), and after each model
turn `step(messages)`, given the whole conversation so far, returns {"messages": what to append, "done":
bool, "reward": float or None} (a turn's reward; the one at `done` is the episode's). The rollout loop
builds one `EnvironmentRunner` per job and calls `reset`, then `step` until a result is done, and
`close(episode_id)` for an episode it abandons early (at maxTurns, out of tokens).

Like tools, environment code runs in the reward sandbox (`grpo_rollout.rewards.worker.PluginWorker`:
its memory limit, no token, killed on timeout) and is imported only there, never in the server. Unlike
tools, an instance is state kept between calls in one worker process, so each episode is pinned at
reset to one worker (the one with the fewest live episodes) and all its calls go there. A call past
`timeout` kills that worker, and with it every instance it held: each episode pinned to it gets an
error result at its next step, and the next reset there starts a fresh worker.

Nothing a user's environment does raises out of `reset` or `step`: an exception, a timeout, a crash,
a malformed return (checked in the worker, `grpo_rollout.environment_host`) or an unknown episode is a
`StepResult` with `done=True` and `error` saying why, counted in `errors`. `reset` answers a StepResult
too, so a prompt whose environment cannot start is one failed episode (the caller scores it 0) rather
than a failed request; only a bad class or bad args raise, at construction, naming the spec field.
"""

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from grpo_rollout import environment_host
from grpo_rollout.rewards.child import MAX_ERROR_CHARS
from grpo_rollout.rewards.worker import ANSWER_BASE_BYTES, PluginError, PluginTimeout, PluginWorker

DEFAULT_TIMEOUT_S = 10.0  # per reset or step; the reward timeout's default, as for tools
DEFAULT_MAX_MESSAGE_CHARS = 4096  # per message the environment writes, cut with a visible marker
START_TIMEOUT_S = 60.0  # importing the class in a fresh worker


@dataclass(frozen=True)
class StepResult:
    messages: list[dict[str, str]]  # {role, content} to append to the conversation; [] on an error
    reward: float | None  # this turn's reward, None when the environment gave none
    done: bool  # the episode is over: the environment said so, or it failed (then `error` says why)
    error: str | None = None


@dataclass
class _Slot:
    """One worker, the episodes pinned to it, and why it last lost its instances."""

    worker: PluginWorker
    lock: threading.Lock = field(
        default_factory=threading.Lock
    )  # one call at a time, generation read with it
    pinned: int = 0
    warm: int = -1  # the worker generation (`worker.killed`) that has imported the class
    lost_because: str = ""


@dataclass(frozen=True)
class _Pin:
    slot: _Slot
    generation: int  # `worker.killed` when the instance was made; a later value means it is gone


class EnvironmentRunner:
    """A job's environment class, checked at start-up and played one episode per id in sandbox workers."""

    def __init__(
        self,
        path: str,
        args: dict[str, Any],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS,
        workers: int = 2,
        memory_bytes: int | None = None,
    ) -> None:
        """Import the class in every worker now, so a bad class or args fail at start-up, naming the field."""
        if timeout <= 0 or max_message_chars <= 0 or workers < 1:
            raise ValueError("timeout and max_message_chars must be positive, workers at least 1")
        try:
            json.dumps(args)
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec.environment.args must be JSON data: {e}") from None
        self.path, self.args, self.timeout, self.max_message_chars = path, args, timeout, max_message_chars
        self._slots = [_Slot(PluginWorker(memory_bytes, label="environment worker")) for _ in range(workers)]
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # oldest first, bounded as the workers' hosts are
        self._lock = threading.Lock()  # the pins, the slots' counts and `errors`
        self.errors = 0  # error results given, resets and steps together
        # JSON writes a character as at most 12 bytes; each message adds its frame and truncation marker
        per_message = 12 * max_message_chars + 128
        self._answer_bytes = ANSWER_BASE_BYTES + environment_host.MAX_MESSAGES * per_message
        try:
            for slot in self._slots:
                self._warm_up(slot, check_args=slot is self._slots[0])
        except BaseException:
            self.close()
            raise

    def _warm_up(self, slot: _Slot, check_args: bool = False) -> None:
        """Import the class in the slot's worker (started now if need be); ValueError naming the field."""
        checks = [("class", None), ("args", self.args)] if check_args else [("class", None)]
        for what, args in checks:  # the class first: args cannot be checked against a missing class
            request = {"op": "env_check", "path": self.path, "args": args}
            try:
                slot.worker.request(request, "result", dict, START_TIMEOUT_S, self._answer_bytes)
            except (PluginError, PluginTimeout) as e:
                raise ValueError(f"spec.environment.{what}: {e}") from None
        slot.warm = slot.worker.killed

    def reset(self, episode_id: str, row: Any) -> StepResult:
        """Start an episode on the least busy worker: its opening messages, or an error result (done)."""
        with self._lock:
            if episode_id in self._pins:
                return self._failed(f"episode {episode_id!r} is already live")
            slot = min(self._slots, key=lambda s: s.pinned)
            slot.pinned += 1  # held now, so resets running side by side spread out
        request = {"op": "env_reset", "path": self.path, "args": self.args, "episode": episode_id, "row": row}
        with slot.lock:
            try:
                if slot.warm != slot.worker.killed:  # a fresh worker: its import is not the reset's time
                    self._warm_up(slot)
                answer: dict[str, Any] | str = self._call(slot, request, "reset", episode_id)
            except ValueError as e:
                answer = str(e)
            generation = slot.worker.killed
        with self._lock:
            if isinstance(answer, str):
                slot.pinned -= 1
                return self._failed(answer)
            self._pins[episode_id] = _Pin(slot, generation)
            while len(self._pins) > environment_host.MAX_LIVE_EPISODES * len(self._slots):
                self._unpin(next(iter(self._pins)))  # a caller that never closes: its worker evicts these too
        return StepResult(answer["messages"], None, False)

    def step(self, episode_id: str, messages: list[dict[str, Any]]) -> StepResult:
        """The environment's answer to the conversation so far; an error result (done) for any failure."""
        with self._lock:
            pin = self._pins.get(episode_id)
            if pin is None:
                return self._failed(f"no live episode {episode_id!r}: never reset, already done, or closed")
        try:
            json.dumps(messages)  # checked here: a request that cannot be sent would leave the instance live
        except (TypeError, ValueError, RecursionError) as e:
            self.close(episode_id)
            with self._lock:
                return self._failed(f"TypeError: the step() messages are not JSON: {e}")
        request = {"op": "env_step", "episode": episode_id, "messages": messages}
        with pin.slot.lock:
            if pin.slot.worker.killed != pin.generation:
                answer: dict[str, Any] | str = (
                    f"episode {episode_id!r} lost its environment: its worker was killed "
                    f"({pin.slot.lost_because})"
                )
            else:
                answer = self._call(pin.slot, request, "step", episode_id)
        with self._lock:
            if isinstance(answer, str) or answer["done"]:
                self._unpin(episode_id)
            if isinstance(answer, str):
                return self._failed(answer)
        return StepResult(answer["messages"], answer["reward"], answer["done"])

    def close(self, episode_id: str | None = None) -> None:
        """End one episode early (its instance is dropped); with no id, every episode, and the workers."""
        if episode_id is None:
            for slot in self._slots:
                slot.worker.kill()
            with self._lock:
                for episode in list(self._pins):
                    self._unpin(episode)
            return
        with self._lock:
            pin = self._unpin(episode_id)
        if pin is not None:
            with pin.slot.lock:
                if pin.slot.worker.killed == pin.generation:
                    self._call(pin.slot, {"op": "env_close", "episode": episode_id}, "close", episode_id)

    def _call(self, slot: _Slot, request: dict[str, Any], what: str, episode_id: str) -> dict[str, Any] | str:
        """The worker's answer or an error text; a timeout or crash records why the slot lost its episodes."""
        killed = slot.worker.killed
        try:
            answer = slot.worker.request(
                request | {"max_chars": self.max_message_chars},
                "result",
                dict,
                self.timeout,
                self._answer_bytes,
            )
        except PluginTimeout:
            answer = f"TimeoutError: environment {what}() took longer than {self.timeout:g}s; worker killed"
        except PluginError as e:
            answer = str(e)
        except (TypeError, ValueError, RecursionError) as e:  # raised before sending: a row that is not JSON
            answer = f"TypeError: the {what}() arguments are not JSON: {e}"
        if slot.worker.killed != killed:  # a failed call killed it, or this call found it dead
            failed = f"{what}() of episode {episode_id!r} failed: {answer}"
            slot.lost_because = (
                failed[:MAX_ERROR_CHARS] if isinstance(answer, str) else "it died between calls"
            )
        return answer

    def _unpin(self, episode_id: str) -> _Pin | None:
        pin = self._pins.pop(episode_id, None)
        if pin is not None:
            pin.slot.pinned -= 1
        return pin

    def _failed(self, error: str) -> StepResult:
        self.errors += 1  # callers hold self._lock
        return StepResult([], None, True, error)
