"""The CLI surface against hostile and careless input: names shown as text (never markup, control characters
escaped), flags bounded, every failure one line with the run marked failed, a second Ctrl-C harmless, a file size
limit reached while a trace is written, files written with the umask's permissions.

The fuzz tests are derandomized and kept to a few hundred examples, each a few milliseconds."""

import gzip
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from cli_lines import error_line
from rich.console import Console

from optiq import report
from optiq.cli import cli
from optiq.commands import common
from optiq.commands.views import fusion_summary, results_table, rich_table
from optiq.errors import OptiqError
from optiq.record import Row, from_json
from optiq.rundir import RunDir, write_json
from optiq.text import SHOWN_CHARS, visible

DATA = Path(__file__).parent / "data"
FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=200,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Terminal syntax a trace or a recipe could carry: rich markup, an emoji code, SGR colour, a screen clear, OSC 0 (the
# window title), OSC 8 (a hyperlink), OSC 52 (the clipboard), C1 CSI, a bidi override, a newline forging a line.
HOSTILE = ["[/foo]", "gemm[bs=4]", "[bold red]x[/]", ":cat:", "\x1b[31mred\x1b[0m", "\x1b[2J", "\x1b]0;owned\x07",
           "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "\x1b]52;c;ZWNobyBvd25lZA==\x07", "\x9b31m", "\u202eevil",
           "a\nfake: line", "tab\there", "bell\x07", "nul\x00", "\ud800lone"]
FAST = ["--model", "tiny-llama", "--prompt-len", "8", "--new-tokens", "2", "--max-len", "16", "--repeats", "1"]


def invoke(*args, **env):
    return CliRunner(env=env or None).invoke(cli, [str(a) for a in args])


def assert_one_line_error(result, code=1):
    """The error is one line, the last; before it stderr (no terminal under CliRunner) holds progress lines only."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    line = error_line(result.stderr)
    assert "Traceback" not in result.output and not isinstance(result.exception, (OptiqError, ValueError))
    return line


def shown(renderable, width: int = 100_000) -> str:
    """What the commands' consoles print for ``renderable``: ``common.out``'s settings, on a wide line."""
    console = Console(file=io.StringIO(), width=width, markup=False, emoji=False, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def assert_terminal_safe(text: str) -> None:
    """Nothing in ``text`` a terminal would act on: no control character but the newline, no bidi override."""
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 or 0x202A <= ord(c) <= 0x202E
           or 0xD800 <= ord(c) < 0xE000]
    assert not bad, bad


# --- visible -------------------------------------------------------------------------------------------------------

def test_visible_escapes_what_a_terminal_acts_on_and_keeps_the_rest():
    assert visible("\x1b[31mred\x1b]0;t\x07") == "\\x1b[31mred\\x1b]0;t\\x07"
    assert visible("a\nb\tc\rd\x00\x7f\x9b") == "a\\nb\\tc\\rd\\x00\\x7f\\x9b"
    assert visible("\u202eevil\u2066\u2028") == "\\u202eevil\\u2066\\u2028"
    assert visible("\ud800") == "\\ud800"
    for plain in ("gemm[bs=4]", "[/foo]", "void gemm<float, 128>(float*)", "注意力 ατ ✓ 🙂", ":cat:",
                  "a\\x1b"):
        assert visible(plain) == plain
    long = "k<" + "a" * 100_000
    assert visible(long) == f"{long[:SHOWN_CHARS]}… (+{len(long) - SHOWN_CHARS:,} chars)"
    assert visible(long, limit=None) == long


@FUZZ
@given(st.text(st.characters(codec=None), max_size=60))
def test_visible_output_is_terminal_safe_and_maps_each_character_alone(text):
    """Character by character: kept as it is, or replaced by its escape; so nothing else is lost or reordered."""
    out = visible(text)
    assert_terminal_safe(out)
    escapes = [visible(c) for c in text]
    assert out == "".join(escapes)
    for c, shown_as in zip(text, escapes):
        assert shown_as == c or (shown_as.startswith("\\") and shown_as.encode("ascii").decode("unicode_escape") == c)


# --- rendering -----------------------------------------------------------------------------------------------------

NAMES = st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(codec=None), max_size=40),
                  st.text(st.sampled_from("[]/\\:<>&|*`\x1b\n ab"), max_size=40),
                  st.builds(lambda n, s: s * n, st.integers(1, 3000), st.sampled_from(["[", "a", "\x1b[", "]/"])))


@FUZZ
@given(st.lists(st.lists(NAMES, min_size=3, max_size=3), min_size=1, max_size=4), NAMES)
def test_a_report_table_of_any_strings_prints_each_as_its_visible_text(rows, title):
    table = report.Table(title, ["recipe", "status", "reason"], rows, title)
    printed = shown(rich_table(table))
    assert_terminal_safe(printed)
    assert all(visible(cell) in printed for row in rows for cell in row)
    squeezed = "".join(printed.split())  # the title and caption wrap to the table's width
    assert "".join(visible(title).split()) in squeezed


@FUZZ
@given(st.lists(st.tuples(NAMES, st.sampled_from(["ok", "oom", "failed", "[/x]", "\x1b[5m"])), min_size=1,
                max_size=4))
def test_a_results_table_of_any_variant_and_status_prints_them_as_text(points):
    rows = [Row(variant, "eager", 1, status, tok_per_s=10.0, ms_per_step=1.0, prefill_ms=1.0, warmup_s=0.1,
                floor_ms_per_step=0.5, pct_of_floor=50.0) for variant, status in points]
    printed = shown(results_table(rows, "\x1b[2J[/title]"))
    assert_terminal_safe(printed)
    assert "\\x1b[2J[/title]" in printed
    assert all(visible(variant) in printed for variant, _ in points)


def hostile_record():
    from test_report import h200_report

    doc = h200_report()
    doc["model"] = "/ckpt/[/foo]\x1b]0;t\x07"
    fusion = doc["fusion"]
    fusion["gate"]["recipes"]["rope"]["reason"] = "RuntimeError: miss in [/cache] \x1b[31m<script>alert(1)</script>"
    fusion["not_applicable"] = {"gate_up_swiglu": "no [bold]site[/bold]\nforged: line"}
    label = "</script><script>alert(2)</script><b>gemm[bs=4]</b>"
    doc["attribution_before"]["1"]["table"][0]["label"] = label
    doc["attribution_after"]["1"]["table"][0]["label"] = label
    return from_json(doc)


def test_a_kernel_error_with_markup_prints_in_the_gate_table_and_summary_as_is():
    """The rejection apply-fusion prints before its exit 3: a reason holding `[/cache]` used to raise MarkupError."""
    record = hostile_record()
    printed = shown(rich_table(report.gate_table(record))) + shown(fusion_summary(record))
    assert_terminal_safe(printed)
    assert "RuntimeError: miss in [/cache] \\x1b[31m<script>" in printed and "no [bold]site[/bold]\\nforged" in printed
    assert printed.count("[/cache]") == 2  # the table's reason and the summary's


def test_the_markdown_and_html_report_show_hostile_names_escaped(tmp_path):
    written = report.write_report(tmp_path, hostile_record())
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert written.note is None
    assert_terminal_safe(md)
    assert "miss in \\[/cache\\] \\\\x1b\\[31m\\<script>alert(1)\\</script>" in md  # renders as the text itself
    assert "no \\[bold\\]site\\[/bold\\]\\\\nforged: line" in md and "\nforged" not in md
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # plotly.js reads tags in legend names: the op class reaches it escaped, and its JSON escapes "<" on top.
    assert '"name":"&lt;\\u002fscript&gt;&lt;script&gt;alert(2)&lt;\\u002fscript&gt;&lt;b&gt;gemm[bs=4]' in page


def hostile_trace(path: Path) -> Path:
    """The real eager GPU trace with its kernels and one role renamed to terminal syntax."""
    doc = json.loads(gzip.decompress((DATA / "gpu_eager.json.gz").read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    for i, event in enumerate(kernels):
        event["name"] = HOSTILE[i % len(HOSTILE)] + event["name"]
    for event in doc["traceEvents"]:
        if event.get("name") == "optiq/role/attention":
            event["name"] = "optiq/role/[/role]\x1b[1m"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("by", ["kernel", "role"])
def test_analyze_shows_kernel_and_role_names_as_text(tmp_path, by):
    """Every row's label (as --json has it) begins its table row as its visible text: `[/foo]` no longer crashes
    the table, `gemm[bs=4]` keeps its brackets, escapes reach no terminal."""
    trace = hostile_trace(tmp_path / "t.json")
    result = invoke("analyze", trace, "--by", by)
    assert result.exit_code == 0, result.output
    assert_terminal_safe(result.output)
    labels = [row["label"] for row in json.loads(invoke("analyze", trace, "--by", by, "--json").stdout)["results"][0]
              ["table"]]
    hostile = [label for label in labels if visible(label) != label or "[" in label]
    assert len(hostile) >= (8 if by == "kernel" else 1)
    for label in labels:  # its first word: a long name is cut at the table's width
        assert f"│ {visible(label)[:30].split(' ')[0]}" in result.output, label
    assert "[/role]\\x1b[1m" in result.output


def test_recipes_show_prints_a_summary_and_path_as_text(tmp_path):
    from importlib import resources

    mine = tmp_path / "[/dir]"
    mine.mkdir(parents=True)
    text = resources.files("optiq.builtin_recipes").joinpath("rmsnorm.toml").read_text()
    summary = next(line for line in text.splitlines() if line.startswith("summary = "))
    text = text.replace('name = "rmsnorm"', 'name = "shown_norm"').replace(
        summary, 'summary = "Fuses [/x] [bold]:cat: norms"')  # control characters: the loader refuses them
    (mine / "shown_norm.toml").write_text(text)
    result = invoke("recipes", "show", "shown_norm", "--recipes-dir", mine)
    assert result.exit_code == 0, result.output
    assert_terminal_safe(result.output)
    assert "Fuses [/x] [bold]:cat: norms" in result.output and "[/dir]" in result.output


def test_an_error_naming_a_hostile_path_is_one_visible_line(tmp_path):
    line = assert_one_line_error(invoke("analyze", tmp_path / "a\x1b]0;t\x07\nb[/x].json"))
    assert_terminal_safe(line)
    assert "a\\x1b]0;t\\x07\\nb[/x].json" in line


# --- flags ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "code", "message"), [
    (["--max-len", "99999999999999999999999"], 2, "'--max-len': 99999999999999999999999 is not in the range"),
    (["--prompt-len", str(2**31)], 2, "'--prompt-len'"),
    (["--new-tokens", "0"], 2, "'--new-tokens': 0 is not in the range"),
    (["--repeats", "-3"], 2, "'--repeats'"),
    (["--min-share", "nan"], 2, "nan is not a number"),
    (["--gate-steps", str(10**30)], 2, "'--gate-steps'"),
    (["--concurrency", "99999999999999999999999"], 2, "at most 2,147,483,647"),  # checked as flags are parsed
    (["--concurrency", "-1"], 2, "positive integers"),
    (["--concurrency", "1," + "9" * 5000], 2, "comma-separated list of integers"),
    (["--device", "foo"], 1, "--device must be cpu, cuda or cuda:N, not 'foo'"),
    (["--device", "meta"], 1, "not 'meta'"),
    (["--device", "cpu:3"], 1, "not 'cpu:3'"),
    (["--device", "cuda:99"], 1, "cuda"),
    (["--model", ""], 1, "--model is empty"),
    (["--model", "  "], 1, "--model is empty"),
    (["--dtype", ""], 1, "--dtype is empty"),
])
def test_bad_flag_values_fail_before_any_work(tmp_path, args, code, message):
    for command in ("bench", "apply-fusion"):
        result = invoke(command, *FAST, *args, "--runs-dir", tmp_path)
        assert result.exit_code == code and message in result.stderr, result.stderr
        if code == 1:
            assert_one_line_error(result)
        assert "Traceback" not in result.output and len(result.stderr) < 1000
        assert not any(tmp_path.iterdir())  # no run directory: nothing was measured


@pytest.mark.parametrize("value", ["abc", "-4", "1.5", "", "\u0664"])
def test_a_bad_measuring_knob_fails_before_any_work(tmp_path, monkeypatch, value):
    """OPTIQ_PREFETCH_KB is read at every kernel launch: a value that is not a whole number of KB is a one-line
    error up front, not every GEMM recipe rolled back by the gate for a ValueError inside its launch."""
    monkeypatch.setenv("OPTIQ_PREFETCH_KB", value)
    for command in ("bench", "apply-fusion"):
        result = invoke(command, *FAST, "--runs-dir", tmp_path)
        assert result.exit_code == 1 and "OPTIQ_PREFETCH_KB" in result.stderr, result.stderr
        assert_one_line_error(result)
        assert not any(tmp_path.iterdir())


def test_duplicate_concurrencies_are_measured_once_in_the_order_given(tmp_path):
    assert common.parse_concurrency("4, 1,4,2,1") == [4, 1, 2]
    result = invoke("bench", *FAST, "--concurrency", "2,1,2,1", "--json", "--runs-dir", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert [r["concurrency"] for r in json.loads(result.stdout)["before"]] == [2, 1]


FLAG_VALUES = {  # flag -> (valid values, invalid ones)
    "--concurrency": (["1", "2,1", " 3 , 3"], ["", "0", "x", "1,,-2", "1e3", str(2**31), "9" * 5000, "\x1b[1m"]),
    "--prompt-len": (["8", "1"], ["0", "-1", "8.5", str(2**63), "", "\x00"]),
    "--new-tokens": (["2"], ["0", "nan", str(10**40)]),
    "--max-len": (["1024", "2147483647"], ["0", "-5", str(2**31), "ten"]),
    "--repeats": (["1"], ["0", str(2**40)]),
    "--device": (["cpu", "cpu:0", " cpu"], ["foo", "meta", "", "cuda:99", "cpu:1", "[/x]", "mps\n"]),
    "--dtype": (["fp32"], ["fp4", "", "[/x]"]),
}


@settings(FUZZ, max_examples=150)
@given(st.sampled_from([["bench"], ["apply-fusion"], ["profile"], ["recipes", "verify"]]), st.data())
def test_fuzzed_flags_fail_as_one_line_or_usage_before_loading_a_model(tmp_path_factory, command, data):
    """Every flag value drawn valid or not; the model is one no preset names, so a run whose flags all pass stops
    at loading it: then the error is that, and otherwise it is the bad flag's, before any run directory."""
    runs = tmp_path_factory.mktemp("runs")
    measures = command[0] in ("bench", "apply-fusion")  # the commands with --new-tokens and --repeats
    flags = [f for f in FLAG_VALUES if measures or f not in ("--new-tokens", "--repeats")]
    chosen = data.draw(st.lists(st.sampled_from(flags), unique=True))
    args, all_valid = [], True
    for flag in chosen:
        valid = data.draw(st.booleans())
        args += [flag, data.draw(st.sampled_from(FLAG_VALUES[flag][0 if valid else 1]))]
        all_valid &= valid
    result = invoke(*command, "--model", "no-such-model-[/x]", *args, "--runs-dir", runs)
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception), result.exception
    assert_terminal_safe(result.stderr)
    if result.exit_code == 2:
        assert not all_valid and "Error: Invalid value" in result.stderr
    else:
        line = assert_one_line_error(result)
        assert ("no-such-model-[/x]" in line) == all_valid, line
    if not all_valid:
        assert not any(runs.iterdir())


# --- run state -----------------------------------------------------------------------------------------------------

def only_run(runs: Path) -> dict:
    (run,) = runs.iterdir()
    return json.loads((run / "run.json").read_text())


def test_an_unexpected_exception_in_a_run_is_one_line_and_marks_it_failed(tmp_path, monkeypatch):
    """A bug past every check (here: the bandwidth probe raising) still ends as one line, exit 1, the run failed
    with the exception's line; OPTIQ_TRACEBACK=1 shows the traceback instead."""
    from optiq import workflow

    def broken(device):
        raise ZeroDivisionError("division by zero in [/probe]")

    monkeypatch.setattr(workflow, "copy_bandwidth", broken)
    line = assert_one_line_error(invoke("bench", *FAST, "--concurrency", "1", "--runs-dir", tmp_path / "a"))
    assert line == ("optiq: error: unexpected ZeroDivisionError: division by zero in [/probe] (a bug in optiq; "
                    "OPTIQ_TRACEBACK=1 shows the traceback)")
    meta = only_run(tmp_path / "a")
    assert meta["status"] == "failed" and meta["error"] == "ZeroDivisionError: division by zero in [/probe]"
    shown_traceback = invoke("bench", *FAST, "--concurrency", "1", "--runs-dir", tmp_path / "b", OPTIQ_TRACEBACK="1")
    assert isinstance(shown_traceback.exception, ZeroDivisionError)
    assert only_run(tmp_path / "b")["status"] == "failed"


def test_code_calling_sys_exit_mid_run_fails_the_run_instead_of_ending_it_with_its_code(tmp_path, monkeypatch):
    """sys.exit(0) from code optiq runs (a kernel, a recipe's module) must not end the command with exit 0 and no
    report: the run is failed and the exit is 1, with what was measured before kept."""
    from optiq.measure import sweep

    real = sweep.measure_point
    calls = []

    def exits_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            sys.exit(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "measure_point", exits_on_the_second)
    result = invoke("bench", *FAST, "--concurrency", "1,2", "--runs-dir", tmp_path / "runs")
    line = assert_one_line_error(result)
    assert "sys.exit(0)" in line
    (run,) = (tmp_path / "runs").iterdir()
    assert only_run(tmp_path / "runs")["status"] == "failed"
    saved = json.loads((run / "results.json").read_text())
    assert saved["status"] == "failed" and [r["concurrency"] for r in saved["before"]] == [1]


def test_a_profile_that_fails_after_its_run_directory_marks_it_failed(tmp_path):
    line = assert_one_line_error(invoke("profile", "--model", "no-such-model", "--prompt-len", "8", "--max-len", "32",
                                        "--steps", "1", "--concurrency", "1", "--runs-dir", tmp_path / "runs"))
    meta = only_run(tmp_path / "runs")
    assert "no-such-model" in line and meta["status"] == "failed" and meta["concurrencies_done"] == 0
    assert "no-such-model" in meta["error"]


def _start(args, **kwargs):
    """A foreground job's signals: SIGINT at its default action (see test_interrupt)."""
    def child():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if "fsize" in kwargs:
            resource.setrlimit(resource.RLIMIT_FSIZE, (kwargs["fsize"], kwargs["fsize"]))

    return subprocess.Popen([sys.executable, "-m", "optiq", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=child)


@pytest.mark.parametrize(("second", "gap"), [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.05)])
def test_a_second_signal_while_stopping_changes_nothing(tmp_path, second, gap):
    """Two Ctrl-Cs (or Ctrl-C then SIGTERM) in quick succession: the second lands in the stop's cleanup, or in
    Python's shutdown after it; either way the run is marked incomplete, the exit is 130 and there is no traceback."""
    runs = tmp_path / "runs"
    proc = _start(["bench", *FAST[:2], "--concurrency", ",".join(map(str, range(1, 41))), "--prompt-len", "8",
                   "--new-tokens", "8", "--max-len", "32", "--repeats", "1", "--runs-dir", str(runs)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(runs.glob("bench-*/results.csv")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    time.sleep(gap)
    proc.send_signal(second)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    meta = only_run(runs)
    (results,) = runs.glob("bench-*/results.json")
    assert meta["status"] == "incomplete" and meta["points_done"] == len(json.loads(results.read_text())["before"])


def test_a_file_size_limit_reached_writing_a_trace_is_one_line_and_marks_the_run_failed(tmp_path):
    """ulimit -f stands in for a full disk: the profile's trace cannot be written whole. optiq ignores SIGXFSZ, so
    the write fails (EFBIG) rather than the signal killing the process with the run left running."""
    runs = tmp_path / "runs"
    proc = _start(["profile", "--model", "tiny-llama", "--concurrency", "1", "--prompt-len", "8", "--max-len", "32",
                   "--steps", "2", "--runs-dir", str(runs)], fsize=100_000)
    _, stderr = proc.communicate(timeout=120)
    errors = [line for line in stderr.splitlines() if line.startswith("optiq: error: ")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    meta = only_run(runs)
    assert meta["status"] == "failed" and meta["concurrencies_done"] == 0
    assert (next(runs.iterdir()) / "environment.json").exists()  # what was written before is kept


def test_a_file_size_limit_reached_writing_results_keeps_the_points_before(tmp_path):
    """The record grows with every point; past the limit its write fails as one line and run.json (small) still
    says failed."""
    runs = tmp_path / "runs"
    proc = _start(["bench", *FAST, "--concurrency", ",".join(map(str, range(1, 9))), "--runs-dir", str(runs)],
                  fsize=4_000)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("optiq: error: cannot write") and "File too large" in stderr
    (run,) = runs.iterdir()
    kept = json.loads((run / "results.json").read_text())["before"]
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "failed" and 1 <= len(kept) < 8 and meta["points_done"] >= len(kept)
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_written_atomically_get_the_umask_s_permissions(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        run = RunDir(tmp_path, "bench", {})
        write_json(run.path / "results.json", {"a": 1})
        write_json(run.path / "results.json", {"a": 2})  # a replaced file too
    finally:
        os.umask(previous)
    assert {p.name: p.stat().st_mode & 0o777 for p in run.path.iterdir()} == {"run.json": mode, "results.json": mode}


def test_a_checkpoint_whose_path_is_markup_loads_measures_and_shows_as_text(tmp_path):
    """The model's path reaches the spinner, the progress bar and the table's title: rich read it as markup there
    (`[/ckpt]` raised MarkupError before anything was measured)."""
    import torch

    from optiq.models import load_model

    checkpoint = tmp_path / "[/ckpt]" / "tiny:cat:[bold]"
    load_model("tiny-llama", torch.float32, torch.device("cpu")).save_pretrained(checkpoint)
    result = invoke("bench", *FAST, "--model", checkpoint, "--concurrency", "1", "--runs-dir", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    assert str(checkpoint) in "".join(result.stdout.split())  # the title, wrapped at its spaces
    assert only_run(tmp_path / "runs")["status"] == "complete"


def test_a_closed_stdout_ends_quietly(tmp_path):
    """`optiq analyze ... --json | head -c1`: the reader went away; no BrokenPipeError traceback, no message."""
    proc = subprocess.Popen([sys.executable, "-m", "optiq", "analyze", str(DATA / "gpu_eager.json.gz"), "--json",
                             "--by", "kernel"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and stderr.splitlines() == ["optiq: reading 1 trace(s)"], stderr


def test_an_os_error_no_command_caught_is_reported_as_the_file_system_said():
    import errno

    from optiq.cli import _one_line

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/trace.json")
    assert _one_line(full) == "/runs/trace.json: No space left on device (the disk or a file size limit is full)"
    assert _one_line(PermissionError(errno.EACCES, "Permission denied")) == "Permission denied"
    assert _one_line(KeyError("x")).startswith("unexpected KeyError: 'x' (a bug in optiq; OPTIQ_TRACEBACK=1")


def test_a_kernel_raising_an_error_with_markup_leaves_exit_3_and_shows_the_reason_as_text(tmp_path, monkeypatch):
    """A fused kernel that raises `... [/cache] ...`: the gate rejects its recipe with the message as the reason, and
    printing that reason in the gate's table (rich markup once: MarkupError, a traceback for exit 3) shows it."""
    from wrong_kernels import user_recipe

    (tmp_path / "raising_kernels.py").write_text(
        "def rmsnorm(x, weight, eps, offset=False, out=None):\n"
        "    raise RuntimeError('cache miss in [/cache] \\x1b[31m')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user_recipe(tmp_path / "mine", "rmsnorm", "raising_norm", fusion="raising_kernels:rmsnorm")
    result = invoke("apply-fusion", *FAST, "--concurrency", "1", "--gate-steps", "2", "--recipes", "raising_norm",
                    "--recipes-dir", tmp_path / "mine", "--runs-dir", tmp_path / "runs")
    assert result.exit_code == 3 and "Traceback" not in result.output, (result.output, result.exception)
    assert_terminal_safe(result.output)
    assert "[/cache]" in result.output and "\\x1b[31m" in result.output
    (run,) = (tmp_path / "runs").iterdir()
    reason = json.loads((run / "report.json").read_text())["fusion"]["gate"]["recipes"]["raising_norm"]["reason"]
    assert reason.endswith("RuntimeError: cache miss in [/cache] \x1b[31m")
    assert only_run(tmp_path / "runs")["status"] == "rejected"
