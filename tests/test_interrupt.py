"""Ctrl-C (or SIGTERM, as `timeout` sends) in the middle of a real `optiq bench` sweep or `optiq profile` keeps what
was measured and marks the run incomplete."""

import json
import signal
import subprocess
import sys
import time

import pytest


def _start(args):
    """The command as a terminal's foreground job runs it: SIGINT at its default action. A job started in the
    background of a non-interactive shell inherits it ignored, and Python then installs no KeyboardInterrupt."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_mid_sweep_keeps_finished_points(tmp_path, stop):
    runs = tmp_path / "runs"
    # Many concurrencies, each a few hundred ms on the CPU: the interrupt lands mid-sweep.
    args = [sys.executable, "-m", "optiq", "bench", "--model", "tiny-llama", "--concurrency",
            ",".join(str(c) for c in range(1, 41)),
            "--prompt-len", "8", "--new-tokens", "16", "--max-len", "32", "--repeats", "2", "--runs-dir", str(runs)]
    proc = _start(args)
    deadline = time.monotonic() + 240
    results = None
    while time.monotonic() < deadline:  # wait until at least two points are on disk
        found = list(runs.glob("bench-*/results.json"))
        if found and len(json.loads(found[0].read_text())["before"]) >= 2:
            results = found[0]
            break
        time.sleep(0.05)
    assert results is not None, proc.communicate()[1]
    proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    meta = json.loads((results.parent / "run.json").read_text())
    rows = json.loads(results.read_text())["before"]
    assert meta["status"] == "incomplete" and meta["points_done"] == len(rows)
    assert 2 <= len(rows) < 40 and all(r["status"] == "ok" and r["tok_per_s"] > 0 for r in rows)
    assert [p.name for p in results.parent.iterdir() if p.name.startswith(".")] == []  # no half-written temp files
    csv_lines = (results.parent / "results.csv").read_text().strip().splitlines()
    assert len(csv_lines) == len(rows) + 1


def test_sigint_mid_profile_keeps_finished_concurrencies(tmp_path):
    runs = tmp_path / "runs"
    args = [sys.executable, "-m", "optiq", "profile", "--model", "tiny-llama", "--concurrency",
            ",".join(str(c) for c in range(1, 41)), "--prompt-len", "8", "--max-len", "32", "--steps", "2",
            "--runs-dir", str(runs)]
    proc = _start(args)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list(runs.glob("profile-*/attribution_C2.json")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    (run,) = runs.iterdir()
    meta = json.loads((run / "run.json").read_text())
    done = sorted(int(p.stem.split("_C")[1]) for p in run.glob("attribution_C*.json"))
    # the interrupt may land between a concurrency's files and its count: run.json never claims more than is on disk
    assert meta["status"] == "incomplete" and len(done) - 1 <= meta["concurrencies_done"] <= len(done)
    assert 2 <= len(done) < 40
    assert done == list(range(1, len(done) + 1))
    assert all(json.loads((run / f"attribution_C{c}.json").read_text())["concurrency"] == c for c in done)
