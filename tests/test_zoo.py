"""The zoo: transformers' decoder-only text model types, shrunk; the committed sweep table covers the installed
transformers' types; a fast subset of the sweep runs here (the whole sweep is ``python scripts/zoo_sweep.py``)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optiq.errors import OptiqError
from optiq.zoo import decoder_only_text_types, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def test_decoder_only_text_types_leave_out_encoders_seq2seq_and_wrappers():
    types = decoder_only_text_types()
    assert {"llama", "gemma3_text", "phi3", "mamba", "qwen3_next", "deepseek_v4", "gpt2"} <= set(types)
    assert not {"bert", "roberta", "bart", "whisper", "gemma3", "mllama"} & set(types)


def test_every_type_shrinks_or_says_why_in_one_line():
    for model_type in decoder_only_text_types():
        try:
            config = tiny_config(model_type)
        except OptiqError as exc:
            assert "\n" not in str(exc)
            continue
        assert config.num_hidden_layers <= 16, model_type  # one of each layer type, a few for patterned ones


def test_the_committed_table_covers_the_installed_zoo():
    """docs/zoo.md was swept over exactly the types this transformers has: rerun the sweep when it changes."""
    table = (ROOT / "docs" / "zoo.md").read_text()
    swept = set(re.findall(r"^\| ([\w-]+) \|", table, flags=re.M)) - {"---"}  # every row but the header's rule
    assert swept == set(decoder_only_text_types())


@pytest.mark.parametrize("model_type", ["phi3", "mamba"])
def test_sweep_subset(tmp_path, model_type):
    """Phi-3 (fused qkv_proj and gate_up_proj, its own module names) gets recipes kept by the gate; Mamba (no
    attention, its own cache) profiles in eager mode; neither ends in a traceback, and the decode is the model's."""
    out = tmp_path / "zoo"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "zoo_sweep.py"), "--types", model_type,
                           "--workers", "1", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert row["profile"]["ok"], row
    assert row["decode"]["error"] < 1e-4
    assert "TRACEBACK" not in json.dumps(row)
    if model_type == "phi3":
        assert {"rmsnorm", "decode_attention"} <= set(row["apply"]["kept"]), row
        assert row["decode"]["cache"] == "static"
    else:
        assert row["decode"]["cache"].startswith("its own")
    assert f"| {model_type} |" in out.with_suffix(".md").read_text()


def test_layers_sharing_keys_and_values_decode_on_a_static_cache(monkeypatch):
    """Gemma-3n's last layers read the keys and values of earlier ones (transformers gives them dummy cache layers,
    initialised and empty): the engine's static cache stores nothing for them, and its decode is the model's."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from zoo_sweep import check_decode

    from optiq.engine import static_layouts
    from optiq.models import load_model

    assert tiny_config("gemma3n_text").num_kv_shared_layers > 0
    layouts = static_layouts(load_model("tiny:gemma3n_text", torch.float32, torch.device("cpu")))
    assert None in layouts and any(layouts)
    checked = check_decode("gemma3n_text")
    assert checked["cache"] == "static" and checked["error"] < 1e-4, checked
