"""Run directories: one per command invocation, never reused, every file written atomically.

A run directory holds ``run.json`` (what was asked, when, and whether it finished) and the command's results. Results
are written as they are produced, so an interrupted or crashed run keeps everything measured before the interruption.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
from pathlib import Path

import pandas as pd

from optiq.errors import OptiqError


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers never see half a file.

    A write the file system refuses (full disk, quota, read-only, permissions) is a one-line OptiqError; the previous
    version of ``path``, and every other file already written, stays as it was. The file gets the permissions any
    new file gets (0666 less the umask, as the traces torch writes), not the 0600 of a private temporary file."""
    path = Path(path)
    # Text is UTF-8 whatever the locale; a lone surrogate (a trace may hold one, escaped in its JSON) is written as
    # its escape rather than failing the write.
    mode = dict(mode="wb") if isinstance(data, bytes) else dict(mode="w", encoding="utf-8", errors="backslashreplace")
    tmp = None
    try:
        fd, tmp = _create_temporary(path)
        with os.fdopen(fd, **mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OptiqError(f"cannot write {path}: {exc.strerror or exc}; files written before are intact") from None
        raise


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new, exclusively created file beside ``path`` (so the rename stays on one file system), open for writing."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), str(tmp)
        except FileExistsError:
            continue


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    write_atomic(path, pd.DataFrame(rows).to_csv(index=False))


class RunDir:
    """A fresh directory ``<root>/<command>-<timestamp>[-N]`` whose ``run.json`` tracks completion."""

    def __init__(self, root: Path | str, command: str, args: dict):
        root = Path(root)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.path = self._claim(root, f"{command}-{stamp}")
        except OSError as exc:
            raise OptiqError(f"cannot create a run directory under {root}: {exc.strerror or exc}") from None
        self.meta = {"command": command, "args": args, "started": _dt.datetime.now().isoformat(), "status": "running"}
        self._write_meta()

    @staticmethod
    def _claim(root: Path, base: str) -> Path:
        """Create the directory with mkdir's atomicity: two processes started in the same second get two directories."""
        for n in range(10_000):
            path = root / (base if n == 0 else f"{base}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
        raise OSError(f"could not create a run directory under {root}")

    def _write_meta(self) -> None:
        write_json(self.path / "run.json", self.meta)

    def finish(self, status: str = "complete", **extra) -> None:
        """Record how the run ended: ``complete``, ``incomplete`` (interrupted) or ``failed``."""
        self.meta.update(status=status, finished=_dt.datetime.now().isoformat(), **extra)
        self._write_meta()
