"""A trainer rank's relay buffers are kept from one weight version to the next.

On CPU a bucket buffer larger than glibc's mmap threshold (32 MiB at most) is fresh memory every
time it is allocated: its first fill costs a page fault per 4 KiB page, 35 ms per 64 MiB measured,
four times the fp32 to bf16 conversion into it, and that cost sat between the wire and the next
bucket. Measured in the sending thread of a sender process (RUSAGE_THREAD).
"""

import json
import subprocess
import sys

import pytest
import torch
from grpo_wire import weight_stream

from tests.support.ports import free_port

BUCKET = 40 << 20  # above glibc's largest mmap threshold, as the 64 to 256 MiB buckets in use

# In a process of its own: a pytest worker that ran other tests first has heap pages to reuse
# (measured: 8 faults for the first version's 80 MiB after the integration ring's files).
SENDER = """
import json, resource, sys
import torch
from grpo_trainer.weight_sync import StreamSender

port, bucket = int(sys.argv[1]), int(sys.argv[2])
state = [torch.ones(10 << 20, dtype=torch.bfloat16) for _ in range(4)]  # 80 MiB: two buckets
sender = StreamSender("127.0.0.1", port, 0, timeout_s=60)
send = dict(epoch=1, members=1, backend="gloo", dtype=torch.bfloat16, bucket_bytes=bucket)
faults, stats = [], []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    stats.append(sender.send(iter((f"w{i}", 0, t) for i, t in enumerate(state)), **send,
                             device=torch.device("cpu")))
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
print(json.dumps({"faults": faults, "buckets": [s.buckets for s in stats],
                  "peak": [s.peak_bytes for s in stats]}))
"""


@pytest.mark.slow
def test_a_second_version_fills_the_first_versions_buffers_instead_of_fresh_memory():
    port = free_port()
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(port), str(BUCKET)], stdout=subprocess.PIPE, text=True
    )
    link = weight_stream.ReceiverLink()
    groups = link.groups_for(
        epoch=1, host="127.0.0.1", port=port, backend="gloo", feeders=1, members=1, member=0, timeout_s=60
    )
    received = [weight_stream.receive_all(groups, torch.device("cpu"), lambda bucket: None) for _ in range(2)]
    out, _ = sender.communicate(timeout=120)
    assert sender.returncode == 0
    m = json.loads(out)
    faults = m["faults"]
    assert received == [(80 << 20) + 4 * weight_stream.ALIGN] * 2  # and a control block a round
    assert m["buckets"] == [4, 4]  # a round carries half a bucket
    # the first version touches its buffers, and the measure sees it where this thread writes: the
    # half-bucket it converts its chunks into (gloo's threads fill the forwarding ones; this kernel
    # maps 8 KiB per fault, at least one per 16 KiB is required)
    assert faults[0] >= BUCKET // 2 // (16 << 10), faults
    assert faults[1] < faults[0] // 8, faults
    assert all(p <= 2 * BUCKET for p in m["peak"])  # still two buckets at most
