"""Proposals rank the catalog against real H200 attribution tables, without double counting."""

import dataclasses
from pathlib import Path

import pytest

from optiq.traces.attribution import weighted_kernels
from optiq.catalog.proposals import propose, with_sites
from optiq.catalog.recipes import load_catalog
from optiq.traces.reader import read_trace

TRACES = Path(__file__).parent.parent / "traces"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _kernels(name):
    return weighted_kernels([read_trace(TRACES / name)])


def test_decode_attention_first_for_llama_at_c64(catalog):
    kernels = _kernels("llama-3.1-8b_eager_C64.json.gz")
    proposals = propose(catalog, kernels, "llama")
    first = proposals[0]
    assert first.recipe == "decode_attention"
    assert first.covered_pct > 80 and "copy_ in repeat_kv" in first.where
    # Each kernel counts for one recipe: the savings add up to at most the whole step.
    total_ms = float((kernels["dur"] * kernels["w"]).sum()) / 1e3
    assert sum(p.covered_ms_per_step for p in proposals) <= total_ms * (1 + 1e-9)
    names = [p.recipe for p in proposals]
    assert "swiglu" not in names  # it patches the MLP that gate_up_swiglu, ranked higher, already patches


def test_graph_trace_aligned_gives_the_same_first_proposal(catalog):
    from optiq.traces.attribution import align_graph_with_eager

    graph = read_trace(TRACES / "llama-3.1-8b_graph_C64.json.gz")
    align_graph_with_eager(graph, read_trace(TRACES / "llama-3.1-8b_eager_C64.json.gz"))
    assert propose(catalog, weighted_kernels([graph]), "llama")[0].recipe == "decode_attention"


def test_recipes_for_other_architectures_are_not_proposed(catalog):
    proposals = propose(catalog, _kernels("qwen3-30b-a3b_eager_C64.json.gz"), "qwen3_moe")
    names = [p.recipe for p in proposals]
    assert names[0] == "decode_attention"
    assert "gate_up_swiglu" not in names and "swiglu" not in names  # dense-MLP recipes; qwen3_moe is not theirs
    # A model type no recipe names gets the recipes that list no architectures (they find their sites by structure,
    # and the gate decides), and one a recipe excludes does not get it.
    unlisted = {r.name for r in catalog.values() if "*" in r.architectures}
    got = [p.recipe for p in propose(catalog, _kernels("qwen3-0.6b_eager_C1.json.gz"), "gemma3")]
    assert "decode_attention" in got and "rmsnorm" in got and set(got) <= unlisted, got
    excluding = {**catalog, "rmsnorm": dataclasses.replace(catalog["rmsnorm"], excluded=("gemma3",))}
    assert "rmsnorm" not in [p.recipe for p in propose(excluding, _kernels("qwen3-0.6b_eager_C1.json.gz"), "gemma3")]


def test_analyze_prints_proposals_for_a_model_type():
    import json

    from click.testing import CliRunner

    from optiq.cli import cli

    result = CliRunner().invoke(cli, ["analyze", str(TRACES / "llama-3.1-8b_eager_C64.json.gz"), "--proposals",
                                      "llama", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["proposals"][0]["recipe"] == "decode_attention"


def test_input_norms_stay_with_rmsnorm_when_add_rmsnorm_takes_the_post_attention_norm(catalog, tmp_path):
    """add_rmsnorm fuses the post-attention norm only, so the input norms it leaves to HF stay proposable by rmsnorm:
    a fresh profile (post_attn_norm is its own role) proposes both, and their savings do not overlap."""
    import torch

    from optiq.models import load_model
    from optiq.profiling.capture import profile_step

    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    kernels = weighted_kernels([profile_step(model, 2, 8, 32, "eager", tmp_path, 2)])
    proposals = {p.recipe: p for p in propose(catalog, kernels, "llama")}
    assert {"rmsnorm", "add_rmsnorm"} <= set(proposals)
    assert "in norm" in proposals["rmsnorm"].where and "in norm" not in proposals["add_rmsnorm"].where
    assert {"norm", "post_attn_norm"} <= set(kernels["role"])


def test_the_router_is_proposed_once_although_two_recipes_patch_it(catalog, tmp_path):
    """DeepSeek-V2's router is patched by moe_router and by precision_flip, which also takes its GEMM: the larger
    is proposed, the other shares its claim and is dropped, and auto never picks both, whatever each concurrency
    ranks first."""
    import torch

    from optiq.catalog.proposals import choose_recipes
    from optiq.models import load_model
    from optiq.profiling.capture import profile_step

    model = load_model("tiny-deepseek-v2", torch.float32, torch.device("cpu"))
    kernels = weighted_kernels([profile_step(model, 2, 8, 32, "eager", tmp_path, 2)])
    names = [p.recipe for p in propose(catalog, kernels, "deepseek_v2")]
    assert "precision_flip" in names and "moe_router" not in names
    both = {1: [_named("moe_router", 5.0)], 64: [_named("precision_flip", 9.0)]}
    assert choose_recipes("auto", catalog, both, min_share=1.0) == ["precision_flip"]


def test_moe_router_takes_the_routing_of_the_h200_moe_trace(catalog):
    """Qwen3-MoE's router computes its logits in the model's dtype: given the model, precision_flip has no site there
    and is not proposed, so moe_router takes the routing (with no model, a foreign trace's reader, the flip would)."""
    import torch

    from optiq.models import load_model

    model = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    kernels = _kernels("qwen3-30b-a3b_eager_C1.json.gz")
    proposals = {p.recipe: p for p in propose(with_sites(catalog, model), kernels, "qwen3_moe")}
    assert "routing in moe_router" in proposals["moe_router"].where and proposals["moe_router"].kernels_per_step > 48
    assert "precision_flip" not in proposals
    assert "precision_flip" in {p.recipe for p in propose(catalog, kernels, "qwen3_moe")}


def _named(recipe, pct):
    from optiq.catalog.proposals import Proposal

    return Proposal(recipe, 0.0, pct, 0.0, "", "")


def test_attention_prologue_outranks_qkv_proj_and_takes_the_qk_norms(catalog, tmp_path):
    """On a fresh Qwen3-MoE profile the prologue covers the projections, q/k norms (their own role now), RoPE and the
    cache write; qkv_proj patches the same module and is dropped, rmsnorm keeps the input norms."""
    import torch

    from optiq.models import load_model
    from optiq.profiling.capture import profile_step

    model = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    kernels = weighted_kernels([profile_step(model, 2, 8, 32, "eager", tmp_path, 2)])
    proposals = {p.recipe: p for p in propose(catalog, kernels, "qwen3_moe")}
    assert "attention_prologue" in proposals and "qkv_proj" not in proposals and "rope" not in proposals
    assert "qk_norm" in set(kernels["role"])
    assert "in norm" in proposals["rmsnorm"].where and "qk_norm" not in proposals["rmsnorm"].where


def test_v4_attention_copies_go_to_decode_attention_not_to_the_compressor_pool(catalog):
    """In DeepSeek-V4-Flash's eager C = 64 step the sparse attention's key and value gathers (copy_ in attention,
    ~40% of the step) are decode_attention's to replace; the compressor's pooling runs in the same role and must
    not claim them (it did, and decode_attention was left out of the V4-Flash row of session 25)."""
    import torch

    from optiq.models import load_model

    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    proposals = {p.recipe: p for p in propose(with_sites(catalog, model),
                                              _kernels("deepseek-v4-flash_eager_C64.json.gz"), "deepseek_v4")}
    assert proposals["decode_attention"].covered_pct > 30 and "copy_ in attention" in proposals["decode_attention"].where
    assert "compressor_pool" in proposals and "copy_" not in proposals["compressor_pool"].where

