"""Loopback ports for the servers and process groups the tests start."""

import os
import random
import socket

_PORTS_PER_WORKER = 1500
_next_port: list[int] = []


def free_port() -> int:
    """A loopback port nobody listens on, for a process the test starts next.

    Not the kernel's pick: bind(0) hands out ephemeral ports, which any outgoing connection (or
    a concurrent test session's `free_port()`) can take before our process binds it. The ports
    come from a block below the ephemeral range (32768 on Linux), walked from a random start;
    each pytest process that runs beside another has its own block: `GRPO_TEST_PORT_BLOCK` plus
    its pytest-xdist worker's number (hack/test.sh: the unit + integration workers in blocks 0 and
    1, the e2e ring in block 5)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    block = int(os.environ.get("GRPO_TEST_PORT_BLOCK") or 0) + int(worker or 0)
    first = 17000 + (block % 10) * _PORTS_PER_WORKER
    if not _next_port:
        _next_port.append(random.randrange(_PORTS_PER_WORKER))
    for _ in range(_PORTS_PER_WORKER):
        port = first + _next_port[0] % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {first}..{first + _PORTS_PER_WORKER - 1}")
