"""Run directories are never reused and files are replaced atomically."""

import json
import os
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
