"""Hostile and careless checkpoint directories: each is refused before anything is built or measured, in one line
naming the file and the reason, through the CLI with exit 1 and no traceback; a real GPT-2 saved with its weights
loads and is measured. Fuzzed config.json documents (random fields, types, nesting depth and size) never get past
the checks as anything but an OptiqError or a config."""

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, BertConfig, BertForMaskedLM, GPT2Config, LlamaConfig

from optiq.cli import cli
from optiq.errors import OptiqError
from optiq.models import MAX_LAYERS, checkpoint_config, load_config, load_model, random_model

TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=128)
BENCH = ["--prompt-len", "8", "--new-tokens", "2", "--max-len", "32", "--repeats", "1", "--concurrency", "1"]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A small Llama saved with its weights (safetensors), the base most hostile variants are made from."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    return path


def variant(llama_checkpoint, tmp_path, config_text: str | bytes | None = None, weights: bytes | None = None):
    """A copy of the llama checkpoint with config.json's text and/or model.safetensors' bytes replaced."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((llama_checkpoint / name).read_bytes())
    if config_text is not None:
        data = config_text.encode() if isinstance(config_text, str) else config_text
        (tmp_path / "config.json").write_bytes(data)
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    return tmp_path


def edited_config(llama_checkpoint, **fields) -> str:
    config = json.loads((llama_checkpoint / "config.json").read_text())
    config.update(fields)
    return json.dumps({k: v for k, v in config.items() if v is not ...})


def refused(path, message: str):
    with pytest.raises(OptiqError, match=message) as info:
        load_model(str(path), torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("config_text, message", [
    ("", "config.json is empty"),
    ("   \n", "config.json is empty"),
    (b"\xff\xfe{}", "config.json is not UTF-8 text"),
    ('{"model_type": "llama", ', "config.json is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "config.json is not valid JSON \\(nested too deeply\\)"),
    ('["llama"]', "must hold a JSON object, not list"),
    ("{}", "has no model_type"),
    ('{"model_type": 7}', "has no model_type"),
    ('{"model_type": "llama-9000"}', "knows no model type 'llama-9000'"),
])
def test_a_broken_config_json_is_one_line(llama_checkpoint, tmp_path, config_text, message):
    refused(variant(llama_checkpoint, tmp_path, config_text), message)


@pytest.mark.parametrize("fields, message", [
    ({"num_hidden_layers": "two"}, "field 'num_hidden_layers' must be an integer, not \"two\""),
    ({"hidden_size": 32.5}, "field 'hidden_size' must be an integer, not 32.5"),
    ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be a boolean"),
    ({"rms_norm_eps": [1e-6]}, "field 'rms_norm_eps' must be a number"),
    ({"hidden_act": 3}, "field 'hidden_act' must be a string"),
    ({"num_hidden_layers": 10 ** 9}, f"num_hidden_layers must be an integer from 1 to {MAX_LAYERS}"),
    ({"num_hidden_layers": 0}, f"num_hidden_layers must be an integer from 1 to {MAX_LAYERS}"),
    ({"hidden_size": -32}, "llama does not build from its config"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}, "optiq never runs a checkpoint's code"),
    ({"model_type": "bert"}, "'bert' is an encoder \\(it has a masked-LM head\\)"),
    ({"model_type": "vit"}, "'vit' is not a causal language model"),
    ({"model_type": "t5"}, "'t5' is not a causal language model"),
    ({"model_type": "gemma3"}, "'gemma3' wraps a text model in a multimodal one"),
    ({"hidden_size": 4096}, "its weights hold [0-9,]+ values, but its config.json describes a model of"),
    ({"model_type": "qwen3_moe", "num_experts": 10 ** 6}, "the number of experts must be an integer up to 4096"),
])
def test_a_config_of_the_wrong_kind_or_type_is_refused_up_front(llama_checkpoint, tmp_path, fields, message):
    refused(variant(llama_checkpoint, tmp_path, edited_config(llama_checkpoint, **fields)), message)


def test_a_truncated_or_foreign_weight_file_is_refused(llama_checkpoint, tmp_path):
    whole = (llama_checkpoint / "model.safetensors").read_bytes()
    refused(variant(llama_checkpoint, tmp_path, weights=whole[:len(whole) // 2]), "model.safetensors is truncated")
    refused(variant(llama_checkpoint, tmp_path, weights=whole[:5]), "not a safetensors file")
    refused(variant(llama_checkpoint, tmp_path, weights=struct.pack("<Q", 1 << 40) + b"{}"),
            "not a safetensors file, or is truncated")
    refused(variant(llama_checkpoint, tmp_path, weights=struct.pack("<Q", 4) + b"\xff\xff\xff\xff"),
            "its header is not JSON")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "shard-2.safetensors"}}')
    refused(tmp_path, "lacks the weight file shard-2.safetensors")


def test_a_config_that_is_no_regular_file_is_never_opened(llama_checkpoint, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((llama_checkpoint / "model.safetensors").read_bytes())
    os.mkfifo(tmp_path / "config.json")  # opening it for reading would wait for a writer forever
    refused(tmp_path, "config.json is not a regular file")


def test_a_checkpoint_without_weights_is_one_line(llama_checkpoint, tmp_path):
    (tmp_path / "config.json").write_bytes((llama_checkpoint / "config.json").read_bytes())
    refused(tmp_path, f"cannot load checkpoint {tmp_path}: ")


def test_a_model_larger_than_free_memory_is_one_line_before_anything_is_allocated():
    """~1 TB of weights (what a shrunken config whose validators reject the tiny widths can still describe): refused
    from a count on the meta device, not killed by the kernel while drawing its weights."""
    config = LlamaConfig(hidden_size=16384, intermediate_size=65536, num_hidden_layers=64, num_attention_heads=128,
                         num_key_value_heads=8, vocab_size=256)
    with pytest.raises(OptiqError, match=r"llama's weights take \d+\.\d GiB in float32, more than the .* free on cpu"):
        random_model(config, torch.float32, torch.device("cpu"))


def test_empty_model_spec_is_not_the_working_directory():
    with pytest.raises(OptiqError, match="unknown model ''"):
        load_config("")


def test_a_real_bert_with_weights_is_refused_saying_it_is_an_encoder(tmp_path):
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=128)).save_pretrained(tmp_path)
    message = refused(tmp_path, "'bert' is an encoder")
    assert "decoder-only" in message
    result = CliRunner().invoke(cli, ["bench", "--model", str(tmp_path), *BENCH, "--runs-dir", str(tmp_path / "r")])
    assert result.exit_code == 1 and "'bert' is an encoder" in result.stderr
    assert "Traceback" not in result.output


def test_a_real_gpt2_with_weights_just_works(tmp_path):
    """GPT-2 (learned positions, Conv1D projections, a fused QKV) from a checkpoint: loaded with its weights and
    measured by bench."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)) \
        .save_pretrained(tmp_path / "gpt2")
    model = load_model(str(tmp_path / "gpt2"), torch.float32, torch.device("cpu"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters()))
    result = CliRunner().invoke(cli, ["bench", "--model", str(tmp_path / "gpt2"), *BENCH, "--json", "--runs-dir",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert [row["status"] for row in json.loads(result.stdout)["before"]] == ["ok"]


def test_a_broken_checkpoint_through_the_cli_is_exit_1_without_a_traceback(llama_checkpoint, tmp_path):
    """A subprocess, as a user runs it: one line on stderr, exit 1, and no run left behind marked running."""
    (tmp_path / "ckpt").mkdir()
    broken = variant(llama_checkpoint, tmp_path / "ckpt", edited_config(llama_checkpoint, num_hidden_layers="two"))
    done = subprocess.run([sys.executable, "-m", "optiq", "apply-fusion", "--model", str(broken), "--recipes",
                           "rmsnorm", *BENCH, "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "field 'num_hidden_layers' must be an integer" in done.stderr
    for run_json in (tmp_path / "runs").glob("*/run.json"):
        assert json.loads(run_json.read_text())["status"] == "failed"


# A config.json's values: any JSON, nested up to a few levels, with strings and numbers that hit the checks' edges.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
config_fields = st.sampled_from(["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size", "intermediate_size", "rms_norm_eps",
                                 "tie_word_embeddings", "hidden_act", "rope_parameters", "auto_map",
                                 "max_position_embeddings", "bos_token_id", "architectures", "layer_types"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(config_fields | st.text(max_size=12), json_values, max_size=8),
       model_type=st.sampled_from(["llama", "gpt2", "bert", "qwen3", "t5", "", "nope"]),
       depth=st.integers(0, 3000))
def test_fuzzed_config_json_is_a_config_or_one_line(llama_checkpoint, tmp_path, fields, model_type, depth):
    """Fields of any JSON type over a real config of a few model types, optionally buried under ``depth`` nested
    arrays: the result is a config or an OptiqError, never another exception."""
    document = {**json.loads((llama_checkpoint / "config.json").read_text()), "model_type": model_type, **fields}
    text = json.dumps(document, allow_nan=True)
    if depth:
        text = f'{{"nested": {"[" * depth}{"]" * depth}, {text[1:]}'
    directory = tmp_path / "fuzz"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(text)
    try:
        checkpoint_config(directory)
    except OptiqError as exc:
        assert "\n" not in str(exc)
