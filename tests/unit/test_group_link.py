"""The links of a rollout server spanning pods (`grpo_rollout.group_link`), over real loopback sockets:
a worker joins its leader even when it starts first, and the leader's `failure()` names the worker
whose link closed; a stranger's connection is no member."""

import socket
import subprocess
import sys
import threading
import time

from grpo_rollout import group_link

from tests.support.ports import free_port


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise TimeoutError


def test_a_link_that_closes_is_the_groups_failure_naming_the_worker() -> None:
    links = group_link.Links(2, 0, host="127.0.0.1")
    try:
        first = group_link.join("127.0.0.1", links.port, 1, wait_s=10)
        second = group_link.join("127.0.0.1", links.port, 2, wait_s=10)
        wait(lambda: links.joined == {1, 2})
        assert links.failure() is None
        second.close()  # worker pod 2 is gone
        lost = wait(links.failure)
        assert lost.startswith("worker pod 2 of this server (127.0.0.1) is gone")
        first.close()
        time.sleep(0.1)
        assert wait(links.failure) == lost  # the first loss is the one said
    finally:
        links.close()


def test_a_worker_that_starts_before_its_leader_waits_for_it() -> None:
    port = free_port()
    joined: list[socket.socket] = []
    worker = threading.Thread(target=lambda: joined.append(group_link.join("127.0.0.1", port, 1, wait_s=30)))
    worker.start()
    time.sleep(2.5)  # the worker's first tries find nothing listening
    links = group_link.Links(1, port, host="127.0.0.1")
    try:
        worker.join(10)
        assert joined and links.joined == {1}
        assert links.failure() is None
    finally:
        joined[0].close()
        links.close()


def test_a_connection_without_the_greeting_or_with_another_index_is_no_member() -> None:
    links = group_link.Links(1, 0, host="127.0.0.1")
    try:
        for line in (b"GET / HTTP/1.1\n", b"grpo-group-link 7\n", b"grpo-group-link x\n"):
            with socket.create_connection(("127.0.0.1", links.port)) as stranger:
                stranger.sendall(line)
                assert stranger.recv(8) == b""  # closed without the ack
        time.sleep(0.1)
        assert links.joined == set() and links.failure() is None  # a stranger leaving breaks nothing
    finally:
        links.close()


def test_a_worker_exits_when_its_leader_goes() -> None:
    """Two processes, as two pods: the leader killed, the worker exits for its group's restart."""
    leader_code = (
        "import time; from grpo_rollout import group_link as g; "
        "links = g.Links(1, 0, host='127.0.0.1'); print(links.port, flush=True); time.sleep(60)"
    )
    leader = subprocess.Popen([sys.executable, "-c", leader_code], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        port = int(leader.stdout.readline())
        worker_code = (
            "import time; from grpo_rollout import group_link as g; "
            f"g.exit_with_leader(g.join('127.0.0.1', {port}, 1, wait_s=10)); "
            "print('joined', flush=True); time.sleep(60)"
        )
        worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "joined"
        leader.kill()
        assert worker.wait(timeout=20) == group_link.EXIT_LEADER_GONE
    finally:
        leader.kill()
        if worker is not None:
            worker.kill()
