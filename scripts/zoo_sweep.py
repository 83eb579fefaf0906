"""The zoo sweep: every decoder-only text model type of the installed transformers, shrunk (``tiny:<type>``,
optiq/zoo.py), through ``optiq profile`` and ``optiq apply-fusion --recipes auto`` on the CPU, each in processes of
its own, and a check that the engine's decode computes what the model's full forward does.

    python scripts/zoo_sweep.py [--types a,b,...] [--update] [--workers N] [--out docs/zoo]

writes ``<out>.json`` (every command's outcome, as each type finishes) and ``<out>.md`` (the table); with
``--update`` the types swept replace their rows in the tables already there, the others are kept. A type is
supported when it profiles; "kept" lists the recipes the gate kept, "rolled back" those it rejected; a command that
fails says why in its one line. A traceback anywhere is optiq's defect and is counted as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ["--device", "cpu", "--concurrency", "2", "--prompt-len", "16", "--max-len", "40"]
PROFILE = ["profile", *WORKLOAD, "--steps", "2", "--json"]
APPLY = ["apply-fusion", *WORKLOAD, "--recipes", "auto", "--new-tokens", "2", "--repeats", "1", "--gate-steps", "4",
         "--json"]
TIMEOUT_S = 600
DECODE_TOLERANCE = 1e-4  # fp32: the engine's decode against the full forward, relative over all steps


def check_decode(model_type: str) -> dict:
    """The engine's prefill + decode logits against one full forward over the same tokens (fp32)."""
    import torch

    from optiq.engine import DecodeEngine
    from optiq.models import load_model

    model = load_model(f"tiny:{model_type}", torch.float32, torch.device("cpu"))
    prompt_len, steps = 24, 6
    engine = DecodeEngine(model, 2, prompt_len + steps + 1)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (2, prompt_len), generator=torch.Generator().manual_seed(0))
    engine.prefill(prompt)
    tokens, logits = [engine.tokens.clone()], []
    for _ in range(steps):
        logits.append(engine.step().clone())
        tokens.append(engine.tokens.clone())
    with torch.inference_mode():
        full = model(input_ids=torch.cat([prompt, *tokens[:steps]], dim=1), use_cache=False).logits
    want = full[:, prompt_len:prompt_len + steps].float()
    error = ((torch.stack(logits, 1) - want).norm() / want.norm()).item()
    return {"error": error, "cache": "static" if engine.static else f"its own: {engine.why_not_static}"}


def _one_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("note:")]
    if any(line.startswith("Traceback") for line in lines):
        return "TRACEBACK: " + (lines[-1] if lines else "")
    return lines[-1] if lines else ""


def _run(args: list[str], cwd: str) -> tuple[int, dict | None, str]:
    """(exit code, the JSON it printed, the last line it wrote to stderr) of ``python args``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                              cwd=cwd)
    except subprocess.TimeoutExpired:
        return 124, None, f"no result in {TIMEOUT_S} s"
    try:
        doc = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    return done.returncode, doc, _one_line(done.stderr)


def _commit() -> str:
    """The checkout's commit, which the row was swept at ("" outside a git checkout)."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def sweep_one(model_type: str) -> dict:
    """Every check of one model type, each command in a process of its own."""
    started = time.perf_counter()
    row: dict = {"type": model_type, "commit": _commit()}
    with tempfile.TemporaryDirectory(prefix="optiq-zoo-") as runs:
        code, doc, why = _run([__file__, "--check", model_type], runs)
        row["decode"] = doc if code == 0 and doc else {"failed": why or f"exit {code}"}
        spec = ["--model", f"tiny:{model_type}", "--runs-dir", runs]
        code, doc, why = _run(["-m", "optiq", *PROFILE, *spec], runs)
        row["profile"] = {"ok": code == 0, "why": "" if code == 0 else why}
        if code == 0:
            code, doc, why = _run(["-m", "optiq", *APPLY, *spec], runs)
            fusion = (doc or {}).get("fusion") or {}
            verdicts = (fusion.get("gate") or {}).get("recipes") or {}
            row["apply"] = {"exit": code, "why": "" if code == 0 else why, "kept": list(fusion.get("applied") or []),
                            "rolled_back": {name: verdicts.get(name, {}).get("reason", "")
                                            for name in fusion.get("rolled_back") or []}}
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def table(rows: list[dict], header: str) -> str:
    """The markdown document: a summary, then one row per model type."""
    profiled = [r for r in rows if r["profile"]["ok"]]
    kept = [r for r in profiled if r.get("apply", {}).get("kept")]
    decoded = [r for r in rows if r["decode"].get("error", 1.0) <= DECODE_TOLERANCE]
    tracebacks = [r["type"] for r in rows if "TRACEBACK" in json.dumps(r)]
    commits: dict[str, int] = {}
    for r in rows:
        commits[r.get("commit") or "unknown"] = commits.get(r.get("commit") or "unknown", 0) + 1
    lines = [header, "",
             f"- {len(rows)} decoder-only text model types; **{len(profiled)} profile cleanly "
             f"({100 * len(profiled) / max(len(rows), 1):.0f}%)**; recipes applied and kept on **{len(kept)} of those "
             f"({100 * len(kept) / max(len(profiled), 1):.0f}%)**.",
             f"- The engine's decode equals the model's full forward (fp32, relative error <= {DECODE_TOLERANCE:g}) "
             f"on {len(decoded)} of {len(rows)}.",
             f"- Tracebacks (optiq's defects): {', '.join(tracebacks) or 'none'}.",
             f"- Swept at: {', '.join(f'{c} ({n} types)' for c, n in commits.items())}.", "",
             "| model type | cache | decode error | profiled | kept by the gate | rolled back | why not, or notes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        decode, apply = r["decode"], r.get("apply", {})
        cache = "static" if decode.get("cache") == "static" else "own" if "cache" in decode else ""
        error = f"{decode['error']:.1e}" if "error" in decode else "fails"
        why = r["profile"]["why"] or apply.get("why", "") or decode.get("failed", "")
        if not why and decode.get("cache", "static") != "static":
            why = decode["cache"]
        rolled = ", ".join(f"{n} ({clip(reason, 60)})" if reason else n
                           for n, reason in apply.get("rolled_back", {}).items())
        lines.append(f"| {r['type']} | {cache} | {error} | {'yes' if r['profile']['ok'] else 'no'} | "
                     f"{', '.join(apply.get('kept', [])) or '-'} | {rolled or '-'} | "
                     f"{clip(why.replace('|', '/'), 160)} |")
    return "\n".join(lines) + "\n"


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut at a word and marked as cut."""
    return text if len(text) <= width else text[:width - 1].rsplit(" ", 1)[0] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="model types, comma-separated (default: every decoder-only text type)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="types swept at once, one core each")
    parser.add_argument("--out", default=str(ROOT / "docs" / "zoo"))
    parser.add_argument("--update", action="store_true", help="replace these types' rows, keep the others")
    parser.add_argument("--check", help=argparse.SUPPRESS)  # one type's decode check, in its own process
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.check:
        from optiq.errors import OptiqError
        try:
            print(json.dumps(check_decode(args.check)))
        except OptiqError as exc:  # optiq's one line: the model is one it cannot serve, and says why
            print(json.dumps({"failed": str(exc)}))
        return
    import transformers

    from optiq.rundir import write_json
    from optiq.zoo import decoder_only_text_types

    zoo = decoder_only_text_types()
    types = args.types.split(",") if args.types else zoo
    if others := [t for t in types if t not in zoo]:  # its table is of the zoo: a row of another type is no row of it
        print(f"not decoder-only text model types, left out: {', '.join(others)}", flush=True)
        types = [t for t in types if t in zoo]
    out = Path(args.out)
    kept = {}
    if args.update and out.with_suffix(".json").is_file():
        kept = {row["type"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    header = f"# The zoo sweep (transformers {transformers.__version__}, CPU, fp32)"
    order = {t: i for i, t in enumerate(zoo)}
    with ThreadPoolExecutor(args.workers) as pool:
        for row in pool.map(sweep_one, types):
            kept[row["type"]] = row
            rows = sorted(kept.values(), key=lambda r: (order.get(r["type"], len(order)), r["type"]))
            write_json(out.with_suffix(".json"), {"transformers": transformers.__version__, "rows": rows})
            print(f"{row['type']}: profiled {row['profile']['ok']}, kept {row.get('apply', {}).get('kept', [])} "
                  f"({row['seconds']} s)", flush=True)
    out.with_suffix(".md").write_text(table(rows, header))


if __name__ == "__main__":
    main()
