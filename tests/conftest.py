"""Fixtures shared by every ring.

`s3_server`: a real S3-compatible server for the session, moto's standalone server process
(the same one `hack/s3.sh up` starts) on a free loopback port. Tests talk to it over HTTP;
processes they start (trainer, rollout server, the local runtime) get `s3_server.env` in their
environment, exactly as a pod gets AWS_* from its Secret. No in-process mocks.
"""

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port

S3_KEY_ID, S3_SECRET, S3_REGION = "grpo-test", "grpo-test-secret", "us-west-2"

# The longest test files (seconds summed on this 2-core machine, 2026-12-06), handed out first:
# `make test` gives each pytest-xdist worker a file at a time in collection order, and a long file
# taken last kept one worker busy minutes after the other ran dry. The rest follow, the
# integration ring before the unit ring's many short files, which fill the end.
LONGEST_FIRST = (
    "tests/integration/test_trainer_run.py",  # 175 s
    "tests/integration/test_local_runtime.py",  # 164 s
    "tests/integration/test_checkpoint_resume.py",  # 101 s
    "tests/integration/test_vllm_engine_cpu.py",  # 76 s
    "tests/integration/test_vllm_local_job.py",  # 73 s
    "tests/integration/test_local_runtime_failures.py",  # 59 s
)
ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gone = [f for f in LONGEST_FIRST if not (ROOT / f).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are gone: {gone}")

    def turn(item: pytest.Item) -> int:
        where = item.path.relative_to(ROOT).as_posix()
        if where in LONGEST_FIRST:
            return LONGEST_FIRST.index(where)
        return len(LONGEST_FIRST) + (1 if where.startswith("tests/unit/") else 0)

    items.sort(key=turn)  # stable: each file's tests keep their order


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
    except urllib.error.HTTPError:
        return True  # any HTTP answer means it serves
    except OSError:
        return False
    return True


@dataclass
class S3Server:
    """A running S3-compatible server: its endpoint, the AWS_* env that reaches it, buckets."""

    endpoint_url: str
    env: dict[str, str]
    buckets: list[str] = field(default_factory=list)

    def fs(self) -> Any:
        """An s3fs filesystem on this server (a fresh instance, no fsspec instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=S3_KEY_ID,
            secret=S3_SECRET,
            client_kwargs={"endpoint_url": self.endpoint_url, "region_name": S3_REGION},
            skip_instance_cache=True,
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (once per session) and return 's3://name'."""
        if name not in self.buckets:
            self.fs().mkdir(name)
            self.buckets.append(name)
        return f"s3://{name}"

    @contextlib.contextmanager
    def environ(self) -> Iterator[None]:
        """This process's os.environ pointed at the server for a block (for in-process clients)."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("s3-server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto's S3 server did not start:\n{Path(log).read_text(errors='replace')}")
            time.sleep(0.1)
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": S3_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_REGION": S3_REGION,
        }
        yield S3Server(endpoint_url=endpoint, env=env)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
