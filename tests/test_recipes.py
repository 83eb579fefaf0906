"""The catalog loads and explains itself; malformed user recipes are rejected with the file, the field and why."""

import importlib
from importlib import resources
import json
import shutil

import pytest
from click.testing import CliRunner

from optiq.cli import cli
from optiq.errors import OptiqError
from optiq.catalog.recipes import load_catalog

BUILTIN = {"decode_attention", "rmsnorm", "add_rmsnorm", "swiglu", "gate_up_swiglu", "qkv_proj", "rope", "greedy_sample",
           "moe_experts", "mla_decode", "moe_router", "precision_flip", "attention_prologue", "decode_linear",
           "sandwich_norm", "hyper_connection", "grouped_linear", "trailing_rope", "indexer_scores", "compressor_pool"}


def test_builtin_catalog_and_fusion_paths_resolve():
    catalog = load_catalog()
    assert set(catalog) == BUILTIN
    for recipe in catalog.values():
        module, attribute = recipe.fusion.split(":")
        assert callable(getattr(importlib.import_module(module), attribute)), recipe.name
        home = {"moe_experts": "qwen3_moe", "moe_router": "qwen3_moe", "mla_decode": "deepseek_v2",
                "precision_flip": "deepseek_v2", "compressor_pool": "deepseek_v4"}
        assert recipe.applies_to(home.get(recipe.name, "llama"))


def _user_recipe(tmp_path, name="my_norm", **replace):
    text = resources.files("optiq.builtin_recipes").joinpath("rmsnorm.toml").read_text()
    text = text.replace('name = "rmsnorm"', f'name = "{name}"')
    for old, new in replace.items():
        assert old in text or old.startswith("+"), old
        text = text + new if old.startswith("+") else text.replace(old, new)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("change", "message"), [
    ({'tolerance = "exact_order"': ""}, "'tolerance' is missing"),
    ({'tolerance = "exact_order"': 'tolerance = "close enough"'}, "'tolerance' must be one of"),
    ({'op_classes = [': 'op_classes = ["bogus", '}, "unknown classes ['bogus']"),
    ({'fusion = "optiq.fusions.rmsnorm:rmsnorm"': 'fusion = "fusions/rmsnorm.py"'}, "'fusion' must be an import path"),
    ({'kind = "module_forward"': 'kind = "monkey"'}, "'patch.kind' must be one of"),
    ({"kernels_saved_per_layer = 14": 'kernels_saved_per_layer = "many"'}, "'fixes.kernels_saved_per_layer' must be"),
    ({"[patch]": "[patch"}, "not valid TOML"),
    ({"+names": "names = \"q_norm\"\n"}, "'patch.names' must be a list of strings"),
    ({'kind = "module_forward"': 'kind = "function"', 'modules = [': 'function = "rms_norm"\nmodules = [',
      "+names": 'names = ["q_norm"]\n'}, "'patch.names' narrows a module_forward patch only"),
])
def test_malformed_recipe_names_file_field_and_why(tmp_path, change, message):
    path = _user_recipe(tmp_path, **change)
    with pytest.raises(OptiqError) as info:
        load_catalog([str(tmp_path)])
    assert str(path) in str(info.value) and message in str(info.value)


def test_user_recipes_add_and_replace_a_builtin_only_when_they_say_so(tmp_path):
    _user_recipe(tmp_path, "my_norm")
    _user_recipe(tmp_path, "rmsnorm", **{"kernels_saved_per_layer = 14": "kernels_saved_per_layer = 3"})
    with pytest.raises(OptiqError, match="recipe name 'rmsnorm' is a built-in recipe's; .*replaces = \"rmsnorm\""):
        load_catalog([str(tmp_path)])
    _user_recipe(tmp_path, "rmsnorm", **{"kernels_saved_per_layer = 14": "kernels_saved_per_layer = 3",
                                         "summary = ": 'replaces = "rmsnorm"\nsummary = '})
    catalog = load_catalog([str(tmp_path)])
    assert "my_norm" in catalog and catalog["rmsnorm"].kernels_saved_per_layer == 3
    assert list(catalog).index("rmsnorm") == list(load_catalog()).index("rmsnorm")  # in the built-in's place


def test_two_user_files_with_one_name_are_refused(tmp_path):
    _user_recipe(tmp_path, "twin")
    shutil.copy(tmp_path / "twin.toml", tmp_path / "twin_copy.toml")
    with pytest.raises(OptiqError, match="also used by"):
        load_catalog([str(tmp_path)])


def test_recipes_cli(tmp_path):
    runner = CliRunner()
    listing = runner.invoke(cli, ["recipes", "--json"])
    assert listing.exit_code == 0 and {r["name"] for r in json.loads(listing.stdout)} == BUILTIN
    shown = runner.invoke(cli, ["recipes", "show", "decode_attention"])
    assert shown.exit_code == 0 and "attention_interface" in shown.stdout and "repeat_kv" in shown.stdout
    missing = runner.invoke(cli, ["recipes", "show", "nope"])
    assert missing.exit_code == 1 and "no recipe 'nope'" in missing.stderr
    bad_dir = runner.invoke(cli, ["recipes", "--recipes-dir", str(tmp_path / "absent")])
    assert bad_dir.exit_code == 1 and "not found" in bad_dir.stderr
