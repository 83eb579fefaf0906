"""The run record: every fact a fusing or measuring run leaves, as one typed document.

``optiq apply-fusion`` writes it as ``report.json`` and ``optiq bench`` as ``results.json``; the workflow
(``optiq.workflow``) fills it in as the run goes and saves it after every step, and the report (``optiq.report``)
renders it. ``load`` checks a file against these types and its schema version, so a reader never guesses at a
missing field. This module imports nothing but the standard library: the report renders without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optiq.errors import OptiqError, first_line

SCHEMA_VERSION = 1
STATUSES = ("running", "complete", "rejected", "incomplete", "failed")
RECORD_FILES = {"apply-fusion": "report.json", "bench": "results.json"}  # the file each command keeps it in


@dataclass
class Environment:
    """What a number depends on besides the code. ``kind`` and ``triton_interpreter`` tell the report whether its
    timings mean anything: on the CPU, or with Triton's interpreter, they are smoke numbers (``RunRecord.smoke``)."""
    device: str
    torch: str
    transformers: str
    cuda: str | None  # the CUDA torch was built for, present on a CUDA build run on the CPU too
    python: str
    optiq: str
    kind: str = ""  # the device's type, cpu or cuda; empty in a record written before optiq kept it
    triton_interpreter: bool = False  # TRITON_INTERPRET was on: kernels ran as Python, not as compiled GPU code


@dataclass
class Workload:
    """One decode measurement: a random prompt, then ``new_tokens`` timed steps, ``repeats`` times (the median)."""
    prompt_len: int = 512
    new_tokens: int = 128
    max_len: int = 1024  # static KV-cache positions
    repeats: int = 3

    @property
    def mean_length(self) -> float:
        """The positions a sequence holds on average over the timed steps: the floor's cache length."""
        return self.prompt_len + (self.new_tokens + 1) / 2


HF_VARIANT = "hf"  # the rows of HF's own step: its own cache (DynamicCache or the architecture's), eager


@dataclass
class Row:
    """One measured point: a variant (the engine's mode, a peer such as ``compile+graph``, or ``optiq+graph``) at one
    concurrency. ``status`` is ok, oom (out of memory) or failed (a peer that raised: ``error`` says how); the numbers
    are there when it is ok. A repeat's ms/step is its mean on CUDA (events around the whole repeat) and its median
    step on the CPU (each step timed, so a step stalled by another process does not count); ``ms_per_step`` is the
    median repeat."""
    variant: str
    mode: str
    concurrency: int
    status: str
    tok_per_s: float | None = None
    ms_per_step: float | None = None  # the median repeat
    ms_per_step_repeats: list[float] = field(default_factory=list)
    prefill_ms: float | None = None
    warmup_s: float | None = None  # warm-up steps: where a graph is captured and torch.compile compiles
    peak_mem_gb: float | None = None  # CUDA only
    floor_ms_per_step: float | None = None  # the bytes a step must read over the copy bandwidth
    floor_tok_per_s: float | None = None
    pct_of_floor: float | None = None
    error: str | None = None
    smoke: bool = False  # timed on the CPU or with Triton's interpreter: it shows the step runs, not a GPU's speed
    threads: int | None = None  # the torch CPU threads it was timed with (optiq.measure.timing.fixed_threads)

    @property
    def is_compile(self) -> bool:
        """Whether this is a row of torch.compile, the peer every ratio is taken against."""
        return self.variant.startswith(compile_variant(""))

    @property
    def is_hf(self) -> bool:
        """Whether this is a row of HF's own step, the baseline a user starts from."""
        return self.variant == HF_VARIANT


def compile_variant(mode: str) -> str:
    """The variant name of torch.compile's rows in engine ``mode``."""
    return f"compile+{mode}"


@dataclass
class RecipeVerdict:
    """The gate's per-recipe check: the fused path against the original one, both against a float64 run of the
    original, at the worst call (the largest fused error over its bound)."""
    recipe: str
    tolerance: str
    passed: bool
    reason: str
    calls: int = 0
    err_fused: float = math.nan
    err_unfused: float = math.nan
    bound: float = math.nan
    site: str = ""
    seconds: float = 0.0  # running the captured calls through the three paths
    margin: float = math.nan  # err_fused / err_unfused at that call: how close to its bound a passing path came


@dataclass
class MutationScore:
    """``--mutants``: the gate on the mutants of one recipe's kernel (optiq.gate.mutants), the recipe alone."""
    killed: int
    counted: int  # the mutants that changed something on this model
    survived: list[str] = field(default_factory=list)
    real: str = "passed"  # the gate on the real kernel alone, or why it rejected it

    @property
    def score(self) -> float | None:
        return self.killed / self.counted if self.counted else None


@dataclass
class EndToEndVerdict:
    """The gate's end-to-end check at one concurrency: teacher-forced greedy decode against the fp32 reference."""
    concurrency: int
    steps: int
    passed: bool
    rel_err: float
    rel_err_unpatched: float
    bound: float
    top1: float
    top1_unpatched: float
    min_top1: float
    recipes: list[str]
    seconds: float = 0.0  # the patched model's decode and its comparison, graph capture included
    problem: str = ""  # what stopped the patched decode, if anything: a kernel that raised or hung, a failed capture


@dataclass
class GateRecord:
    recipes: dict[str, RecipeVerdict] = field(default_factory=dict)
    end_to_end: list[EndToEndVerdict] = field(default_factory=list)  # of the set that was kept, the last round's
    reference_mode: str = ""  # the engine mode the fp32 reference decoded in: the gate's, or eager where its step
    # could not be captured
    constant_parameters: list[str] = field(default_factory=list)  # the model's parameters whose elements were all
    # one value when it was gated (a checkpoint's all-ones norm weights, zero biases): a kernel that ignores such a
    # parameter computes the same function there, so the gate cannot see it; presets have none


@dataclass
class CompiledAhead:
    """One compile-ahead worker (optiq.compile_ahead): the engine it stepped, how it ended, and when."""
    engine: list[int]  # batch, cache length, prompt length
    status: str = "running"  # done, stopped (still compiling when the gate ended) or "failed: <its last error line>"
    ready_s: float | None = None  # from its start until it was ready for the names (imports, CUDA, the model)
    sent_s: float | None = None  # from its start until it was sent the names
    seconds: float | None = None  # from the names until it had compiled, if it ended by itself


@dataclass
class Timings:
    """Seconds of the fusion, summed over every round of the gate."""
    patch_s: float = 0.0
    gate_s: float = 0.0
    gate_capture_s: float = 0.0  # recording the patched sites' inputs
    gate_baselines_s: float = 0.0  # the decodes every end-to-end check compares with
    gate_reference_s: float = 0.0  # the fp32 reference's part of them
    capture_s: float | None = None  # the fused model's warm-up (its graph captures) in the measured sweep


@dataclass
class Proposal:
    """A recipe ranked by the profiled time it would replace (optiq.catalog.proposals)."""
    recipe: str
    covered_ms_per_step: float  # an upper bound of the saving: the time the recipe covers
    covered_pct: float
    kernels_per_step: float
    where: str  # the largest covered (role, class) pairs with their shares
    why: str


@dataclass
class Fusion:
    """What the fusion did: the recipes asked for and chosen, the gate's verdicts and what it cost."""
    requested: list[str]  # ["auto"] or recipe names
    proposals: dict[str, list[Proposal]] = field(default_factory=dict)  # per concurrency, of the unpatched profile
    applied: list[str] = field(default_factory=list)
    not_applicable: dict[str, str] = field(default_factory=dict)  # recipe -> why
    rolled_back: list[str] = field(default_factory=list)
    gate: GateRecord = field(default_factory=GateRecord)
    timings: Timings = field(default_factory=Timings)
    compile_ahead: list[CompiledAhead] = field(default_factory=list)  # the last round's workers
    mutants: dict[str, MutationScore] = field(default_factory=dict)  # with --mutants: per chosen recipe


@dataclass
class LayerKind:
    """One kind of layer of a published model (its layer_types entry and mlp_layer_types entry, "heavily_compressed_
    attention / hash_moe"): how many layers of it the model has and the preset holds, and for a kind the preset
    lacks the measured kind whose time stands in for it (the nearest by attention type)."""
    kind: str
    layers: int  # in the published model
    measured: int  # of the preset's layers, profiled
    stand_in: str = ""


@dataclass
class DepthPoint:
    """One profiled variant at one concurrency, extrapolated to the published depth. The profile's times (of the
    trace's time unit) are scaled to the wall clock by ``scale``, the timed step over the profiled one."""
    variant: str
    concurrency: int
    outside_ms: float  # profiled time outside every layer: embedding, final norm and head, LM head, sampling
    ms_per_layer: dict[str, float]  # the mean profiled time of one layer, per kind the preset holds
    profiled_ms: float  # outside + every profiled layer: the preset's step as profiled
    measured_ms: float  # the preset's timed step (the throughput row)
    scale: float  # measured_ms / profiled_ms
    ms_per_step: float  # (outside + sum over the published kinds of layers x ms per layer) x scale
    tok_per_s: float
    pct_of_floor: float  # of the published model's floor


@dataclass
class FullDepth:
    """What a preset that holds ``measured_layers`` of a published model's ``layers`` says of the whole model: the
    floor of its full config (the same roofline, computed on the meta device) and, per profiled variant and
    concurrency, its step extrapolated from the preset's profiled layers (``DepthPoint``)."""
    published: str  # the model's name
    layers: int
    measured_layers: int
    kinds: list[LayerKind]
    floor_ms_per_step: dict[str, float]  # per concurrency, of the published model
    points: list[DepthPoint] = field(default_factory=list)
    time_unit: str = ""  # what the profiles timed (GPU time, or CPU self time without a GPU)
    not_profiled: list[str] = field(default_factory=list)  # measured variants optiq's profiler does not run


@dataclass
class RunRecord:
    """A run of ``apply-fusion`` or ``bench``. ``before`` holds the rows of the model as loaded (and of its peers),
    ``after`` those of the fused model; ``attribution_*`` the op-class tables of its profiles, per concurrency
    (``{"summary": ..., "table": [...]}`` as ``optiq analyze --json`` writes them)."""
    command: str  # apply-fusion or bench
    model: str
    dtype: str
    mode: str  # the engine's: eager or graph
    environment: Environment
    workload: Workload
    concurrency: list[int]
    status: str = "running"  # one of STATUSES
    bandwidth_gb_s: float | None = None  # the device's measured copy bandwidth, the floor's denominator
    before: list[Row] = field(default_factory=list)
    after: list[Row] = field(default_factory=list)
    fusion: Fusion | None = None  # none for a bench without --recipes
    attribution_before: dict[str, dict] = field(default_factory=dict)
    attribution_after: dict[str, dict] = field(default_factory=dict)
    mode_note: str = ""  # why the run is in eager mode where graph mode was asked for
    full_depth: FullDepth | None = None  # a preset of some of a published model's layers: the whole model
    schema: int = SCHEMA_VERSION

    @property
    def smoke(self) -> bool:
        """Whether the run's timings are smoke numbers: measured on the CPU, or with Triton's interpreter running the
        kernels. They show the run works; they say nothing about a GPU's speed, before or after fusing."""
        return self.environment.kind == "cpu" or self.environment.triton_interpreter

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _decode(kind: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as type ``kind``, or an OptiqError naming the field."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), value, where)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise OptiqError(f"{where}: expected an object, not {type(value).__name__}")
        hints = typing.get_type_hints(kind)
        known = {f.name: f for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise OptiqError(f"{where}: unknown field(s) {', '.join(unknown)}")
        missing = [n for n, f in known.items() if n not in value and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise OptiqError(f"{where}: missing field(s) {', '.join(missing)}")
        return kind(**{name: _decode(hints[name], item, f"{where}.{name}") for name, item in value.items()})
    if origin is list:
        if not isinstance(value, list):
            raise OptiqError(f"{where}: expected a list, not {type(value).__name__}")
        return [_decode(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise OptiqError(f"{where}: expected an object, not {type(value).__name__}")
        return {key: _decode(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _float(value, where)
    elif kind is Any or (isinstance(kind, type) and isinstance(value, kind) and not
                         (isinstance(value, bool) and kind is int)):
        return value
    raise OptiqError(f"{where}: expected {getattr(kind, '__name__', kind)}, not {value!r:.60}")


def _float(value: int | float, where: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise OptiqError(f"{where}: an integer of {len(str(value))} digits is out of a float's range") from None


def _concurrency_keys(table: dict, where: str) -> None:
    """The keys of a per-concurrency table are concurrencies, as JSON writes integer keys: "1", "64"."""
    bad = next((key for key in table if not (key.isascii() and key.isdigit())), None)
    if bad is not None:
        raise OptiqError(f"{where}: key {bad!r:.60} is not a concurrency")


def _check_attribution(attribution: dict[str, dict], where: str) -> None:
    """The parts of a profile's attribution (``optiq analyze --json``'s document) the report reads: a summary whose
    time unit is text and whose kernel count is a number, and table rows with a text label and a GPU time. The rest
    of the document is the profiler's, kept as it is."""
    _concurrency_keys(attribution, where)
    for key, entry in attribution.items():
        summary, table = entry.get("summary", {}), entry.get("table", [])
        if not isinstance(summary, dict):
            raise OptiqError(f"{where}.{key}.summary: expected an object, not {type(summary).__name__}")
        for name, kind in (("time_unit", str), ("kernels_per_step", float)):
            if name in summary:
                summary[name] = _decode(kind, summary[name], f"{where}.{key}.summary.{name}")
        if not isinstance(table, list):
            raise OptiqError(f"{where}.{key}.table: expected a list, not {type(table).__name__}")
        for i, row in enumerate(table):
            if not isinstance(row, dict) or not {"label", "gpu_ms_per_step"} <= row.keys():
                raise OptiqError(f"{where}.{key}.table[{i}]: expected an object with a label and a gpu_ms_per_step")
            place = f"{where}.{key}.table[{i}]"
            row["label"] = _decode(str, row["label"], f"{place}.label")
            row["gpu_ms_per_step"] = _decode(float, row["gpu_ms_per_step"], f"{place}.gpu_ms_per_step")


def _check(record: RunRecord, where: str) -> None:
    """What the types alone do not say: a known status, per-concurrency keys (the full depth's floors too),
    attributions the report can read, a compile worker's engine of three sizes."""
    if record.status not in STATUSES:
        raise OptiqError(f"{where}.status: expected one of {', '.join(STATUSES)}, not {record.status!r:.60}")
    for name in ("attribution_before", "attribution_after"):
        _check_attribution(getattr(record, name), f"{where}.{name}")
    if record.full_depth is not None:
        _concurrency_keys(record.full_depth.floor_ms_per_step, f"{where}.full_depth.floor_ms_per_step")
    if record.fusion is not None:
        _concurrency_keys(record.fusion.proposals, f"{where}.fusion.proposals")
        for i, child in enumerate(record.fusion.compile_ahead):
            if len(child.engine) != 3:
                raise OptiqError(f"{where}.fusion.compile_ahead[{i}].engine: expected [batch, cache length, prompt "
                                 f"length], not {child.engine!r:.60}")


def from_json(doc: Any, where: str = "run record") -> RunRecord:
    """A parsed record checked against the types above; a record of another schema version is refused."""
    if not isinstance(doc, dict):
        raise OptiqError(f"{where}: expected a JSON object")
    if doc.get("schema") != SCHEMA_VERSION:
        found = doc.get("schema")
        raise OptiqError(f"{where}: schema version {found if found is not None else 'none (an older optiq)'}, this "
                         f"optiq reads version {SCHEMA_VERSION}; run the command again to record it anew")
    record = _decode(RunRecord, doc, where)
    _check(record, where)
    return record


MAX_RECORD_BYTES = 16 * 2**20  # a real record is kilobytes; parsed, 16 MB of JSON may take some hundreds of MB


def load(path: Path | str) -> RunRecord:
    """A record file, checked (``from_json``); anything unreadable is a one-line user error."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
                raise OptiqError(f"{path} is not a regular file")
            if info.st_size > MAX_RECORD_BYTES:
                raise OptiqError(f"{path} is {info.st_size:,} bytes, more than any run record "
                                 f"({MAX_RECORD_BYTES:,} at most)")
            text = f.read(MAX_RECORD_BYTES + 1).decode("utf-8")
        doc = json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise OptiqError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise OptiqError(f"{path} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, arrays nested thousands deep
        raise OptiqError(f"{path} is not a run record: {first_line(exc)}") from None
    return from_json(doc, str(path))
