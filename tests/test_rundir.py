"""Run directories are never reused and files are replaced atomically."""

import errno
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from optiq.rundir import RunDir, write_json


def test_same_second_runs_get_distinct_directories(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda _: RunDir(tmp_path, "bench", {}), range(16)))
    assert len({run.path for run in runs}) == 16
    assert all(json.loads((run.path / "run.json").read_text())["status"] == "running" for run in runs)


def test_finish_records_status(tmp_path):
    run = RunDir(tmp_path, "bench", {"model": "m"})
    run.finish("incomplete", points_done=2)
    meta = json.loads((run.path / "run.json").read_text())
    assert meta["status"] == "incomplete" and meta["points_done"] == 2 and meta["args"] == {"model": "m"}


def test_write_json_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "results.json"
    write_json(target, {"a": 1})
    write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_full_disk_mid_sweep_is_one_line_and_keeps_what_was_written(tmp_path, monkeypatch):
    """The disk fills while the second point's results.json is written: exit 1 with one line, the first point still
    on disk, no temporary file left behind."""
    from cli_lines import error_line
    from click.testing import CliRunner

    from optiq import rundir
    from optiq.cli import cli

    results_syncs = []
    real_fsync = os.fsync

    def filling_fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".results.json."):
            results_syncs.append(fd)
            if len(results_syncs) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(rundir.os, "fsync", filling_fsync)
    result = CliRunner().invoke(cli, ["bench", "--model", "tiny-llama", "--concurrency", "1,2", "--prompt-len", "8",
                                      "--new-tokens", "2", "--max-len", "16", "--repeats", "1",
                                      "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    line = error_line(result.stderr)
    assert line.startswith("optiq: error: cannot write") and "No space left on device" in line
    (run,) = (tmp_path / "runs").iterdir()
    assert [r["concurrency"] for r in json.loads((run / "results.json").read_text())["before"]] == [1]
    assert sorted(p.name for p in run.iterdir()) == ["results.csv", "results.json", "run.json"]


def test_two_processes_at_once_write_separate_run_directories(tmp_path):
    args = [sys.executable, "-m", "optiq", "bench", "--model", "tiny-llama", "--concurrency", "1,2",
            "--prompt-len", "8", "--new-tokens", "2", "--max-len", "16", "--repeats", "1", "--json",
            "--runs-dir", str(tmp_path / "runs")]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    dirs = {json.loads(out)["run_dir"] for out, _ in outputs}
    assert len(dirs) == 2 and len(list((tmp_path / "runs").iterdir())) == 2
    for run in (tmp_path / "runs").iterdir():
        assert json.loads((run / "run.json").read_text())["status"] == "complete"
        assert [r["concurrency"] for r in json.loads((run / "results.json").read_text())["before"]] == [1, 2]
