"""Mutation testing of the gate: every mutant of every built-in kernel is rejected, the real kernels are kept, and a
gate too loose to tell is caught by the score."""

import json

import pytest
import torch
from click.testing import CliRunner

import optiq.gate.end_to_end as gate_end_to_end
import optiq.gate.rules as rules
from optiq.cli import cli
from optiq.fusions.linear import linear, linear_reference
from optiq.fusions.rmsnorm import rmsnorm
from optiq.gate.mutants import mutants


def _verify(tmp_path, *args):
    result = CliRunner().invoke(cli, ["recipes", "verify", "--mutants", "--json", "--runs-dir", str(tmp_path), *args])
    document = json.loads(result.stdout[result.stdout.index("{"):]) if "{" in result.stdout else None
    return result, document


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_every_mutant_of_every_builtin_kernel_is_killed(tmp_path, preset):
    result, document = _verify(tmp_path, "--model", preset)
    assert result.exit_code == 0, result.output
    verified = {n: r for n, r in document["recipes"].items() if isinstance(r, dict)}
    assert len(verified) >= 8, document["recipes"]
    for name, recipe in verified.items():
        assert recipe["real"] == "passed", (name, recipe["real"])
        assert recipe["score"] == 1.0, (name, [m for m in recipe["mutants"] if m["status"] == "survived"])
        counted = [m for m in recipe["mutants"] if m["status"] != "unchanged"]
        assert len(counted) >= 4 and all(m["reason"] for m in counted), (name, recipe["mutants"])
    # written as they were produced, in the run directory
    kept = json.loads(next(tmp_path.glob("verify-*/verify.json")).read_text())
    assert kept["recipes"].keys() == document["recipes"].keys()


def test_a_gate_too_loose_to_tell_is_caught_by_the_score(tmp_path, monkeypatch):
    """Bounds that pass almost anything: the mutants that change the function survive, and the command says so."""
    monkeypatch.setitem(rules.GATE, "exact_order", (1e9, 1e9))
    monkeypatch.setattr(gate_end_to_end, "end_to_end_bounds", lambda *args: (float("inf"), 0.0))
    result, document = _verify(tmp_path, "--model", "tiny-llama", "rmsnorm")
    assert result.exit_code == 1 and "survived the gate" in result.output
    statuses = {m["name"]: m["status"] for m in document["recipes"]["rmsnorm"]["mutants"]}
    assert statuses["eps forgotten"] == "survived" and statuses["rows 0 and 1 swapped"] == "survived"
    assert document["recipes"]["rmsnorm"]["score"] < 0.5


def test_the_mutants_follow_the_kernels_parameters():
    assert {"eps forgotten", "weight forgotten", "last row stale"} <= {m.name for m in mutants(rmsnorm)}
    assert "split-K partials in the input dtype" not in {m.name for m in mutants(rmsnorm)}
    assert {"bias forgotten", "split-K partials in the input dtype"} <= {m.name for m in mutants(linear)}
    assert "length - 1" not in {m.name for m in mutants(linear)}


def test_a_mutant_that_changes_nothing_is_not_counted():
    touched = []
    forgotten = next(m for m in mutants(linear) if m.name == "bias forgotten").wrap(linear, touched)
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(forgotten(x, weight), linear(x, weight)) and not any(touched)
    bias = torch.randn(4)
    assert not torch.allclose(forgotten(x, weight, bias), linear(x, weight, bias)) and any(touched)


def test_split_k_in_bf16_has_more_error_than_fp32_accumulation():
    """The mutant stands for its bug class: partial sums rounded to bf16 move the result by several bf16 roundings,
    an fp32-accumulating kernel (torch's, here: the interpreter rounds bf16 by truncation) by about one."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 512, generator=generator).bfloat16()
    weight = (torch.randn(64, 512, generator=generator) * 0.05).bfloat16()
    exact = x.double() @ weight.double().T
    split = next(m for m in mutants(linear) if m.name.startswith("split-K")).wrap(linear_reference, [])
    ratio = ((split(x, weight).double() - exact).norm() / (linear_reference(x, weight).double() - exact).norm()).item()
    assert ratio > rules.GATE["reassociation"][0], ratio
