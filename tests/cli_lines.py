"""What a failed command leaves on stderr: progress lines (``optiq: ...``, one per step when stderr is no terminal),
then its one error line, last."""


def error_line(stderr: str) -> str:
    """The one ``optiq: error:`` line, asserted to be the last and to follow progress lines only."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("optiq: error: "), stderr[-2000:]
    assert all(line.startswith("optiq: ") and not line.startswith("optiq: error: ") for line in lines[:-1]), \
        stderr[-2000:]
    return lines[-1]
