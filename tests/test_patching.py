"""Patching: every built-in recipe applies to the tiny presets and keeps their logits; undo restores the very objects."""

import sys

import pytest
import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from optiq import engine as decode_engine
from optiq.engine import opened
from optiq.errors import OptiqError
from optiq.patching import apply, patches_of, unpatch
from optiq.catalog.recipes import load_catalog
from wrong_kernels import user_recipe


def decode(model, steps=3, batch=2):
    """Logits of ``steps`` greedy decode steps after a short seeded prompt."""
    with opened(model, batch, 16) as engine:
        engine.prefill(torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(0)))
        return torch.stack([engine.step().clone() for _ in range(steps)])


def bindings(model):
    """Every object a patch may rebind: instance forwards, modeling functions, registries, attention choice."""
    modeling = sys.modules[type(model).__module__]
    return ({name: vars(m).get("forward") for name, m in model.named_modules()}, modeling.apply_rotary_pos_emb,
            dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping),
            model.config._attn_implementation)


@pytest.mark.parametrize("rival", ["attention_prologue", "qkv_proj"])
def test_builtin_recipes_keep_logits_and_undo_restores_everything(tiny_model, rival):
    """Every recipe at once (gate_up_swiglu rather than swiglu, moe_router rather than its lossy rival
    precision_flip; of qkv_proj and attention_prologue, which patch the same module, the one that is not
    ``rival``)."""
    catalog = load_catalog()
    before, reference = bindings(tiny_model), decode(tiny_model)
    patches = apply(tiny_model, [r for name, r in catalog.items() if name not in ("swiglu", "precision_flip", rival)])
    applied = {row["recipe"]: row for row in patches.summary() if row["status"] == "applied"}
    attention = {"qkv_proj"} if rival == "attention_prologue" else {"attention_prologue"}
    assert {"rmsnorm", "add_rmsnorm", "rope", "decode_attention", "greedy_sample", "decode_linear"} | attention <= \
        set(applied)
    assert applied["rmsnorm"]["modules"] >= 5 and applied["decode_attention"]["interfaces"] == 1
    layers = tiny_model.config.num_hidden_layers
    o_projs = {f"model.layers.{i}.self_attn.o_proj" for i in range(layers)}
    down_projs = {name for name, module in tiny_model.named_modules()
                  if type(module) is torch.nn.Linear and name.endswith(".mlp.down_proj")}  # MoE experts are not Linear
    assert set(applied["decode_linear"]["sites"]) == o_projs | down_projs
    assert tiny_model.config._attn_implementation == "optiq_decode"
    params = {name: p.data_ptr() for name, p in tiny_model.named_parameters()}

    patched = decode(tiny_model)
    torch.testing.assert_close(patched, reference, rtol=1e-5, atol=1e-5)
    assert {name: p.data_ptr() for name, p in tiny_model.named_parameters()} == params

    unpatch(tiny_model)
    after = bindings(tiny_model)
    assert after[0] == before[0] and all(f is None for f in after[0].values())
    assert after[1] is before[1] and after[2] == before[2] and after[3] == before[3] and after[4] == before[4]
    assert patches_of(tiny_model) is None
    assert torch.equal(decode(tiny_model), reference)


@pytest.mark.parametrize("with_decode_linear", [True, False])
def test_the_residual_add_after_the_mlp_goes_into_down_projs_kernel(monkeypatch, with_decode_linear):
    """With add_rmsnorm, gate_up_swiglu and decode_linear, each layer hands its residual to the MLP and the MLP to
    down_proj's kernel; without decode_linear the MLP adds it as HF does. The logits stay the unpatched ones."""
    import optiq.patching.replacements.decoder_layer as decoder_layer
    import optiq.patching.replacements.mlp as mlp
    from optiq.models import load_model

    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    reference = decode(model)
    names = ["add_rmsnorm", "gate_up_swiglu"] + (["decode_linear"] if with_decode_linear else [])
    patches = apply(model, [load_catalog()[n] for n in names])
    handed = []
    for module in (decoder_layer, mlp):
        spy = (lambda real: lambda m, x, residual=None: handed.append(
            (type(m).__name__, residual is not None and getattr(m.forward, "takes_residual", False)))
            or real(m, x, residual))(module.plus_residual)
        monkeypatch.setattr(module, "plus_residual", spy)
    patched = decode(model, steps=1)
    layers = model.config.num_hidden_layers * 2  # the prefill's forward, then the step's
    assert handed.count(("LlamaMLP", True)) == layers
    assert handed.count(("Linear", True)) == (layers if with_decode_linear else 0)
    torch.testing.assert_close(patched[0], reference[0], rtol=1e-5, atol=1e-5)
    unpatch(model)


def test_swiglu_and_the_engine_s_sampler(tmp_path):
    """greedy_sample patches the engine's sampler function (optiq.engine.sample_greedy), which every engine's steps
    look up; undoing it puts torch's argmax back."""
    from optiq.models import load_model

    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    reference = decode(model)
    catalog = load_catalog()
    plain = decode_engine.sample_greedy
    patches = apply(model, [catalog["swiglu"], catalog["greedy_sample"]])
    assert decode_engine.sample_greedy is not plain and patches.summary()[1]["functions"] == 1
    torch.testing.assert_close(decode(model), reference, rtol=1e-5, atol=1e-5)
    patches.undo("greedy_sample")
    assert decode_engine.sample_greedy is plain and "swiglu" in patches.applied
    patches.undo()
    assert "forward" not in vars(model.model.layers[0].mlp)


def test_not_applicable_is_reported_with_the_reason():
    from optiq.models import load_model

    model = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["swiglu"]])  # every MLP of this preset is experts: no gated MLP module
    assert patches.applied == {} and "gated_mlp" in patches.not_applicable["swiglu"]
    assert "forward" not in vars(model.model.layers[0].mlp)


def test_two_recipes_on_one_module_class_are_refused():
    from optiq.models import load_model

    catalog = load_catalog()
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    with pytest.raises(OptiqError, match="'gate_up_swiglu' and 'swiglu' both patch the module structure gated_mlp"):
        apply(model, [catalog["gate_up_swiglu"], catalog["swiglu"]])
    assert patches_of(model) is None and "forward" not in vars(model.model.layers[0].mlp)


@pytest.mark.parametrize("field, path", [("fusion", "optiq.fusions.rmsnorm:no_such_kernel"),
                                         ("with_", "optiq.no_such_module:rmsnorm_forward")])
def test_an_import_path_that_does_not_resolve_fails_that_recipe_alone(tmp_path, field, path):
    from optiq.models import load_model

    recipe = user_recipe(tmp_path, "rmsnorm", "my_norm", **{field: path})
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    shown = "patch.with" if field == "with_" else "fusion"
    patches = apply(model, [recipe])
    assert list(patches.failed) == ["my_norm"] and not patches.applied
    assert patches.failed["my_norm"][1].startswith(f"recipe 'my_norm': {shown} '{path}' does not resolve")
    assert patches_of(model) is None


def test_the_fused_sampler_is_in_the_profiled_step(tmp_path):
    """apply-fusion's after-profile runs the sampler its timed runs run (the fused one, not torch's argmax), and the
    profile's annotation of it is taken off again."""
    import gzip
    import json

    from optiq.models import load_model
    from optiq.profiling.capture import profile_step

    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["greedy_sample"]])
    fused = decode_engine.sample_greedy
    profile_step(model, 2, 8, 32, "eager", tmp_path, 2)
    names = {e.get("name", "") for e in json.load(gzip.open(tmp_path / "trace_eager_C2.json.gz"))["traceEvents"]}
    assert any("greedy_sample" in n for n in names) and not any(n == "aten::argmax" for n in names)
    assert decode_engine.sample_greedy is fused
    unpatch(model)


def test_an_opened_engine_is_released_even_when_its_block_fails():
    from optiq.models import load_model

    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="the block failed"), opened(model, 2, 16) as engine:
        raise RuntimeError("the block failed")
    assert engine.cache is None
