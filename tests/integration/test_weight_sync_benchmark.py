"""`benchmarks/weight_sync.py` run small (4 MiB: both transports, the senders sweep at 1, the held
leg at 2 members) finishes and writes every leg's rows; a process of the benchmark that dies fails
the run at once, naming it (the benchmark once failed in its http leg and then hung with its servers
idle), and a trainer rank whose part is done stays until the controller ends it (issue 47: the
default run's rank 1 returned early, the controller took that for a death and killed the servers
under rank 0's last http version). Nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/weight_sync.py"


def _bench():  # the script as a module (benchmarks/ is not a package)
    spec = importlib.util.spec_from_file_location("weight_sync_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_small_run_of_every_leg_writes_every_row(tmp_path: Path) -> None:
    """Every leg of the default run, at the smallest payload: the collective and http rows, the sweep
    (one server fed by one trainer rank) and the held leg (real servers keeping one EP rank's experts
    each). The http leg's versions follow the streamed ones at the same servers."""
    out = tmp_path / "sync.json"
    argv = [sys.executable, str(SCRIPT), "--model-mib", "4", "--bucket-mib", "1", "--repeats", "1"]
    argv += ["--sweep", "1", "--sweep-mib", "4", "--sweep-bucket-mib", "1", "--held-servers", "2"]
    done = subprocess.run([*argv, "--json", str(out)], cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["transport"] for r in rows] == ["collective (gloo)", "http", "sweep", "held", "held"]
    for row in rows[:2]:
        assert row["model_bytes"] == 4 << 20 and row["bucket_bytes"] == 1 << 20
        assert row["seconds"] > 0 and row["link_gb_per_s"] > 0
    assert len(rows[0]["all_seconds"]) == 1  # --repeats
    sweep = rows[2]  # one server fed by one trainer rank
    assert sweep["senders"] == 1 and sweep["model_bytes"] == 4 << 20
    assert 1.0 <= sweep["received_over_held"] < 1.01  # the whole model, and the control blocks
    assert 0 < sweep["rank_peak_bytes"] <= 2 * sweep["bucket_bytes"]
    assert sweep["member_extra_bytes"] > 0 and sweep["member_reserve_planned"] > 0
    assert [r["experts"] for r in rows[3:]] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # vLLM's linear placement
    for row in rows[3:]:
        assert 1.0 <= row["received_over_held"] <= 1.01  # its experts and the dense part, once
        assert row["whole_over_held"] > 1.5  # what it took before: the whole model


def test_http_versions_come_after_the_streamed_ones() -> None:
    bench = _bench()
    for repeats in (1, 5):
        assert min(bench.http_versions(repeats)) > max(bench.stream_versions(repeats))


def test_a_dead_process_fails_the_wait_at_once_naming_it() -> None:
    import torch.distributed as dist

    bench = _bench()
    port = bench.free_port()
    ctl = bench.store(port, master=True)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(bench.BenchmarkFailed, match="trainer rank 1 exited with status 3"):
            bench.await_count(ctl, "never-reached", 2, {"server 0": alive, "trainer rank 1": dead})
        assert time.monotonic() - t0 < 30  # not the store's or the groups' 600 s timeouts
        ctl.add("counted", 2)
        bench.await_count(ctl, "counted", 2, {"server 0": alive})  # reached: returns
        ctl.set("result-0", "{}")
        bench.await_count(ctl, "result-0", None, {"server 0": alive})
    finally:
        alive.kill()
        alive.wait()
        dead.wait()
    assert isinstance(ctl, dist.TCPStore)


@pytest.mark.slow
def test_a_rank_whose_part_is_done_stays_until_the_controller_ends_it() -> None:
    """A trainer rank's process (its part stubbed: say so in the store) then waits for the
    controller, which counts any exit as a failure; once the controller is gone, it leaves too.
    Every rank role goes through the same dispatch (`RANK_ROLES`); the http leg's `rank` is run."""
    bench = _bench()
    port = bench.free_port()
    ctl = bench.store(port, master=True)
    child = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bench', {str(SCRIPT)!r})\n"
        "bench = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(bench)\n"
        "bench.RANK_ROLES['rank'] = lambda index, args: bench.store(args.store_port).set('done', '1')\n"
        f"sys.exit(bench.main(['--role', 'rank', '--store-port', '{port}']))\n"
    )
    procs = {"trainer rank 1": subprocess.Popen([sys.executable, "-c", child])}
    try:
        bench.await_count(ctl, "done", None, procs)  # its part is done
        time.sleep(3)  # a rank that returned would have exited by now
        bench.check_alive(procs)
        del ctl  # the controller leaves
        assert procs["trainer rank 1"].wait(timeout=30) == 0
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
