"""A trainer rank's bucket buffers are kept from one weight version to the next.

On CPU a bucket buffer larger than glibc's mmap threshold (32 MiB at most) is fresh memory every
time it is allocated: its first fill costs a page fault per 4 KiB page, 35 ms per 64 MiB measured,
four times the fp32 to bf16 conversion into it, and that cost sat between the wire and the next
bucket. Measured in the sending thread (RUSAGE_THREAD: the receiver's faults are its own).
"""

import resource
import threading

import pytest
import torch
from grpo_rollout import weight_stream
from grpo_trainer.weight_sync import StreamSender

from tests.support.ports import free_port

BUCKET = 40 << 20  # above glibc's largest mmap threshold, as the 64 to 256 MiB buckets in use


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.slow
def test_a_second_version_fills_the_first_versions_buffers_instead_of_fresh_memory():
    port = free_port()
    state = [torch.ones(10 << 20, dtype=torch.bfloat16) for _ in range(4)]  # 80 MiB: two buckets
    sender = StreamSender("127.0.0.1", port, 0, timeout_s=60)
    received: list[int] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            link = weight_stream.ReceiverLink()
            groups = link.groups_for(
                epoch=1, host="127.0.0.1", port=port, backend="gloo", senders=1, members=1, member=0,
                timeout_s=60,
            )  # fmt: skip
            for _ in range(2):
                received.append(weight_stream.receive_all(groups, torch.device("cpu"), lambda bucket: None))
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    send = dict(epoch=1, servers=1, backend="gloo", dtype=torch.bfloat16, bucket_bytes=BUCKET)
    faults, stats = [], []
    for _ in range(2):
        before = _faults()
        items = iter((f"w{i}", 0, t) for i, t in enumerate(state))
        stats.append(sender.send(items, **send, device=torch.device("cpu")))
        faults.append(_faults() - before)
    thread.join(60)
    assert not errors and received == [80 << 20] * 2
    assert [s.buckets for s in stats] == [2, 2]
    # the first version touches its two buffers, and the measure sees it (this kernel maps 8 KiB per
    # fault; at least one per 16 KiB is required)
    assert faults[0] >= 2 * BUCKET // (16 << 10), faults
    assert faults[1] < faults[0] // 8, faults
    assert all(s.peak_bytes <= 2 * BUCKET + 64 * 1024 for s in stats)  # still two buckets at most
