"""Sites found by what a module computes rather than by what its class is called, so a recipe applies to a model it
was not written for (Phi-3's, Gemma's or a user's norm) and the gate decides whether it stays.

A structure is a predicate on a module that returns what the replacement needs to know about the site, or None.
It looks at the module's parameters and attributes, then runs the module once on a float64 copy, with a random input
and random parameters, and compares the result with the structure's formula: a module that has the right parameters
but computes something else (another normalisation, an extra scale) does not match.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from transformers.modeling_utils import AttentionInterface

EPS_ATTRIBUTES = ("variance_epsilon", "eps")  # HF's names for a norm's epsilon
PROBE_ROWS = 4


@dataclass(frozen=True)
class NormSite:
    eps_attribute: str  # where the module keeps its epsilon (read at call time)
    offset: bool  # the weight is applied as 1 + w (Gemma), not w
    weight_first: bool = False  # w scales the fp32 normalised row before its one rounding (OLMo 2), not after (Llama)

    def rounding(self) -> dict:
        """The keyword arguments a norm fusion takes for this site's rounding order: none for Llama's and Gemma's,
        so a user's fusion without ``weight_first`` still serves those."""
        return {"weight_first": True} if self.weight_first else {}


def _output_like(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The module's output for ``x`` when it is one tensor of x's shape; None for anything else (a forward of
    another signature or output is another structure). Its class's forward runs, not one a recipe installed on the
    instance: the structure is what the model computes, whichever recipes were applied before."""
    try:
        with torch.no_grad():
            got = type(module).forward(module, x)
    except Exception:  # noqa: BLE001
        return None
    return got if isinstance(got, torch.Tensor) and got.shape == x.shape else None


def rms_norm(module: torch.nn.Module) -> NormSite | None:
    """An RMSNorm-like module: one weight vector and an eps, no other parameter or submodule, and output
    ``x * rsqrt(mean(x^2) + eps)`` scaled by ``w`` or by ``1 + w`` over the last dim."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1 or next(module.children(), None) is not None:
        return None
    eps_attribute = next((name for name in EPS_ATTRIBUTES if type(getattr(module, name, None)) in (int, float)), None)
    if eps_attribute is None:
        return None
    weight = params["weight"]
    probe = copy.deepcopy(module).to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[0], dtype=torch.float64, generator=generator).to(weight.device)
    with torch.no_grad():  # a weight of its own, never a constant one: with all ones, 2 x normed would pass as 1 + w
        probe.weight.copy_(0.5 + 0.2 * torch.randn(weight.shape, dtype=torch.float64, generator=generator))
    got = _output_like(probe, x)
    if got is None:
        return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(module, eps_attribute))
    w = probe.weight.detach()
    for offset, scale in ((False, w), (True, 1.0 + w)):
        # HF computes a norm in fp32 whatever its input: agreement to fp32's precision is a match
        if torch.allclose(got, normed * scale, rtol=1e-4, atol=1e-6):
            return NormSite(eps_attribute, offset, weight_first=not offset and _weight_first(module, eps_attribute))
    return None


def _weight_first(module: torch.nn.Module, eps_attribute: str) -> bool:
    """Whether a ``w``-scaled RMSNorm, run in bf16, multiplies its fp32 normalised row by the weight before rounding
    it once (OLMo 2's ``(w * normed).to(dtype)``) rather than rounding first (Llama's ``w * normed.to(dtype)``):
    which of the two its output on a bf16 probe is nearer, element by element. The two differ by a rounding, an
    error the gate sees in bf16."""
    weight = module.weight
    probe = copy.deepcopy(module).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(PROBE_ROWS, weight.shape[0], generator=generator).to(weight.device, torch.bfloat16)
    with torch.no_grad():
        probe.weight.copy_(0.5 + 0.2 * torch.randn(weight.shape, generator=generator))
    got = _output_like(probe, x)
    if got is None:
        return False
    acc, w = x.float(), probe.weight.detach()
    normed = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + getattr(module, eps_attribute))
    first, last = (w.float() * normed).to(torch.bfloat16), w * normed.to(torch.bfloat16)
    return bool((got != first).sum() < (got != last).sum())



@dataclass(frozen=True)
class GatedMlpSite:
    """Where a gated MLP keeps its projections: ``gate`` and ``up`` (or one ``fused`` [2I] projection, gate half
    first when ``gate_first``) and ``down``, as attribute names of the module; and its gate's activation (one of
    GATE_ACTIVATIONS)."""
    down: str
    gate: str = ""
    up: str = ""
    fused: str = ""
    gate_first: bool = True
    activation: str = "silu"

    def gate_up_weights(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up weight matrices [I, H] (views of a fused weight's halves)."""
        if not self.fused:
            return getattr(module, self.gate).weight, getattr(module, self.up).weight
        first, second = getattr(module, self.fused).weight.chunk(2)
        return (first, second) if self.gate_first else (second, first)

    def gate_up_biases(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.fused:
            gate, up = getattr(module, self.gate).bias, getattr(module, self.up).bias
            return None if gate is None else (gate, up)
        bias = getattr(module, self.fused).bias
        if bias is None:
            return None
        first, second = bias.chunk(2)
        return (first, second) if self.gate_first else (second, first)


GATE_ACTIVATIONS = {"silu": torch.nn.functional.silu,  # SwiGLU: Llama, Qwen, Mistral, Phi-3
                    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}  # GeGLU: Gemma


def gated_mlp(module: torch.nn.Module) -> GatedMlpSite | None:
    """A gated MLP: ``down(act(gate(x)) * up(x))`` over nn.Linear children, gate and up apart or as one [2I]
    projection (Phi-3's gate_up_proj), act one of GATE_ACTIVATIONS, and nothing else (no other parameter, no dropout
    that is on). Tried on the module itself with four random rows in its own dtype, each arrangement of its
    projections and each activation computed from the same children: the module's output must agree to its dtype's
    precision (silu and gelu_tanh differ by far more)."""
    linears = {name: child for name, child in module.named_children() if isinstance(child, torch.nn.Linear)}
    if not 2 <= len(linears) <= 3 or set(dict(module.named_parameters())) != {
            f"{name}.{p}" for name, child in linears.items() for p, _ in child.named_parameters()}:
        return None
    width = next(iter(linears.values())).in_features
    candidates = []
    for down, down_linear in linears.items():
        if down_linear.out_features != width:
            continue
        others = [name for name in linears if name != down]
        if len(others) == 2:
            candidates += [GatedMlpSite(down, gate=g, up=u) for g, u in (others, others[::-1])]
        elif len(others) == 1 and linears[others[0]].out_features == 2 * down_linear.in_features:
            candidates += [GatedMlpSite(down, fused=others[0], gate_first=first) for first in (True, False)]
    candidates = [replace(site, activation=name) for site in candidates for name in GATE_ACTIVATIONS]
    if not candidates:
        return None
    weight = next(module.parameters())
    x = torch.randn(PROBE_ROWS, width, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    got = _output_like(module, x)
    if got is None:
        return None
    # The arrangement is computed from the module's own children, so in fp32 it agrees to rounding; exact GELU
    # (ModernBERT's) is 1e-4 from gelu_tanh and must not pass for it
    tolerance = 1e-6 if weight.dtype in (torch.float32, torch.float64) else 2e-2
    for site in candidates:
        with torch.no_grad():
            if site.fused:
                first, second = getattr(module, site.fused)(x).chunk(2, dim=-1)
                gate, up = (first, second) if site.gate_first else (second, first)
            else:
                gate, up = getattr(module, site.gate)(x), getattr(module, site.up)(x)
            want = getattr(module, site.down)(GATE_ACTIVATIONS[site.activation](gate) * up)
        if ((got - want).float().norm() <= tolerance * want.float().norm()).item():
            return site
    return None


PROJECTION_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))  # HF's names for the three


@dataclass(frozen=True)
class ProjectionsSite:
    """The Q, K and V projections of an attention: the names of its three children, in that order."""
    names: tuple[str, str, str]


def computes_linear(module) -> bool:
    """Whether ``module`` computes nn.Linear's function: an nn.Linear, or a subclass that keeps its forward (one
    that quantises its weight or input on the way, BitNet's, computes something else)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def qkv_projections(module: torch.nn.Module) -> ProjectionsSite | None:
    """An attention whose Q, K and V are three linear projections (``computes_linear``) of the same width of input,
    with weights of one dtype on one device, so that one GEMM over their concatenated weights can serve all three:
    qkv_proj's site. How the forward uses them (what it feeds them, what it does after) is not looked at: the
    replacement serves a projection from the one GEMM only when it is handed the input the GEMM ran on."""
    for names in PROJECTION_NAMES:
        projections = [getattr(module, name, None) for name in names]
        if all(computes_linear(p) for p in projections) and len(
                {(p.in_features, p.weight.dtype, p.weight.device) for p in projections}) == 1:
            return ProjectionsSite(names)
    return None


@dataclass(frozen=True)
class AttentionSite:
    """A llama-family attention: its Q, K and V projections apart (``fused_sizes`` empty) or one ``qkv_proj`` of
    those three widths (Phi-3), and q/k RMSNorms of one kind (``qk_norm``, the site both norms are), each over one
    head or over all of q's and all of k's heads (OLMo 2), or none."""
    qk_norm: NormSite | None
    fused_sizes: tuple[int, ...] = ()
    # what the forward hands its attention function besides q, k, v and the mask: (keyword, value) pairs (the
    # scale, a cap, sinks, a window), handed the same by the replacement
    arguments: tuple = field(default=(), compare=False)


def _fused_qkv_sizes(module: torch.nn.Module) -> tuple[int, ...] | None:
    """(Q, K, V) widths of a fused ``qkv_proj`` from the config's head counts; None where they do not add up."""
    config, head_dim = getattr(module, "config", None), getattr(module, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not (type(head_dim) is int and type(heads) is int and type(kv_heads) is int):
        return None
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return sizes if sum(sizes) == module.qkv_proj.out_features else None


def qkv_attention(module: torch.nn.Module) -> AttentionSite | None:
    """The attention that attention_prologue rewrites: ``q_proj``, ``k_proj`` and ``v_proj`` as qkv_projections
    finds them (or one linear ``qkv_proj`` whose width the config's heads account for) and a linear ``o_proj``, an
    int ``head_dim``, a ``layer_idx`` (its cache layer), a forward taking ``position_embeddings`` (HF's cos and sin),
    and either no ``q_norm``/``k_norm`` or two RMSNorms, both over one head or q's over all its heads and k's over
    all of its own; and a forward that computes what the replacement does with those parts (``_attention_arguments``):
    a layer that skips its rotation (Cohere 2's and EXAONE 4's global layers), gates or normalises the attention's
    output (AFMoE, BitNet), or builds its own mask (Doge) is not this site."""
    fused = computes_linear(getattr(module, "qkv_proj", None))
    if not computes_linear(getattr(module, "o_proj", None)) or not (
            fused or qkv_projections(module) == ProjectionsSite(PROJECTION_NAMES[0])):
        return None
    if type(getattr(module, "head_dim", None)) is not int or type(getattr(module, "layer_idx", None)) is not int:
        return None
    if "position_embeddings" not in inspect.signature(type(module).forward).parameters:
        return None
    fused_sizes = _fused_qkv_sizes(module) if fused else ()
    if fused_sizes is None:
        return None
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    norm = None
    if q_norm is not None or k_norm is not None:
        sites = [rms_norm(n) if isinstance(n, torch.nn.Module) else None for n in (q_norm, k_norm)]
        if None in sites or sites[0] != sites[1]:
            return None
        all_heads = fused_sizes[:2] if fused else (module.q_proj.out_features, module.k_proj.out_features)
        if (q_norm.weight.numel(), k_norm.weight.numel()) not in ((module.head_dim,) * 2, all_heads):
            return None
        norm = sites[0]
    site = AttentionSite(qk_norm=norm, fused_sizes=fused_sizes)
    arguments = _attention_arguments(module, site)
    return None if arguments is None else replace(site, arguments=arguments)


PROBE_TOKENS = 3  # more than one: a single token's attention returns v, whatever q and k are


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Whether ``got`` is ``want`` to ``tolerance``, relative to want's norm (a probe's agreement)."""
    return got.shape == want.shape and bool(((got - want).norm() <= tolerance * want.norm()).item())


def _expected_qkv(module: torch.nn.Module, site: AttentionSite, x: torch.Tensor, cos, sin, rotation):
    """q, k, v [B, heads, T, head_dim] as attention_prologue's kernel computes them from ``x``: the projections,
    the q/k norms (over a head, or over all heads), the modeling module's rotation."""
    if site.fused_sizes:
        q, k, v = module.qkv_proj(x).split(list(site.fused_sizes), dim=-1)
    else:
        q, k, v = module.q_proj(x), module.k_proj(x), module.v_proj(x)
    heads = (*x.shape[:-1], -1, module.head_dim)
    if site.qk_norm is not None:
        per_head = module.q_norm.weight.numel() == module.head_dim
        q, k = (norm(t.view(heads) if per_head else t) for norm, t in ((module.q_norm, q), (module.k_norm, k)))
    q, k, v = (t.reshape(heads).transpose(1, 2) for t in (q, k, v))
    return (*rotation(q, k, cos, sin), v)


@contextmanager
def _attention_function_replaced(module: torch.nn.Module, function):
    """The module's attention function, where its forward looks it up at call time (the modeling module's eager
    forward, or the registered implementation its config names), replaced by ``function`` for the block."""
    implementation = module.config._attn_implementation
    table, name = ((vars(sys.modules[type(module).__module__]), "eager_attention_forward") if implementation == "eager"
                   else (AttentionInterface._global_mapping, implementation))
    before = table.get(name)
    table[name] = function
    try:
        yield
    finally:
        table[name] = before


def _attention_arguments(module: torch.nn.Module, site: AttentionSite) -> tuple | None:
    """What the module's forward hands its attention function besides q, k, v and the mask ((keyword, value) pairs:
    the scale, Gemma 2's cap, GPT-OSS's sinks, a window; None values and dropout left out), where the forward is
    the llama-family one attention_prologue replaces it with; else None. Found by running it once on PROBE_TOKENS
    random tokens of its own dtype, with a causal mask and cos and sin of random angles as wide as a head (or half
    of one, GPT-OSS's angle per pair), no cache: its attention function must be called once, with q, k and v as
    ``_expected_qkv`` computes them (to the dtype's precision) and the mask it was handed, and what that function
    returns (random numbers here) must go through ``o_proj`` untouched, whose output is the module's. Anything else
    the forward does (a rotation it skips, a gate or a norm on the output, a mask of its own) is not what the
    replacement computes."""
    rotation = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if not callable(rotation) or getattr(getattr(module, "config", None), "_attn_implementation", None) not in (
            "eager", *AttentionInterface._global_mapping):
        return None
    weight = (module.qkv_proj if site.fused_sizes else module.q_proj).weight
    dtype, device = weight.dtype, weight.device
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, PROBE_TOKENS, weight.shape[1], generator=generator).to(device, dtype)
    mask = torch.full((PROBE_TOKENS, PROBE_TOKENS), torch.finfo(dtype).min).triu(1)[None, None].to(device, dtype)
    for width in (module.head_dim, module.head_dim // 2):
        angles = torch.rand(1, PROBE_TOKENS, width // 2, generator=generator) * 2 * math.pi
        cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(device, dtype) for f in (torch.cos, torch.sin))
        calls, projected = [], []

        def attention(attention_module, query, key, value, attention_mask, **kwargs):
            out = torch.randn(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], generator=generator)
            calls.append((query, key, value, attention_mask, kwargs, out.to(device, dtype)))
            return calls[-1][-1], None

        hooks = [module.o_proj.register_forward_pre_hook(lambda _, inputs: projected.append(inputs[0])),
                 module.o_proj.register_forward_hook(lambda _, inputs, output: projected.append(output))]
        try:
            with torch.no_grad(), _attention_function_replaced(module, attention):
                got = type(module).forward(module, x, position_embeddings=(cos, sin), attention_mask=mask)
                expected = _expected_qkv(module, site, x, cos, sin, rotation)
        except Exception:  # noqa: BLE001 - cos and sin of another width, or a forward that wants more than this
            continue
        finally:
            for hook in hooks:
                hook.remove()
        if len(calls) != 1 or len(projected) != 2 or not isinstance(got, tuple) or got[0] is not projected[1]:
            return None
        query, key, value, attention_mask, kwargs, out = calls[0]
        tolerance = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
        if not (all(_close(t.float(), e.float(), tolerance) for t, e in zip((query, key, value), expected))
                and attention_mask is mask and torch.equal(projected[0], out.reshape(*x.shape[:-1], -1))
                and type(kwargs.get("scaling")) is float):
            return None
        return tuple((name, value) for name, value in kwargs.items() if value is not None and name != "dropout")
    return None


@dataclass(frozen=True)
class PreNormSite:
    """A pre-norm decoder layer: its two norms' kind (``norm``) and what it scales each branch's output by before
    the residual add (Granite's residual multiplier, MiniCPM's depth scale; 1.0 for Llama's)."""
    norm: NormSite
    attention_scale: float = 1.0
    mlp_scale: float = 1.0


class _Branch(torch.nn.Module):
    """A decoder layer's attention or MLP in a probe: an elementwise function of its input (``function``, None for
    zeros), returned beside None (an attention's weights, a MoE's router scores) or alone, as the layer unpacks it;
    any other attribute the layer reads of the module it stands for is that module's."""

    def __init__(self, stands_for: torch.nn.Module, function, as_tuple: bool):
        super().__init__()
        object.__setattr__(self, "stands_for", stands_for)
        self.function, self.as_tuple = function, as_tuple

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "stands_for"), name)

    def forward(self, hidden_states=None, *args, **kwargs):
        out = torch.zeros_like(hidden_states) if self.function is None else self.function(hidden_states)
        return (out, None) if self.as_tuple else out


def _own_float64(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``module`` that runs its class's forward, not one a recipe installed on the instance (a
    fused norm's kernel takes no float64): what the model computes, whichever recipes were applied before."""
    own = copy.deepcopy(module)
    vars(own).pop("forward", None)
    return own.to(torch.float64)


def _layer_on_branches(layer: torch.nn.Module, norms: tuple[str, ...], x: torch.Tensor, attention, mlp):
    """The layer's class forward on ``x`` (float64) with its ``self_attn`` and ``mlp`` swapped for ``_Branch``es of
    the functions ``attention`` and ``mlp``, and its ``norms`` for float64 copies of themselves, so that what the
    layer adds, scales and normalises around its branches shows to float64's precision; None where it does not run
    on such parts (another signature, another layer) or returns anything but one tensor of x's shape."""
    saved = dict(layer._modules)
    try:
        for name in norms:
            layer._modules[name] = _own_float64(saved[name])
        for tuples in ((True, False), (True, True), (False, False), (False, True)):
            layer._modules["self_attn"] = _Branch(saved["self_attn"], attention, tuples[0])
            layer._modules["mlp"] = _Branch(saved["mlp"], mlp, tuples[1])
            try:
                with torch.no_grad():
                    got = type(layer).forward(layer, x, attention_mask=None, position_embeddings=None)
            except Exception:  # noqa: BLE001 - unpacked another way, or not a layer of this form
                continue
            return got if isinstance(got, torch.Tensor) and got.shape == x.shape else None
        return None
    finally:
        layer._modules.clear()
        layer._modules.update(saved)


def _probe_branches(norm: torch.nn.Module) -> tuple:
    """(x, attention, mlp) for ``_layer_on_branches`` of a layer with ``norm`` (its width, its device): four random
    float64 rows and two elementwise functions of random coefficients, each nonlinear and unlike the other, so a
    branch's output that a layer scales, normalises or adds elsewhere shows."""
    width, device = norm.weight.shape[0], norm.weight.device
    generator = torch.Generator().manual_seed(3)
    a, b, c, d = (torch.randn(width, dtype=torch.float64, generator=generator).to(device) for _ in range(4))
    x = torch.randn(1, PROBE_ROWS, width, dtype=torch.float64, generator=generator).to(device)
    return x, lambda z: torch.tanh(z * a + b), lambda z: torch.sin(z * c + d)


def _scale(added: torch.Tensor, branch: torch.Tensor) -> float | None:
    """The number ``added`` is ``branch`` times, to the precision the layer's fp32 norms leave (1e-6); 1.0 where it
    is that to it; None where it is no multiple of it."""
    scale = ((added * branch).sum() / (branch * branch).sum()).item()
    if scale == 0 or not _close(added, scale * branch, 1e-6):
        return None
    return 1.0 if abs(scale - 1.0) < 1e-6 else scale


def pre_norm_decoder_layer(module: torch.nn.Module) -> PreNormSite | None:
    """A pre-norm decoder layer (``input_layernorm`` before ``self_attn``, ``post_attention_layernorm`` before
    ``mlp``) with no other child that holds parameters, so the residual add before the MLP's norm is the layer's own:
    Gemma's sandwich norms (pre/post feed-forward norms) and OLMo 2's post-norms are other placements, and
    DeepSeek-V4's hyper-connections (``attn_hc``, ``ffn_hc``) mix four residual streams around each branch. Its
    forward, run on stand-in branches (``_layer_on_branches``), must compute ``h = x + s_a attn(n1(x))``,
    ``h + s_m mlp(n2(h))``: the scales found from one branch at a time, then both checked together."""
    names = dict(module.named_children())
    parts = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if not set(parts) <= set(names):
        return None
    if any(next(child.parameters(), None) is not None for name, child in names.items() if name not in parts):
        return None
    if rms_norm(names["input_layernorm"]) is None:
        return None
    norm = rms_norm(names["post_attention_layernorm"])
    if norm is None:
        return None
    x, attention, mlp = _probe_branches(names["input_layernorm"])
    norms = parts[:2]
    run = functools.partial(_layer_on_branches, module, norms, x)
    alone = run(attention, None), run(None, mlp), run(attention, mlp)
    if any(out is None for out in alone):
        return None
    first, second = (_own_float64(module._modules[name]) for name in norms)
    with torch.no_grad():
        attended = attention(first(x))
        attention_scale = _scale(alone[0] - x, attended)
        mlp_scale = _scale(alone[1] - x, mlp(second(x)))
        if attention_scale is None or mlp_scale is None:
            return None
        h = x + attention_scale * attended
        want = h + mlp_scale * mlp(second(h))
    return PreNormSite(norm, attention_scale, mlp_scale) if _close(alone[2], want, 1e-6) else None


@dataclass(frozen=True)
class SandwichSite:
    """A layer's norms around its branches by attribute name: the attention input's (``input``), the attention
    output's, the MLP input's (``pre_mlp``) and the MLP output's, "" where the layer has none (a post-norm layer
    normalises each branch's output only); all of them RMSNorms of one kind and one eps (``norm``)."""
    input: str
    post_attention: str
    pre_mlp: str
    post_mlp: str
    norm: NormSite


# (attention input, attention output, MLP input, MLP output) norms of the layers in transformers that normalise
# their branches' outputs
SANDWICH_PLACEMENTS = (
    ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),  # Gemma
    ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),  # GLM-4
    ("", "post_attention_layernorm", "", "post_feedforward_layernorm"),  # OLMo 2 and 3: post-norm
)


def sandwich_norm_decoder_layer(module: torch.nn.Module) -> SandwichSite | None:
    """A decoder layer that normalises each branch's output before its residual add (Gemma 2 and 3, GLM-4 between
    two norms a branch; OLMo 2 and 3 after it only): ``self_attn``, ``mlp`` and one of SANDWICH_PLACEMENTS' norms,
    and no other child (Gemma 3n's AltUp and Laurel blocks are other layers), every norm of one kind and eps."""
    names = dict(module.named_children())
    for placement in SANDWICH_PLACEMENTS:
        present = [name for name in placement if name]
        if set(names) != {"self_attn", "mlp", *present}:
            continue
        norms = [names[name] for name in present]
        sites = [rms_norm(norm) for norm in norms]
        if None in sites or len({(site.offset, site.weight_first) for site in sites}) != 1 or len(
                {getattr(norm, site.eps_attribute) for norm, site in zip(norms, sites)}) != 1:
            return None
        site = SandwichSite(*placement, norm=sites[0])
        return site if _computes_sandwich(module, site) else None
    return None


def _computes_sandwich(layer: torch.nn.Module, site: SandwichSite) -> bool:
    """Whether the layer's forward, run on stand-in branches (``_layer_on_branches``), computes what
    sandwich_norm's replacement does: ``h = x + post_attention(attn(input(x)))``, ``h + post_mlp(mlp(pre_mlp(h)))``,
    an absent norm passing its input through."""
    placement = (site.input, site.post_attention, site.pre_mlp, site.post_mlp)
    present = [name for name in placement if name]
    x, attention, mlp = _probe_branches(layer._modules[present[0]])
    got = _layer_on_branches(layer, tuple(present), x, attention, mlp)
    if got is None:
        return False
    input_norm, post_attention, pre_mlp, post_mlp = (
        _own_float64(layer._modules[name]) if name else (lambda z: z) for name in placement)
    with torch.no_grad():
        h = x + post_attention(attention(input_norm(x)))
        want = h + post_mlp(mlp(pre_mlp(h)))
    return _close(got, want, 1e-6)


@dataclass(frozen=True)
class HyperConnectionSite:
    """A hyper-connection's constants, as its forward uses them."""
    norm_eps: float  # the unweighted norm's
    hc_eps: float  # added to pre and comb, and to every Sinkhorn denominator
    iterations: int  # Sinkhorn iterations


def stream_mixing(streams, fn, base, scale, norm_eps, hc_eps, iterations):
    """What a hyper-connection computes (DeepSeek-V4's mHC): the streams [..., N, D] normalised without weight and
    projected by fn into pre (sigmoid, + hc_eps), post (twice a sigmoid) and comb (a row softmax + hc_eps, made
    doubly stochastic by Sinkhorn: columns first, then rows and columns for the remaining iterations), each scaled
    by its scale and shifted by its base; returns (post, comb, the streams collapsed by pre)."""
    n = streams.shape[-2]
    flat = streams.flatten(-2).to(fn.dtype)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = torch.nn.functional.linear(flat, fn).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hyper_connection(module: torch.nn.Module) -> HyperConnectionSite | None:
    """A hyper-connection: parameters ``fn`` [(2 + N) N, N D], ``base`` [(2 + N) N] and ``scale`` [3], one child
    norm without parameters that keeps an eps, and a forward from the streams [..., N, D] to (post, comb,
    collapsed) as ``stream_mixing`` computes them. Its hc_eps and Sinkhorn iteration count are found among the
    module's float and int attributes: the combination that comes closest to its output on a float64 copy with
    random parameters, to fp32's precision (where HF computes)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"fn", "base", "scale"} or params["scale"].shape != (3,) or params["base"].dim() != 1:
        return None
    outputs = params["base"].shape[0]
    n = round((outputs + 1) ** 0.5) - 1
    fn = params["fn"]
    if n < 1 or (2 + n) * n != outputs or fn.shape[0] != outputs or fn.dim() != 2 or fn.shape[1] % n:
        return None
    norms = [child for child in module.children() if next(child.parameters(), None) is None and any(
        type(getattr(child, name, None)) is float for name in EPS_ATTRIBUTES)]
    if len(norms) != 1 or len(list(module.children())) != 1:
        return None
    norm_eps = next(getattr(norms[0], name) for name in EPS_ATTRIBUTES if type(getattr(norms[0], name, None)) is float)
    floats = [value for value in vars(module).values() if type(value) is float]
    ints = [value for value in vars(module).values() if type(value) is int and value >= 1]
    probe = copy.deepcopy(module).to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.fn.copy_(torch.randn(fn.shape, dtype=torch.float64, generator=generator) / fn.shape[1] ** 0.5)
        probe.base.copy_(torch.randn(outputs, dtype=torch.float64, generator=generator))
        probe.scale.copy_(1 + 0.5 * torch.randn(3, dtype=torch.float64, generator=generator))
        streams = torch.randn(1, PROBE_ROWS, n, fn.shape[1] // n, dtype=torch.float64, generator=generator)
        try:
            got = type(module).forward(probe, streams.to(fn.device))
        except Exception:  # noqa: BLE001 - another signature: another structure
            return None
        if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
            return None
        errors = {}
        for hc_eps in floats:
            for iterations in ints:
                want = stream_mixing(streams.to(fn.device), probe.fn, probe.base, probe.scale, norm_eps, hc_eps,
                                     iterations)
                if all(g.shape == w.shape for g, w in zip(got, want)):
                    errors[HyperConnectionSite(norm_eps, hc_eps, iterations)] = max(
                        ((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
    # HF casts to fp32 whatever it is given: agreement to fp32's precision is a match, and the closest one is it
    site = min(errors, key=errors.get, default=None)
    return site if site is not None and errors[site] < 1e-5 else None


@dataclass(frozen=True)
class GroupedLinearSite:
    groups: int  # x [..., groups, K] -> [..., groups, N / groups], group g through weight rows [g N / G, (g + 1) N / G)


def grouped_linear(module: torch.nn.Module) -> GroupedLinearSite | None:
    """A block-diagonal projection without bias (DeepSeek-V4's grouped output projection): one weight [N, K], no
    submodule, and a forward from [..., G, K] to [..., G, N / G] taking group g through the g-th block of N / G weight
    rows. G is one of the module's int attributes other than its widths, each tried on a probe that shares the
    module's attributes but holds a random float64 weight (the real one, 67 MB a layer on V4-Flash, is not copied),
    drawn on the weight's device: on the host, V4-Flash's [8192, 4096] took about a second a site."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if set(params) != {"weight"} or weight.dim() != 2 or next(module.children(), None) is not None:
        return None
    n, k = weight.shape
    candidates = sorted({value for value in vars(module).values()
                         if type(value) is int and 1 < value < n and n % value == 0 and value != k})
    if not candidates:
        return None
    generator = torch.Generator(weight.device).manual_seed(0)
    probe = copy.copy(module)
    probe._parameters = {"weight": torch.nn.Parameter(
        torch.randn(n, k, dtype=torch.float64, device=weight.device, generator=generator) / k**0.5,
        requires_grad=False)}
    for groups in candidates:
        x = torch.randn(PROBE_ROWS, groups, k, dtype=torch.float64, device=weight.device, generator=generator)
        try:
            with torch.no_grad():
                got = type(module).forward(probe, x)
        except Exception:  # noqa: BLE001 - not this grouping
            continue
        want = torch.einsum("tgk,gnk->tgn", x, probe.weight.view(groups, n // groups, k))
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-9,
                                                                                          atol=1e-12):
            return GroupedLinearSite(groups)
    return None


def takes_first(function, parameters: tuple[str, ...]) -> bool:
    """Whether ``function``'s leading parameters are ``parameters`` (False where it has no signature to read): one
    name may stand for two computations, as ``apply_rotary_pos_emb(q, k, cos, sin)`` and ``(x, cos, sin)``."""
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return names[:len(parameters)] == parameters


@dataclass(frozen=True)
class RotaryLayout:
    """How an ``apply_rotary_pos_emb(q, k, cos, sin)`` turns heads of one width by cos and sin of another: its leading
    ``rotated`` channels turned (the rest passed through, partial rotary), in the layout rope's switches name."""
    rotated: int
    interleaved: bool  # channel 2i pairs with 2i + 1 (Cohere, GLM), not i with i + rotated / 2 (Llama)
    pair_angles: bool  # pair i turns by column i of cos and sin (GPT-OSS, Helium), not each channel by its own
    clockwise: bool  # the other sense of turn (NanoChat's rotate_half)
    fp32: bool  # the products kept in fp32 and rounded once (Cohere's q.float()), not rounded to the model dtype

    def switches(self) -> dict[str, bool]:
        """The keywords a rope kernel is called with: the switches that are on, so that a kernel written for Llama's
        layout (a user's, taking q, k, cos, sin alone) is called as before there, and fails elsewhere."""
        switches = dict(interleaved=self.interleaved, pair_angles=self.pair_angles, clockwise=self.clockwise,
                        fp32=self.fp32)
        return {name: True for name, on in switches.items() if on}


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RotaryLayout) -> torch.Tensor:
    """x [B, H, S, D] turned in ``layout`` by cos, sin [B, S, W], with the rounding of the layout's eager code."""
    head, rest = x[..., :layout.rotated], x[..., layout.rotated:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    wide = head.float() if layout.fp32 and head.dtype in (torch.bfloat16, torch.float16) else head

    def pairs(t):
        return (t[..., 0::2], t[..., 1::2]) if layout.interleaved else t.chunk(2, dim=-1)

    x1, x2 = pairs(wide)
    if layout.pair_angles:
        (cos1, cos2), (sin1, sin2) = (cos[..., :x1.shape[-1]],) * 2, (sin[..., :x1.shape[-1]],) * 2
    else:
        (cos1, cos2), (sin1, sin2) = pairs(cos[..., :layout.rotated]), pairs(sin[..., :layout.rotated])
    sense = -1 if layout.clockwise else 1
    out1, out2 = x1 * cos1 - sense * (x2 * sin1), x2 * cos2 + sense * (x1 * sin2)
    turned = torch.stack((out1, out2), dim=-1).flatten(-2) if layout.interleaved else torch.cat((out1, out2), -1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


@functools.lru_cache(maxsize=None)
def rotary_layout(function, head_dim: int, cos_width: int, dtype: torch.dtype) -> RotaryLayout | None:
    """The layout in which ``function`` (an ``apply_rotary_pos_emb(q, k, cos, sin)``, a recipe's wrapper unwrapped)
    turns heads of ``head_dim`` by cos and sin ``cos_width`` wide, or None where no layout rope knows computes what it
    does. Found on the CPU, once per shape: q, k, cos and sin of random values (not angles: every column its own
    number, so a channel turned by the wrong column shows) in float64, matched against every layout to 1e-5 (code that
    casts to float32 computes in it; a wrong pairing, column or sense is off by the values themselves); then
    in ``dtype`` (bf16, fp16) the rounding, products rounded or kept in fp32, bit for bit as the function rounds."""
    function = inspect.unwrap(function) if callable(function) else None
    if function is None or head_dim % 2 or not 0 < cos_width <= 2 * head_dim:
        return None
    generator = torch.Generator().manual_seed(0)

    def call(dtype):
        q, k = (torch.randn(1, 2, 3, head_dim, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
        cos, sin = (torch.randn(1, 3, cos_width, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
        try:
            with torch.no_grad():
                got = function(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - a function of another form is another computation
            return None
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) and t.shape == x.shape
                                                                 for t, x in zip(got, (q, k)))):
            return None
        return (q, k, cos, sin), got

    probe = call(torch.float64)
    if probe is None:
        return None
    (q, k, cos, sin), got = probe
    candidates = [RotaryLayout(rotated, interleaved, pair_angles, clockwise, False)
                  for rotated in sorted({head_dim, cos_width, 2 * cos_width}) if 0 < rotated <= head_dim
                  and rotated % 2 == 0 for interleaved in (False, True) for pair_angles in (False, True)
                  for clockwise in (False, True) if cos_width >= (rotated // 2 if pair_angles else rotated)]
    layout = next((c for c in candidates if all(torch.allclose(_turned(x, cos, sin, c), t, rtol=1e-5, atol=1e-5)
                                                for x, t in zip((q, k), got))), None)
    if layout is None or dtype not in (torch.bfloat16, torch.float16):
        return layout
    probe = call(dtype)
    if probe is None:
        return None
    (q, k, cos, sin), got = probe
    for fp32 in (False, True):
        candidate = replace(layout, fp32=fp32)
        if all(torch.equal(_turned(x, cos, sin, candidate), t) for x, t in zip((q, k), got)):
            return candidate
    return None


# Every name a DeepSeek-V2 or -V3 MLA forward (and its expand_kv) refers to. A forward that refers to
# anything else does more than the absorbed decode path does: an indexer's sparse selection (V3.2), attention sinks,
# an output gate, latent scales (LongCat), a query scale that grows with the position (Mistral 4), which the gate's
# short contexts would not all show.
MLA_FORWARD_NAMES = frozenset({
    "ALL_ATTENTION_FUNCTIONS", "_attn_implementation", "apply_rotary_emb", "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_interleave", "attention_dropout", "cat", "config", "contiguous", "copy_", "device",
    "eager_attention_forward", "expand", "expand_kv", "get_interface", "kv_a_layernorm", "kv_a_proj_with_mqa",
    "kv_b_proj", "kv_lora_rank", "layer_idx", "new_empty", "o_proj", "q_a_layernorm", "q_a_proj", "q_b_proj",
    "q_lora_rank", "q_proj", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "reshape", "rope_interleave",
    "scaling", "shape", "split", "to", "torch", "training", "transpose", "update", "v_head_dim", "view"})
MLA_CHILDREN = frozenset({"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                          "kv_b_proj", "o_proj"})
ROTATIONS = ("apply_rotary_emb", "apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")


@dataclass(frozen=True)
class MlaSite:
    heads: int
    rotation: str | None  # the modeling module's function that turns the rope parts (V2's complex apply_rotary_emb,
    # V3's apply_rotary_pos_emb or its _interleave as the config says), or None: a MLA without rotation (Kimi Linear)


def _forward_names(module_type: type) -> set[str]:
    """The global, attribute and method names ``module_type.forward`` refers to, in its nested code and in the
    methods of the class's own it calls (V3's ``expand_kv``)."""
    names: set[str] = set()
    codes = [inspect.unwrap(module_type.forward).__code__]
    while codes:
        code = codes.pop()
        for name in set(code.co_names) - names:
            method = getattr(module_type, name, None)
            if inspect.isfunction(method) and not hasattr(torch.nn.Module, name):
                codes.append(inspect.unwrap(method).__code__)
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    return names


def mla_attention(module: torch.nn.Module) -> MlaSite | None:
    """Multi-head latent attention as DeepSeek-V2 and -V3 write it (and GLM-4-MoE-Lite, Kimi, Youtu, MiniCPM3 after
    them): a query through ``q_proj`` or the low-rank ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, one
    ``kv_a_proj_with_mqa`` giving the latent and the shared rope key, ``kv_a_layernorm``, a bias-free ``kv_b_proj``
    of every head's key and value parts, ``o_proj``; no other child and no parameter of its own; a forward that refers
    to nothing beyond MLA_FORWARD_NAMES. What the cached latent and rope key go through is the absorbed path's; the
    gate checks the rest."""
    children = dict(module.named_children())
    has_query = "q_proj" in children or {"q_a_proj", "q_a_layernorm", "q_b_proj"} <= set(children)
    if not has_query or not set(children) <= MLA_CHILDREN or any(True for _ in module.parameters(recurse=False)):
        return None
    kv_b = children.get("kv_b_proj")
    sizes = [getattr(module, name, None) for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim", "layer_idx")]
    if not (isinstance(kv_b, torch.nn.Linear) and kv_b.bias is None and all(type(n) is int for n in sizes)
            and {"kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj"} <= set(children)
            and isinstance(getattr(module, "scaling", None), float)):
        return None
    rank, nope, _, value, _ = sizes
    heads = getattr(module, "num_heads", None) or getattr(getattr(module, "config", None), "num_attention_heads", 0)
    if type(heads) is not int or kv_b.in_features != rank or kv_b.out_features != heads * (nope + value):
        return None
    names = _forward_names(type(module))
    if not names <= MLA_FORWARD_NAMES:
        return None
    rotations = [name for name in ROTATIONS if name in names]
    if len(rotations) == 2 and rotations[0] == "apply_rotary_pos_emb":  # V3: the config chooses
        rotations = [rotations[bool(getattr(module.config, "rope_interleave", False))]]
    if len(rotations) > 1:
        return None
    return MlaSite(heads, rotations[0] if rotations else None)


@dataclass(frozen=True)
class SwigluExpertsSite:
    limit: float | None  # gate clamped to at most limit and up to [-limit, limit] before silu(gate) * up; or none


def experts_gate(module: torch.nn.Module):
    """What an experts module computes between its two products, [..., 2I] -> [..., I]: HF's ``_apply_gate`` where
    its class has one (transformers' grouped-GEMM backends call it: DeepSeek-V4's clamps there), else ``act_fn``
    of the gate half times the up half."""
    own = getattr(type(module), "_apply_gate", None)
    if own is not None:
        return lambda gate_up: own(module, gate_up)

    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate_half, up = gate_up.chunk(2, dim=-1)
        return module.act_fn(gate_half) * up

    return gate


def swiglu_experts(module: torch.nn.Module) -> SwigluExpertsSite | None:
    """Routed experts as transformers 5 stores them: 3-D gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I], no other parameter, neither transposed nor interleaved, whose gate (``experts_gate``) is
    silu(gate) * up, with gate clamped from above and up on both sides at a limit found among the module's float
    attributes (DeepSeek-V4's swiglu_limit) or at none. The gate is probed on float64 values spread over six
    decades, so that a limit anywhere among them shows."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"}:
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if (gate_up.dim() != 3 or gate_up.shape[1] % 2
            or tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2)
            or getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True)):
        return None
    generator = torch.Generator().manual_seed(0)
    spread = 10.0 ** torch.empty(PROBE_ROWS, 16, dtype=torch.float64).uniform_(-2.0, 4.0, generator=generator)
    probe = (torch.randn(PROBE_ROWS, 16, dtype=torch.float64, generator=generator) * spread).to(gate_up.device)
    try:
        with torch.no_grad():
            got = experts_gate(module)(probe)
    except Exception:  # noqa: BLE001 - another gate: another structure
        return None
    gate, up = probe.chunk(2, dim=-1)
    limits = sorted({value for value in vars(module).values() if type(value) is float and value > 0})
    for limit in (None, *limits):
        clamped = (gate, up) if limit is None else (gate.clamp(max=limit), up.clamp(-limit, limit))
        want = torch.nn.functional.silu(clamped[0]) * clamped[1]
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-12,
                                                                                          atol=1e-300):
            return SwigluExpertsSite(limit)
    return None


ROUTER_SCORES = {"softmax": lambda logits: logits.softmax(dim=-1), "sigmoid": torch.sigmoid,
                 "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt()}


@dataclass(frozen=True)
class RouterSite:
    """How a top-k router routes, found by running it: the routing moe_router's kernel computes from its logits."""
    top_k: int
    score: str  # a key of ROUTER_SCORES
    renormalize: bool
    scale: float
    bias: str | None  # the buffer added to the scores to choose the experts, not to weigh them (V3's, V4's)
    table: str | None  # the token -> experts buffer of hash routing (its forward takes the input ids)
    groups: tuple[int, int, int]  # (groups, groups kept, a group scored by its best 1 or sum of best 2); (1, 1, 2)
    logits: str  # the logits GEMM: "model" (in the model's dtype), "fp32" (on operands cast to fp32: DeepSeek-V2's and
    # V3's) or "cast" (in the model's dtype, its result cast to fp32: Granite's)
    fp32_weights: bool  # the weights come out in fp32 whatever the model's dtype (Mixtral's, from bf16 logits)


def _routing_candidates(module: torch.nn.Module, experts: int, top_k: int):
    """Every routing the kernel computes that the module's attributes could configure: each score, with or without
    each [E] float buffer as the selection bias, in each grouping its int attributes allow, renormalised or not,
    scaled by 1 or by each of its float attributes."""
    biases = [name for name, b in module.named_buffers(recurse=False) if b.is_floating_point() and b.shape == (experts,)]
    ints = sorted({v for v in vars(module).values() if type(v) is int and v > 0})
    groupings = [(1, 1, 2)] + [(g, kept, top) for g in ints if 1 < g < experts and experts % g == 0
                               for kept in ints if kept < g for top in (1, 2) if experts // g >= top]
    scales = [1.0] + sorted({v for v in vars(module).values() if type(v) is float and v > 0})
    return [(score, bias, grouping, renormalize, scale) for score in ROUTER_SCORES for bias in (None, *biases)
            for grouping in groupings for renormalize in (False, True) for scale in scales]


def _route_float64(logits, top_k, score, bias, grouping, renormalize, scale, table_rows):
    """A candidate routing in float64: (weights, expert ids) with each row's experts in ascending id order."""
    scores = ROUTER_SCORES[score](logits)
    if table_rows is not None:
        index = table_rows
    else:
        keys = scores if bias is None else scores + bias
        groups, kept, top = grouping
        if groups > 1:
            group_scores = keys.view(len(keys), groups, -1).topk(top, dim=-1).values.sum(-1)
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(kept, dim=-1).indices, True)
            keys = keys.masked_fill(~allowed.repeat_interleave(keys.shape[-1] // groups, dim=-1), float("-inf"))
        index = keys.topk(top_k, dim=-1).indices
    index = index.sort(dim=-1).values
    weights = scores.gather(1, index)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, index


def topk_router(module: torch.nn.Module) -> RouterSite | None:
    """A transformers 5 top-k router: one parameter, ``weight`` [E, H] (children without any: V4's score function);
    a forward from the hidden states (and, for hash routing, the input ids) to (logits [T, E], weights [T, k], expert
    ids [T, k]). Run on a bf16 copy (which of its logits and weights come out in fp32), then on a float64 copy with a
    random weight and random buffers (a zero selection bias would hide itself), its weights and experts matched
    against every routing ``_routing_candidates`` lists, to fp32's precision (routers cast to it whatever their
    input): a router that computes something else (a softmax over the chosen logits only, a bias in the weights, a
    jitter) matches none. Experts are compared as sets: HF's routers pick with sorted=False."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    try:  # the class's forward: an instance's may be a recipe's, closing over the module it patched
        names = list(inspect.signature(type(module).forward).parameters)[1:3]
    except (TypeError, ValueError):
        return None
    if (set(params) != {"weight"} or weight.dim() != 2 or names[:1] != ["hidden_states"]
            or any(True for child in module.children() for _ in child.parameters())):
        return None
    hashed = names == ["hidden_states", "input_ids"]
    tables = [name for name, b in module.named_buffers(recurse=False) if b.dim() == 2 and not b.is_floating_point()]
    if hashed != bool(tables) or len(tables) > 1:
        return None
    experts, hidden_size = weight.shape
    generator = torch.Generator().manual_seed(0)

    def run(dtype, randomize: bool):
        """The router's output on a copy in ``dtype`` (its parameters and buffers drawn at random if ``randomize``),
        with the copy; None for a forward of another form."""
        router = copy.deepcopy(module).to(device="cpu", dtype=dtype)
        with torch.no_grad():
            if randomize:
                router.weight.normal_(0.0, 2 / hidden_size**0.5, generator=generator)
            for name, buffer in router.named_buffers(recurse=False):
                if randomize and buffer.is_floating_point():
                    buffer.normal_(0.0, 0.3, generator=generator)
                elif randomize and name in tables:
                    buffer.copy_(torch.stack([torch.randperm(experts, generator=generator)[:buffer.shape[1]]
                                              for _ in range(len(buffer))]))
        hidden = torch.randn(2 * PROBE_ROWS, hidden_size, generator=generator, dtype=torch.float64).to(dtype)
        ids = torch.randint(getattr(router, tables[0]).shape[0], (len(hidden),), generator=generator) if hashed \
            else None
        try:
            with torch.no_grad():
                out = type(module).forward(router, hidden, *((ids,) if hashed else ()))
        except Exception:  # noqa: BLE001 - a forward of another form: another structure
            return None
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
            return None
        logits, weights, index = out
        if (logits.shape != (len(hidden), experts) or weights.shape != index.shape or index.dim() != 2
                or len(index) != len(hidden) or index.is_floating_point()):
            return None
        return router, hidden, logits, weights, index, ids

    half, full = run(torch.bfloat16, False), run(torch.float64, True)
    if half is None or full is None:
        return None
    probe, _, logits, weights, index, ids = full
    _, hidden, half_logits, half_weights, *_ = half
    logits_kind = "model"
    if half_logits.dtype == torch.float32:
        w = half[0].weight  # the bf16 copy's
        logits_kind = "fp32" if torch.equal(half_logits, torch.nn.functional.linear(hidden.float(), w.float())) \
            else "cast"
    top_k = index.shape[1]
    order = index.argsort(dim=-1)
    got_index, got_weights = index.gather(1, order), weights.gather(1, order).double()
    table_rows = getattr(probe, tables[0])[ids] if hashed else None
    for score, bias, grouping, renormalize, scale in _routing_candidates(probe, experts, top_k):
        want_weights, want_index = _route_float64(logits.double(), top_k, score,
                                                  None if bias is None else getattr(probe, bias), grouping,
                                                  renormalize, scale, table_rows)
        if torch.equal(want_index, got_index) and torch.allclose(want_weights, got_weights, rtol=1e-5, atol=1e-8):
            return RouterSite(top_k, score, renormalize, scale, bias, tables[0] if hashed else None, grouping,
                              logits_kind, half_weights.dtype == torch.float32)
    return None


def fp32_topk_router(module: torch.nn.Module) -> RouterSite | None:
    """A top-k router (``topk_router``) whose logits GEMM runs on operands it casts to fp32, by choice: the site of a
    precision flip."""
    site = topk_router(module)
    return site if site is not None and site.logits == "fp32" and site.table is None else None


@dataclass(frozen=True)
class IndexerScorerSite:
    projection: str  # the attribute holding the nn.Linear that gives the heads' weights
    scale: float  # the product of the module's two scales (the scores are linear in each: only it shows)


def indexer_scorer(module: torch.nn.Module) -> IndexerScorerSite | None:
    """A lightning indexer's scorer (DeepSeek-V4's): no parameter of its own, one bias-free nn.Linear (hidden -> H)
    as its only child holding parameters, and a forward from q [B, S, H, D], keys [B, T, D] and the hidden states
    [B, S, hidden] to the scores [B, S, T] ``sum_h w[h] * relu(q[h] . k) * a * b``, w the projection of the hidden
    states and a, b two of the module's float attributes (HF's softmax_scale and weights_scaling). Every pair is
    tried on a probe that shares the module's attributes but holds a random float64 projection, with random q, keys
    and hidden states (head weights of both signs: weighting before the ReLU, or not at all, is far off); HF
    computes in fp32 whatever it is given, so the pair that comes closest, to fp32's precision, is the match."""
    if next(module.parameters(recurse=False), None) is not None:
        return None
    holders = [(name, child) for name, child in module.named_children() if next(child.parameters(), None) is not None]
    if len(holders) != 1 or not isinstance(holders[0][1], torch.nn.Linear) or holders[0][1].bias is not None:
        return None
    name, projection = holders[0]
    floats = [value for value in vars(module).values() if type(value) is float]
    products = {a * b for i, a in enumerate(floats) for b in floats[i + 1:] if a * b}
    if not products:
        return None
    generator = torch.Generator().manual_seed(0)
    device, heads, width = projection.weight.device, projection.out_features, projection.in_features
    random_projection = copy.copy(projection)
    random_projection._parameters = {**projection._parameters, "weight": torch.nn.Parameter(
        torch.randn(heads, width, dtype=torch.float64, generator=generator).to(device) / width**0.5,
        requires_grad=False)}
    probe = copy.copy(module)
    probe._modules = {**module._modules, name: random_projection}
    q, keys, hidden = (torch.randn(shape, dtype=torch.float64, generator=generator).to(device)  # heads of 8, 5 keys
                       for shape in ((2, PROBE_ROWS, heads, 8), (2, 5, 8), (2, PROBE_ROWS, width)))
    with torch.no_grad():
        try:
            got = type(module).forward(probe, q, keys, hidden)
        except Exception:  # noqa: BLE001 - another signature: another structure
            return None
        scores = torch.relu(q @ keys.unsqueeze(1).transpose(-1, -2))  # [2, S, H, T]
        unscaled = (scores * random_projection(hidden).unsqueeze(-1)).sum(dim=2)
    if not isinstance(got, torch.Tensor) or got.shape != unscaled.shape:
        return None
    errors = {scale: ((got - unscaled * scale).norm() / (unscaled * scale).norm()).item() for scale in products}
    scale = min(errors, key=errors.get)
    return IndexerScorerSite(name, scale) if errors[scale] < 1e-5 else None


STRUCTURES = {"rms_norm": rms_norm, "gated_mlp": gated_mlp, "qkv_attention": qkv_attention,
              "qkv_projections": qkv_projections,
              "pre_norm_decoder_layer": pre_norm_decoder_layer,
              "sandwich_norm_decoder_layer": sandwich_norm_decoder_layer, "hyper_connection": hyper_connection,
              "grouped_linear": grouped_linear, "swiglu_experts": swiglu_experts, "indexer_scorer": indexer_scorer,
              "mla_attention": mla_attention, "topk_router": topk_router,
              "fp32_topk_router": fp32_topk_router}
# structures whose sites are (nearly all) some of another's: a recipe on either claims the wider one's sites, so two
# recipes on them are rivals (attention_prologue and qkv_proj both install the attention's forward)
NARROWS = {"fp32_topk_router": "topk_router", "qkv_attention": "qkv_projections"}
