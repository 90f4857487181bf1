"""Local processes standing in for pods: spawn, log, watch and stop one process group each.

Used by `grpo_operator.local.supervisor`. Each pod's command runs in its own session (so
its process group holds the launcher and every rank it forks); stopping a pod signals the
whole group, so a trainer launcher that dies never leaves ranks behind. Output goes to a
log file per pod, whose tail is quoted when the pod fails.
"""

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
ATTEMPT_HEADER = "===== "
# The last line of a Python traceback ("pkg.SomeError: why"), possibly behind torch's "[rank0]:".
_EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Exit)\b(:|$)")
_ERROR_LINE = re.compile(r"error\b", re.IGNORECASE)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the runtime itself is killed (Linux only).

    Ctrl-C and SIGTERM are handled by the supervisor; this covers a runtime killed with
    SIGKILL, which would otherwise leave the launchers (and their ranks) running.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class PodCommand:
    """What one local pod runs: the rendered container command with local env."""

    role: str  # "rollout" or "trainer"
    index: int  # StatefulSet pod index
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    grace_s: float = 10.0  # the pod's terminationGracePeriodSeconds (bounded locally)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass
class PodProcess:
    """One running (or finished) incarnation of a pod, with its log file."""

    command: PodCommand
    log_path: Path
    popen: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, command: PodCommand, log_dir: Path, attempt: int) -> "PodProcess":
        """Spawn the pod's command in a new session, appending its output to the pod's log."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{command.name}.log"
        with open(log_path, "ab") as log:
            log.write(
                f"{ATTEMPT_HEADER}{command.name} attempt {attempt}: {' '.join(command.argv)}\n".encode()
            )
            log.flush()
            popen = subprocess.Popen(
                command.argv,
                env=command.env,
                cwd=command.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return cls(command=command, log_path=log_path, popen=popen)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the pod's whole process group (ranks included), if any member is left."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def group_alive(self) -> bool:
        """True while any process of the pod's group exists (the launcher may be gone, ranks not)."""
        self.popen.poll()  # reap the leader so it does not linger as a zombie
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of this pod's log (all attempts share one file)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def why(self) -> str:
        """Why the latest attempt ended, from its log: its last line and its first error.

        The last line is usually the launcher's verdict ("rank 1 exited with code -9"); the
        first error is usually the cause, not the peers' echo ("connection reset by peer")
        that follows it. Both are quoted when they differ.
        """
        attempt = self.log_tail(400).rsplit(ATTEMPT_HEADER, 1)[-1].splitlines()[1:]
        lines = [ln.strip() for ln in attempt if ln.strip()]
        if not lines:
            return "(no output)"
        first = next((ln for p in (_EXCEPTION_LINE, _ERROR_LINE) for ln in lines if p.search(ln)), lines[-1])
        return lines[-1] if first == lines[-1] else f"{lines[-1]} (first error in its log: {first})"


def stop_all(procs: list[PodProcess], grace_s: float | None = None) -> None:
    """SIGTERM every pod's group, wait for them to drain (each pod's grace period, or `grace_s`),
    then SIGKILL what is left, as a kubelet would."""
    for p in procs:
        p.signal_group(signal.SIGTERM)
    longest = max((p.command.grace_s for p in procs), default=0.0)
    deadline = time.monotonic() + (longest if grace_s is None else grace_s)
    while time.monotonic() < deadline and any(p.group_alive() for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.group_alive():
            p.signal_group(signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=5)
