"""What every command shares: the consoles, the options, parsing them, progress, JSON output, and how a run ends.
Commands import this module and ``views``, never one another."""

from __future__ import annotations

import json
import math
import os
import sys

from contextlib import contextmanager, suppress
from typing import Callable

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from optiq.errors import EXIT_GATE_REJECTED_ALL, EXIT_INTERRUPTED, OptiqError, first_line
from optiq.text import visible

# Tables go to stdout, progress and notes to stderr, so ``--json`` output stays one clean document.
# Piped output keeps whole table rows instead of rich's 80-column default. Neither console reads markup or emoji
# codes: what they print holds names from traces, recipes and paths (`[/foo]`, `gemm[bs=4]`, `:cat:`), shown as
# they are; what could still reach the terminal raw, its control characters, goes through ``visible`` first.
out = Console(width=None if sys.stdout.isatty() else 160, markup=False, emoji=False)
err = Console(stderr=True, markup=False, emoji=False, soft_wrap=True)  # a note stays one line, however long

# The largest value a size flag takes (a 32-bit signed int): far beyond any batch or KV cache a device holds, so a
# real request is never refused. Past it a value reaches the C integers of torch's shapes and the kernels' offsets,
# where one of a few dozen digits overflows with a traceback instead of failing as one line.
MAX_SIZE = 2**31 - 1
SIZE = click.IntRange(1, MAX_SIZE)  # the type of --prompt-len, --new-tokens, --max-len, --steps, --repeats, ...


def parse_concurrency(text: str) -> list[int]:
    """The batch sizes of a comma-separated list, each once, in the order first given."""
    shown = visible(text, limit=60)
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptiqError(f"must be a comma-separated list of integers, not '{shown}'") from None
    if not values or min(values) < 1:
        raise OptiqError(f"needs positive integers, got '{shown}'")
    if max(values) > MAX_SIZE:
        raise OptiqError(f"values must be at most {MAX_SIZE:,}, got '{shown}'")
    return list(dict.fromkeys(values))


class ConcurrencyList(click.ParamType):
    """--concurrency's type: checked as the command line is parsed, so a bad list is a usage error (exit 2) before
    torch is imported (seconds); the command gets the text and parses it with the device's default."""
    name = "C,C,..."

    def convert(self, value, param, ctx):
        try:
            parse_concurrency(value)
        except OptiqError as exc:
            self.fail(str(exc), param, ctx)
        return value


CONCURRENCY = ConcurrencyList()


def resolve_device_and_mode(device: str | None, mode: str | None):
    """The torch device (default: CUDA when present) and engine mode (default: graph on CUDA, eager elsewhere)."""
    import torch

    resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else _device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise OptiqError("--device cuda asked for, but this machine has no CUDA device")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise OptiqError(f"--device {visible(device)}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if resolved.type == "cpu":
        # Triton compiles only for GPUs; on the CPU the fusions run under its interpreter, which must be chosen
        # before triton is first imported (transformers' masking and modeling utilities import it): call this first.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    prefetch = os.environ.get("OPTIQ_PREFETCH_KB")
    if prefetch is not None and not (prefetch.isascii() and prefetch.isdigit()):
        # read at every kernel launch: a bad value would fail each fused kernel, and the gate roll them all back
        raise OptiqError(f"OPTIQ_PREFETCH_KB={visible(prefetch)} is not a whole number of KB (0 turns the prefetch "
                         f"off)")
    mode = mode or ("graph" if resolved.type == "cuda" else "eager")
    if mode == "graph" and resolved.type != "cuda":
        raise OptiqError("--mode graph needs a CUDA device; use --mode eager on the CPU")
    return resolved, mode


def _device(text: str):
    """``--device``: the CPU or a CUDA device, the two optiq measures on (not meta, which holds no data, nor a
    backend its engine was never run on)."""
    import torch

    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise OptiqError(f"--device must be cpu, cuda or cuda:N, not '{visible(text, limit=60)}'")
    return device


# optiq.models.PRESETS' names, for --help without importing torch and transformers (seconds) to list them; a test
# holds the two equal.
PRESET_NAMES = ("tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v4", "tiny-deepseek-v4-flash",
                "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b", "gemma-3-1b", "phi-3-mini", "mistral-7b",
                "deepseek-v2-lite", "deepseek-v4-flash")

# Workload W1 on a GPU; a small one on the CPU, where the fusions run under Triton's interpreter.
WORKLOADS = {"cuda": {"concurrency": "1,16,64", "prompt_len": 512, "new_tokens": 128, "max_len": 1024},
             "cpu": {"concurrency": "1,2", "prompt_len": 64, "new_tokens": 16, "max_len": 128}}


def workload_options(gpu_concurrency: str = "1,16,64", new_tokens: bool = True):
    """--concurrency, --prompt-len, [--new-tokens,] --max-len, whose defaults depend on the device (WORKLOADS)."""
    cpu = WORKLOADS["cpu"]
    options = [
        ("--concurrency", f"Batch sizes, comma-separated (default {gpu_concurrency} on CUDA, {cpu['concurrency']} "
                          f"on CPU).", CONCURRENCY),
        ("--prompt-len", f"Random prompt tokens per sequence (default 512 on CUDA, {cpu['prompt_len']} on CPU).",
         SIZE),
        *([("--new-tokens", f"Decode steps timed per repeat (default 128 on CUDA, {cpu['new_tokens']} on CPU).",
            SIZE)] if new_tokens else []),
        ("--max-len", f"Static KV-cache length (default 1024 on CUDA, {cpu['max_len']} on CPU).", SIZE),
    ]

    def decorate(func):
        for flag, text, kind in reversed(options):
            func = click.option(flag, default=None, type=kind, help=text)(func)
        return func

    return decorate


def workload_defaults(device, gpu_concurrency: str = "1,16,64", **given) -> tuple:
    """The given workload values in their order, with the device's defaults where a flag was left out."""
    defaults = dict(WORKLOADS[device.type if device.type in WORKLOADS else "cuda"])
    if device.type == "cuda":
        defaults["concurrency"] = gpu_concurrency
    return tuple(defaults[key] if value is None else value for key, value in given.items())


def measurement_options(compare_help: str, peers: tuple[str, ...] = ("compile",)):
    """--repeats, --mode and --compare (a comma-separated list of ``peers``), shared by the commands that measure
    throughput; --compare arrives as a tuple of names."""
    def parse_peers(ctx, param, value):
        names = tuple(dict.fromkeys(n.strip() for n in (value or "").split(",") if n.strip()))
        unknown = [n for n in names if n not in peers]
        if unknown:
            raise click.BadParameter(f"{', '.join(unknown)}: choose from {', '.join(peers)}")
        return names

    def decorate(func):
        func = click.option("--compare", default=None, callback=parse_peers, metavar="|".join(peers),
                            help=compare_help)(func)
        func = click.option("--peer-budget", "peer_budget_s", default=900.0, show_default=True, metavar="SECONDS",
                            type=click.FloatRange(0, min_open=True), callback=_a_number,
                            help="The most a peer's warm-up (torch.compile's compile, the graph's capture) may take "
                                 "at one concurrency; past it the peer's row says so and its other concurrencies "
                                 "are not tried.")(func)
        func = click.option("--mode", type=click.Choice(["eager", "graph"]), default=None,
                            help="eager, or graph: one CUDA graph per concurrency (default on CUDA).")(func)
        return click.option("--repeats", default=3, show_default=True, type=SIZE,
                            help="Timed repeats of the decode; the median is reported.")(func)
    return decorate


def _a_number(ctx, param, value):
    """A float flag's value, not NaN (which every range lets through: it compares false with both ends)."""
    if math.isnan(value):
        raise click.BadParameter("nan is not a number")
    return value


def gate_options(func):
    """--gate-steps, --min-share and --mutants, shared by the commands that fuse (apply-fusion, bench --recipes)."""
    func = click.option("--mutants", is_flag=True,
                        help="First gate every mutant of each chosen recipe's kernel, alone, and record the mutation "
                             "score (as `optiq recipes verify --mutants`).")(func)
    func = click.option("--min-share", default=0.25, show_default=True, type=click.FloatRange(0, 100),
                        callback=_a_number,
                        help="auto: take proposals that cover at least this % of the step at some concurrency (of "
                             "the unpatched step: llama-3.1-8b's argmax is 0.45% of it, 0.8% of the fused one).")(func)
    return click.option("--gate-steps", default=64, show_default=True, type=SIZE,
                        help="Teacher-forced decode steps of the end-to-end check, at every concurrency.")(func)


def _finish(run, status: str, **extra) -> bool:
    """``run.finish``; False where run.json cannot be written (the disk that ended the run may be the full one)."""
    try:
        run.finish(status, **extra)
    except OptiqError:
        return False
    return True


def stop_interrupted(run, what: str, **progress) -> None:
    """After Ctrl-C: mark the run incomplete (what was measured is already on disk), say so, exit 130."""
    marked = "marked incomplete" if _finish(run, "incomplete", **progress) else "run.json could not be updated"
    err.print(f"interrupted: {what} kept in {visible(run.path)} ({marked})")
    raise SystemExit(EXIT_INTERRUPTED)


@contextmanager
def run_ending(run, what: Callable[[], str], progress: Callable[[], dict],
               keep: Callable[[str], None] = lambda status: None):
    """Around a run's work: however it stops short, ``run.json`` says so before the command exits, with what was
    done (``progress()``, its fields; ``what()``, in words). An interrupt marks it incomplete and exits 130; any
    exception marks it failed, with the exception's line, and goes on to the CLI's one-line report (an OptiqError:
    exit 1). ``SystemExit`` from code optiq ran (a kernel, a recipe's module) is a failure too, not the end of
    the command with its code. ``keep(status)`` saves the command's own record with that status first; a write that
    fails there (a full disk) does not hide the error that ended the run."""
    try:
        yield
    except KeyboardInterrupt:
        with suppress(OptiqError):
            keep("incomplete")
        stop_interrupted(run, what(), **progress())
    except BaseException as exc:
        failure = OptiqError(f"code optiq ran called sys.exit({exc.code!r}): the run stopped there") \
            if isinstance(exc, SystemExit) else exc
        with suppress(OptiqError):
            keep("failed")
        line = first_line(failure) if isinstance(failure, OptiqError) else f"{type(exc).__name__}: {first_line(exc)}"
        _finish(run, "failed", error=line, **progress())
        if failure is exc:
            raise
        raise failure from None


def model_options(func):
    """--model, --dtype and --device, shared by every command that loads a model."""
    func = click.option("--device", default=None, callback=_not_blank,
                        help="cuda or cpu (default: cuda when present).")(func)
    func = click.option("--dtype", default=None, callback=_not_blank,
                        help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")(func)
    func = click.option("--model", "model_spec", default=None, callback=_not_blank,
                        help="A preset name (see `optiq bench --help`) or a local checkpoint directory.")(func)
    return func


def _not_blank(ctx, param, value):
    """An empty --model, --dtype or --device (an unset shell variable) is a mistake, not a request for the
    default."""
    if value is not None and not value.strip():
        raise OptiqError(f"{param.opts[0]} is empty; leave the flag out for its default")
    return value


recipes_dir_option = click.option("--recipes-dir", multiple=True, type=click.Path(file_okay=False),
                                  help="A directory of your own recipe files (*.toml); may be repeated. A recipe "
                                       "named like a built-in one must say replaces = \"<that name>\".")


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def say(line: str) -> None:
    """One progress line on stderr, ``optiq: <line>``: what a step found (a recipe kept), or in a log (stderr not a
    terminal, where no spinner draws) what the run is doing now."""
    err.print(f"optiq: {visible(line)}", highlight=False)


class _Logged:
    """``status`` where stderr is no terminal: its line once, as the step starts. A spinner's later texts are left
    out (a caller prints whatever of them matters as a line of its own)."""

    def __init__(self, line: str):
        say(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, *text) -> None:
        pass


def status(line: str):
    """Around a long step: a spinner on stderr beside ``line`` (which may name a model, a path, recipes, shown as
    text) in a terminal, the line itself in a log."""
    return err.status(Text(visible(line))) if err.is_terminal else _Logged(line)


class _SweepBar:
    """workflow.SweepProgress on a rich progress bar (a terminal), or as one line per point (a log)."""

    def __init__(self, label: str, points: int, progress=None):
        self.label, self.points, self.progress, self.started = label, points, progress, 0
        self.task = progress.add_task(visible(label), total=points) if progress else None

    def start(self, variant: str, concurrency: int) -> None:
        self.started += 1
        if self.progress is None:
            say(f"measuring {self.label}: {variant} C={concurrency} ({self.started}/{self.points})")
        else:
            self.progress.update(self.task, description=visible(f"{self.label} {variant} C={concurrency}"))

    def done(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)


@contextmanager
def _sweep_bar(label: str, points: int):
    if not err.is_terminal:
        yield _SweepBar(label, points)
        return
    progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=err, transient=True)
    with progress:
        yield _SweepBar(label, points, progress)


def console_hooks(save):
    """workflow.Hooks for the console: spinners and progress bars on stderr (plain lines in a log), ``save(record)``
    after every step."""
    from optiq.workflow import Hooks

    return Hooks(save=save, status=status, sweep=_sweep_bar, note=lambda line: err.print(f"note: {visible(line)}"),
                 step=say)


wide_option = click.option("--wide", is_flag=True,
                           help="Show every column of the tables, folding cells as needed (by default a table fits "
                                "the terminal: minor columns left out, long names cut with …).")


def timing_note(device, fused: bool) -> str | None:
    """What a CPU run's numbers mean, for the terminal and ``--json``'s ``timing_note`` (None on a GPU)."""
    if device.type != "cpu":
        return None
    note = "measured on the CPU: these timings say nothing about a GPU's"
    if fused:
        note += ("; the fused model's Triton kernels ran under Triton's interpreter (thousands of times slower than "
                 "compiled kernels), so its throughput and speed-up are not meaningful (n/m). What this run proves "
                 "is the gate's verdict: each kept recipe, and the fused model end to end, compute what the model "
                 "computes")
    return note


def device_fields(device, fused: bool) -> dict:
    """The keys ``--json`` adds to a run record: ``device_kind`` (cpu or cuda) and, on the CPU, ``timing_note``."""
    note = timing_note(device, fused)
    return {"device_kind": device.type, **({"timing_note": note} if note else {})}


def run_job(command: str, model_spec, dtype, device, mode, concurrency, prompt_len, new_tokens, max_len, repeats,
            peers, requested, recipes_dirs, gate_steps, min_share, runs_dir, profile: bool, mutants: bool = False,
            report: bool = False, peer_budget_s: float | None = None):
    """What ``apply-fusion`` and ``bench`` share around the workflow: the flags checked before any work, a run
    directory, the record saved after every step, with ``report`` the report rendered from it, and how the run ends
    (exit 1 with the record marked failed, 4 so too when no recipe applies, 130 interrupted, 3 when the gate
    rejected every recipe). Returns the record, the run directory, the report's files (``report.Written``; None
    without ``report``) and the device."""
    device, mode = resolve_device_and_mode(device, mode)  # first: it picks Triton's interpreter on the CPU
    from optiq.catalog.proposals import named_recipes
    from optiq.catalog.recipes import load_catalog
    from optiq.measure.sweep import check_workload
    from optiq.models import default_dtype, default_preset, resolve_dtype
    from optiq.record import RECORD_FILES, Workload
    from optiq.report import write_report
    from optiq.rundir import RunDir, write_csv, write_json
    from optiq.workflow import Job, new_record, run

    concurrency, prompt_len, new_tokens, max_len = workload_defaults(
        device, concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens, max_len=max_len)
    workload = Workload(prompt_len, new_tokens, max_len, repeats)
    check_workload(workload)
    catalog = load_catalog(recipes_dirs) if requested else {}
    if requested and requested != "auto":
        named_recipes(requested, catalog)  # unknown names fail before any work
    job = Job(command, model_spec or default_preset(device), resolve_dtype(dtype or default_dtype(device), device),
              device, mode, parse_concurrency(concurrency), workload, peers, requested, catalog, tuple(recipes_dirs),
              gate_steps, min_share, profile, mutants, peer_budget_s)
    record = new_record(job)
    run_dir = RunDir(runs_dir, command, dict(model=job.model, dtype=record.dtype, mode=mode,
                                             concurrency=job.concurrencies, compare=peers, recipes=requested,
                                             gate_steps=gate_steps, **vars(workload)))

    def save(record) -> None:
        write_json(run_dir.path / RECORD_FILES[command], record.to_json())
        if command == "bench":
            write_csv(run_dir.path / "results.csv", [{k: v for k, v in vars(r).items() if k != "ms_per_step_repeats"}
                                                     for r in record.before + record.after])

    def points() -> int:
        return len(record.before) + len(record.after)

    def keep(status: str) -> None:
        record.status = status
        save(record)  # once more: an interrupt may land between two files of a save

    import torch  # here, not at the top: --help and the trace commands start without it

    with run_ending(run_dir, lambda: f"{points()} point(s)", lambda: {"points_done": points()}, keep):
        try:
            run(job, record, run_dir.path, console_hooks(save))
        except torch.OutOfMemoryError as exc:  # what was measured before is kept, as for any failure
            raise OptiqError(f"out of device memory ({first_line(exc)[:80]}...); try a smaller --concurrency or "
                             "--max-len") from exc
        save(record)
        written = write_report(run_dir.path, record) if report else None
    run_dir.finish(record.status, points_done=points())
    return record, run_dir, written, device


def exit_if_rejected(record) -> None:
    """Exit code 3 once everything is shown, when the gate rejected every recipe."""
    if record.status == "rejected":
        raise SystemExit(EXIT_GATE_REJECTED_ALL)
