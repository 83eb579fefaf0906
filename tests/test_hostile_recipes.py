"""Hostile and careless user recipes: every failure of a recipe's own code (its module's import, its factory, its
kernel) is that recipe's rejection with the reason, the others go on, and through the CLI the run ends with a
documented exit code and a record, never a traceback; the loader refuses what it does not understand. Recipe files
are fuzzed (fields, types, names, nesting depth and size)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wrong_kernels import user_recipe

from optiq.catalog.recipes import MAX_RECIPE_BYTES, MAX_RECIPE_FILES, load_catalog
from optiq.cli import cli
from optiq.errors import EXIT_GATE_REJECTED_ALL, OptiqError
from optiq.fusions.greedy_sample import greedy_sample
from optiq.gate import GatePlan, validate
from optiq.gate.end_to_end import baselines, check_end_to_end
from optiq.models import load_model
from optiq.patching import apply, broken, unpatch
from optiq.patching import user_code
from optiq.patching.user_code import TIMEOUT_VARIABLE, DeadlineExceeded, deadline

FAST = {"concurrencies": (1, 2), "steps": 3, "prompt_len": 5}
SMALL = ["--model", "tiny-llama", "--concurrency", "1", "--prompt-len", "8", "--new-tokens", "2", "--max-len", "32",
         "--repeats", "1", "--gate-steps", "2", "--json"]
TESTS = Path(__file__).parent
RMSNORM = (Path(load_catalog()["rmsnorm"].path)).read_text()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama", torch.float32, torch.device("cpu"))


def recipe_file(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


def rmsnorm_text(name: str = "mine", **lines: str) -> str:
    """The built-in rmsnorm recipe's text, renamed, with whole lines replaced: {"old line start": "new line"}."""
    text = RMSNORM.replace('name = "rmsnorm"', f'name = "{name}"')
    for start, line in lines.items():
        assert start in text, start
        text = "\n".join(line if old.startswith(start) else old for old in text.splitlines()) + "\n"
    return text


def refused(tmp_path, text: str, message: str, name: str = "mine"):
    """Loading a directory of just this recipe file fails with ``message``, in one line."""
    directory = tmp_path / f"refused{len(list(tmp_path.glob('refused*')))}"
    recipe_file(directory, name, text)
    with pytest.raises(OptiqError, match=message) as info:
        load_catalog([str(directory)])
    assert "\n" not in str(info.value)


# The loader -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ('tolerence = "exact"', "unknown recipe field 'tolerence'; did you mean 'tolerance'\\?"),
    ('[extra]', "unknown recipe field 'extra'"),
])
def test_an_unknown_top_level_key_is_refused_with_the_nearest_known_one(tmp_path, line, message):
    refused(tmp_path, line + "\n" + rmsnorm_text(), message)


@pytest.mark.parametrize("table, key, message", [
    ("[fixes]", "role = []", "'fixes.role'; did you mean 'fixes.roles'"),
    ("[patch]", 'wth = "x:y"', "'patch.wth'; did you mean 'patch.with'"),
    ("[patch]", 'function = "rms_norm"', "'patch.function' names another kind's target"),
])
def test_an_unknown_key_in_a_table_is_refused(tmp_path, table, key, message):
    refused(tmp_path, rmsnorm_text().replace(table, f"{table}\n{key}"), message)


@pytest.mark.parametrize("name", ["", "a,b", "auto", " rms", "rms norm", "[/foo]", "gemm[bs=4]", "-x", "a" * 65,
                                  "naïve", "x\\u001b[31m"])
def test_a_name_recipes_could_not_ask_for_is_refused(tmp_path, name):
    refused(tmp_path, rmsnorm_text(name), "recipe field 'name' (must be 1-64 letters|holds control characters)")


def test_control_characters_in_any_string_are_refused(tmp_path):
    refused(tmp_path, rmsnorm_text(summary='summary = "fine\\u001b]8;;http://x\\u0007 link"'),
            "'summary' holds control characters")


def test_one_name_in_two_directories_is_refused(tmp_path):
    recipe_file(tmp_path / "a", "mine", rmsnorm_text())
    recipe_file(tmp_path / "b", "also_mine", rmsnorm_text())
    with pytest.raises(OptiqError, match=f"recipe name 'mine' is also used by {tmp_path / 'a' / 'mine.toml'}"):
        load_catalog([str(tmp_path / "a"), str(tmp_path / "b")])
    assert "mine" in load_catalog([str(tmp_path / "a"), str(tmp_path / "a")])  # one directory given twice: read once


def test_a_builtin_is_replaced_only_when_a_recipe_says_so(tmp_path):
    refused(tmp_path, rmsnorm_text("rmsnorm"), 'is a built-in recipe\'s; .*add replaces = "rmsnorm"', "rmsnorm")
    refused(tmp_path, 'replaces = "warp_drive"\n' + rmsnorm_text(), "'replaces' must name a built-in recipe")
    refused(tmp_path, 'replaces = "rmsnorm"\n' + rmsnorm_text("swiglu"), "'swiglu' is a built-in recipe's")
    recipe_file(tmp_path / "d", "mine", 'replaces = "rmsnorm"\n' + rmsnorm_text())
    catalog = load_catalog([str(tmp_path / "d")])
    assert "rmsnorm" not in catalog and catalog["mine"].replaces == "rmsnorm"
    recipe_file(tmp_path / "e", "again", 'replaces = "rmsnorm"\n' + rmsnorm_text("again"))
    with pytest.raises(OptiqError, match="recipe name 'rmsnorm' is also replaced by"):
        load_catalog([str(tmp_path / "d"), str(tmp_path / "e")])


def test_deep_nesting_large_and_undecodable_files_are_one_line(tmp_path):
    refused(tmp_path, rmsnorm_text() + "x = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply")
    refused(tmp_path, rmsnorm_text() + "x = {" * 2_000 + "}" * 2_000, "not valid TOML")
    refused(tmp_path, rmsnorm_text() + "#" * MAX_RECIPE_BYTES, "larger than 1024 KiB")
    recipe_file(tmp_path / "d", "mine", "")
    (tmp_path / "d" / "mine.toml").write_bytes(b"name = \"\xff\"\n")
    with pytest.raises(OptiqError, match="not UTF-8 text"):
        load_catalog([str(tmp_path / "d")])


def test_a_directory_of_too_many_recipe_files_is_refused_before_reading_them(tmp_path):
    for number in range(MAX_RECIPE_FILES + 1):
        (tmp_path / f"r{number}.toml").touch()
    with pytest.raises(OptiqError, match=f"{MAX_RECIPE_FILES + 1} recipe files; .* at most {MAX_RECIPE_FILES}"):
        load_catalog([str(tmp_path)])


def test_a_fifo_named_toml_is_refused_without_being_opened(tmp_path):
    """Through the CLI in a subprocess, bounded: opening the FIFO would wait for a writer forever."""
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "pipe.toml")
    done = subprocess.run([sys.executable, "-m", "optiq", "recipes", "--recipes-dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "pipe.toml: not a regular file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# A recipe's code ------------------------------------------------------------------------------------------------------

def module_file(directory: Path, name: str, source: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(source)
    return name


@pytest.mark.parametrize("source, attribute, message", [
    ("def rmsnorm(:\n", "rmsnorm", "importing {module} raised SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "rmsnorm", "importing {module} raised RuntimeError: no GPU here"),
    ("import sys\nsys.exit(0)\n", "rmsnorm", "importing {module} called sys.exit\\(0\\)"),
    ("import time\nwhile True:\n    time.sleep(1)\n", "rmsnorm", "importing {module} did not return within 1 s"),
    ("x = 1\n", "rmsnorm", "{module} has no 'rmsnorm'"),
    ("rmsnorm = 42\n", "rmsnorm", "is not callable"),
])
def test_a_fusion_module_that_does_not_import_is_that_recipes_failure(tmp_path, monkeypatch, model, source, attribute,
                                                                      message):
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    module = module_file(tmp_path / "code", f"user_fusion_{abs(hash(source))}", source)
    recipe = user_recipe(tmp_path / "d", "rmsnorm", "mine", fusion=f"{module}:{attribute}")
    monkeypatch.setattr(user_code, "IMPORT_SECONDS", 1.0)
    started = time.perf_counter()
    found = broken([recipe, load_catalog()["greedy_sample"]])
    assert list(found) == ["mine"] and time.perf_counter() - started < 10
    patches = apply(model, [recipe, load_catalog()["greedy_sample"]])
    assert found["mine"].startswith(f"recipe 'mine': fusion '{module}:{attribute}' ")
    assert re.search(message.format(module=module), found["mine"]), found["mine"]
    try:
        report = validate(patches, GatePlan(**FAST))
    finally:
        unpatch(model)
    assert report.rolled_back == ["mine"] and not report.recipes["mine"].passed
    assert report.recipes["mine"].reason == found["mine"] and report.recipes["greedy_sample"].passed


@pytest.mark.parametrize("factory, message", [
    ("hostile_kernels:factory_of_one_argument", "patch.with 'hostile_kernels:factory_of_one_argument' must take "
                                                "\\(module, fusion\\), not \\(module\\)"),
    ("hostile_kernels:not_callable", "is not callable"),
])
def test_a_factory_of_the_wrong_signature_is_found_before_any_model(tmp_path, factory, message):
    recipe = user_recipe(tmp_path, "rmsnorm", "mine", with_=factory)
    assert re.search(message, broken([recipe])["mine"])


@pytest.mark.parametrize("factory, message", [
    ("hostile_kernels:raising_factory", "raised ValueError: cannot patch LlamaRMSNorm"),
    ("hostile_kernels:factory_that_exits", "called sys.exit\\(2\\)"),
    ("hostile_kernels:factory_that_hangs", "did not return within 1[.0-9]* s"),
    ("hostile_kernels:factory_returning_none", "returned a NoneType, not a function"),
])
def test_a_factory_that_fails_is_that_recipes_rejection_and_changes_nothing(tmp_path, monkeypatch, model, factory,
                                                                          message):
    monkeypatch.setattr(user_code, "IMPORT_SECONDS", 1.0)
    recipe = user_recipe(tmp_path, "rmsnorm", "mine", with_=factory)
    patches = apply(model, [recipe, load_catalog()["greedy_sample"]])
    assert list(patches.applied) == ["greedy_sample"] and "mine" not in patches.not_applicable
    try:
        report = validate(patches, GatePlan(**FAST))
    finally:
        unpatch(model)
    assert report.rolled_back == ["mine"] and all(e.passed for e in report.end_to_end)
    assert re.search(f"building its replacements: patch.with on model.* {message}",
                                   report.recipes["mine"].reason), report.recipes["mine"].reason
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("kernel, message", [
    ("norm_in_float64", "the fused path returned output 1 with dtype torch.float64 where the original's is "
                        "torch.float32"),
    ("norm_on_meta", "the fused path returned output 1 with device meta where the original's is cpu"),
    ("norm_of_half_width", "the fused path returned output 1 with shape \\[1, 1, 32\\] where the original's is "
                           "\\[1, 1, 64\\]"),
    ("norm_returning_none", "the fused path returned 0 tensor\\(s\\) where the original returns 1"),
    ("norm_that_exits", "the fused path called sys.exit\\(0\\)"),
    ("norm_that_hangs", "the fused path did not return within 1[.0-9]* s"),
    ("norm_nan_every_second_call", "on its second run: error nan > 1.5 x unfused"),
])
def test_a_kernel_that_misbehaves_is_rolled_back_with_the_reason(tmp_path, monkeypatch, model, kernel, message):
    if kernel == "norm_that_hangs":  # a short deadline for every kernel: greedy_sample's must not be its first
        greedy_sample(torch.randn(2, 256))  # interpreted call, whose start-up a loaded CI machine stretches past 1 s
        monkeypatch.setitem(user_code.FLOOR_SECONDS, "cpu", 1.0)
    recipe = user_recipe(tmp_path, "rmsnorm", "mine", fusion=f"hostile_kernels:{kernel}")
    patches = apply(model, [recipe, load_catalog()["greedy_sample"]])
    started = time.perf_counter()
    try:
        report = validate(patches, GatePlan(**FAST))
    finally:
        unpatch(model)
    assert time.perf_counter() - started < 15
    result = report.recipes["mine"]
    assert not result.passed and re.search(message, result.reason), result.reason
    assert report.rolled_back == ["mine"] and report.recipes["greedy_sample"].passed
    assert all(e.passed for e in report.end_to_end)
    if kernel == "norm_nan_every_second_call":
        assert result.err_fused != result.err_fused  # nan, not the first run's error that max() kept


def test_a_kernel_that_fails_only_end_to_end_says_how(tmp_path, model):
    """The end-to-end decode runs the kernels too: what one raises there is its set's problem, and the model's
    changes are undone however the decode ended."""
    plan = GatePlan(**FAST)
    for kernel, problem in [("norm_that_exits", "the patched decode called sys.exit(0)"),
                            ("norm_in_float64", "the patched decode failed: LlamaForCausalLM's forward failed "
                                                "(RuntimeError: expected m1 and m2 to have the same dtype")]:
        recipe = user_recipe(tmp_path, "rmsnorm", "mine", fusion=f"hostile_kernels:{kernel}")
        patches = apply(model, [recipe])
        try:
            found, *_ = baselines(patches, plan)
            checks = check_end_to_end(patches, ["mine"], found)
        finally:
            unpatch(model)
        assert [c.passed for c in checks] == [False, False] and checks[0].problem.startswith(problem), checks[0]
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_users_ctrl_c_inside_a_kernel_is_not_swallowed(tmp_path, model):
    recipe = user_recipe(tmp_path, "rmsnorm", "mine", fusion="hostile_kernels:norm_raising_keyboard_interrupt")
    patches = apply(model, [recipe])
    try:
        with pytest.raises(KeyboardInterrupt):
            validate(patches, GatePlan(**FAST))
    finally:
        unpatch(model)


def test_the_deadline_ends_code_that_catches_the_first_alarm():
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match="did not return within 0.2 s"):
        with deadline(0.2):
            while True:
                try:
                    time.sleep(10)
                except Exception:  # noqa: BLE001 - what a careless kernel does; DeadlineExceeded is not one
                    pass
    assert time.perf_counter() - started < 2
    with deadline(5):  # disarmed after: no alarm arrives later
        pass
    time.sleep(0.3)


# Through the CLI ------------------------------------------------------------------------------------------------------

def run_cli(tmp_path, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "optiq", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(TESTS.parent), str(TESTS), str(tmp_path / "code")]), **(env or {})})


def test_a_kernel_calling_sys_exit_is_rejected_and_the_run_exits_3_with_its_report(tmp_path):
    user_recipe(tmp_path / "d", "rmsnorm", "exits", fusion="hostile_kernels:norm_that_exits")
    done = run_cli(tmp_path, "apply-fusion", "--recipes", "exits", "--recipes-dir", str(tmp_path / "d"), *SMALL,
                   "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == EXIT_GATE_REJECTED_ALL, done.stderr
    assert "Traceback" not in done.stderr
    doc = json.loads(done.stdout)
    assert doc["status"] == "rejected" and doc["fusion"]["rolled_back"] == ["exits"]
    assert "called sys.exit(0)" in doc["fusion"]["gate"]["recipes"]["exits"]["reason"]
    run_dir = Path(doc["run_dir"])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "rejected"
    assert (run_dir / "report.md").is_file()


def test_a_hanging_kernel_is_rejected_within_its_deadline(tmp_path):
    user_recipe(tmp_path / "d", "rmsnorm", "hangs", fusion="hostile_kernels:norm_that_hangs")
    started = time.perf_counter()
    done = run_cli(tmp_path, "apply-fusion", "--recipes", "hangs,greedy_sample", "--recipes-dir", str(tmp_path / "d"),
                   *SMALL, "--runs-dir", str(tmp_path / "runs"), env={TIMEOUT_VARIABLE: "3"}, timeout=60)
    assert time.perf_counter() - started < 30  # about 8 s on an idle machine, of which the deadline is 3
    assert done.returncode == 0, done.stderr
    fusion = json.loads(done.stdout)["fusion"]
    assert fusion["applied"] == ["greedy_sample"] and fusion["rolled_back"] == ["hangs"]
    assert "did not return within 3 s" in fusion["gate"]["recipes"]["hangs"]["reason"]


def test_a_broken_recipe_fails_in_seconds_before_anything_is_measured(tmp_path):
    module_file(tmp_path / "code", "syntax_error_fusion", "def rmsnorm(:\n")
    user_recipe(tmp_path / "d", "rmsnorm", "broken", fusion="syntax_error_fusion:rmsnorm")
    done = run_cli(tmp_path, "apply-fusion", "--recipes", "broken", "--recipes-dir", str(tmp_path / "d"), *SMALL,
                   "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == EXIT_GATE_REJECTED_ALL and "Traceback" not in done.stderr, done.stderr
    doc = json.loads(done.stdout)
    assert doc["before"] == [] and doc["attribution_before"] == {} and doc["status"] == "rejected"
    assert "raised SyntaxError" in doc["fusion"]["gate"]["recipes"]["broken"]["reason"]


def test_auto_leaves_a_broken_user_recipe_out_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    module_file(tmp_path / "code", "raising_fusion", "raise ImportError('needs a newer triton')\n")
    user_recipe(tmp_path / "d", "rmsnorm", "broken", fusion="raising_fusion:rmsnorm")
    result = CliRunner().invoke(cli, ["apply-fusion", "--recipes-dir", str(tmp_path / "d"), *SMALL, "--min-share", "0",
                                      "--runs-dir",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    fusion = json.loads(result.stdout)["fusion"]
    assert "broken" in fusion["rolled_back"] and "broken" not in fusion["applied"] and fusion["applied"]
    assert "needs a newer triton" in fusion["gate"]["recipes"]["broken"]["reason"]
    assert all(p["recipe"] != "broken" for ps in fusion["proposals"].values() for p in ps)


def test_recipes_verify_counts_a_recipe_whose_code_fails_as_its_real_kernel_rejected(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    module_file(tmp_path / "code", "exiting_fusion", "import sys\nsys.exit(0)\n")
    user_recipe(tmp_path / "d", "rmsnorm", "broken", fusion="exiting_fusion:rmsnorm")
    result = CliRunner().invoke(cli, ["recipes", "verify", "broken", "--recipes-dir", str(tmp_path / "d"), "--model",
                                      "tiny-llama", "--concurrency", "1", "--prompt-len", "8", "--max-len", "32",
                                      "--gate-steps", "2", "--json", "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 1 and "real kernels rejected: broken" in result.stderr, result.output
    real = json.loads(result.stdout)["recipes"]["broken"]["real"]
    assert "importing exiting_fusion called sys.exit(0)" in real


# Fuzzing --------------------------------------------------------------------------------------------------------------

def toml_key(key: str) -> str:
    return json.dumps(key)  # a quoted key, any characters


def toml_value(value) -> str:
    """A TOML literal for a Python value: JSON's string escapes are TOML's basic string's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


toml_values = st.recursive(
    st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1) | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)
recipe_keys = st.sampled_from(["name", "summary", "fusion", "tolerance", "architectures", "exclude", "replaces",
                               "tolerence", "fixes", "patch"]) | st.text(max_size=10)
names = st.sampled_from(["rmsnorm", "auto", "", "a,b", "mine", "swiglu"]) | st.text(max_size=70)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.dictionaries(recipe_keys, toml_values, max_size=4), name=names,
       replaces=st.none() | names, depth=st.integers(0, 5000), padding=st.integers(0, 3))
def test_fuzzed_recipe_files_load_or_are_one_line(tmp_path, overrides, name, replaces, depth, padding):
    """Any top-level fields over the rmsnorm recipe, any name and ``replaces``, a value nested ``depth`` arrays deep
    and files up to a few times the size limit: the catalog loads, or says why in one OptiqError line."""
    top = {"name": name, **({"replaces": replaces} if replaces is not None else {}), **overrides}
    head = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in top.items() if k not in ("fixes", "patch"))
    body = "\n".join(line for line in RMSNORM.splitlines() if not line.startswith(("name =", "summary =")))
    nested = f"deep = {'[' * depth}{']' * depth}\n" if depth else ""
    text = head + 'summary = "s"\n' + nested + "# " + "x" * (padding * MAX_RECIPE_BYTES // 2) + "\n" + body
    directory = tmp_path / "fuzz"
    directory.mkdir(exist_ok=True)
    (directory / "fuzzed.toml").write_text(text)
    try:
        catalog = load_catalog([str(directory)])
    except OptiqError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(recipe.name.strip() and "," not in recipe.name and recipe.name != "auto"
                   for recipe in catalog.values())
