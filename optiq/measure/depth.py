"""The whole model a truncated preset stands for (``models.PUBLISHED``): its floor, and its step extrapolated from
the preset's profiled layers.

A preset such as deepseek-v4-flash holds 6 of its model's 43 layers, in the model's own mix of layer kinds, so that
one GPU holds it with a real batch's cache. What the whole model would take follows from what the preset's step
took: the time outside the layers (embedding, final norm, LM head, sampling) is the same at any depth, and a layer of
the published model takes what the preset's layers of its kind took on average. A profile times kernels (or CPU
ops) only, not the gaps between them, and adds the profiler's cost, so its times are scaled by the timed step over
the profiled one: the estimate is a wall-clock step, comparable with the throughput table. The floor is the
roofline's (``optiq.measure.roofline``) on the published config built on the meta device: every byte is counted and
none is allocated. In graph mode a layer's kernels are those the replay's alignment with the eager step placed
(``traces.attribution``); a kernel it could not place counts outside the layers, once rather than per layer.
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers import AutoModelForCausalLM

from optiq.errors import OptiqError, first_line
from optiq.measure.roofline import floor_ms_per_step
from optiq.models import Published
from optiq.record import DepthPoint, FullDepth, LayerKind, Row, Workload
from optiq.traces.attribution import NO_LAYER, Attribution
from optiq.zoo import config_value

KIND_LISTS = ("layer_types", "mlp_layer_types")  # a config's per-layer kinds: the mixer's, then the MLP's
ALIKE = "layer"  # the kind of every layer of a config that lists none


def layer_kinds(config) -> list[str]:
    """Each layer's kind: its entries in the config's per-layer lists joined ("heavily_compressed_attention /
    hash_moe"), or ``ALIKE`` for a config whose layers are all of one kind."""
    config = config.get_text_config(decoder=True)
    lists = [kinds for name in KIND_LISTS if (kinds := config_value(config, name))]
    return [" / ".join(kinds[i] for kinds in lists) or ALIKE for i in range(config.num_hidden_layers)]


def stand_in(kind: str, measured: Counter) -> str:
    """The measured kind nearest ``kind`` (which the preset lacks): the same attention type first, then the most
    parts in common, then the most layers profiled."""
    parts = kind.split(" / ")

    def nearness(other: str) -> tuple:
        theirs = other.split(" / ")
        return theirs[0] == parts[0], sum(a == b for a, b in zip(parts, theirs)), measured[other]
    return max(measured, key=nearness)


def meta_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device: its parameters' shapes and dtype, no memory."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - the architecture's own constructor: one line, not its traceback
        raise OptiqError(f"the full-depth {config.model_type} does not build: {type(exc).__name__}: "
                         f"{first_line(exc)}") from None


def full_depth(published: Published, model: torch.nn.Module, concurrencies: list[int], workload: Workload,
               bandwidth: float) -> FullDepth:
    """What ``model``, a preset of some of ``published``'s layers, is measured against: that model's layer kinds
    beside the preset's, and its floor at each concurrency."""
    config = published.config()
    full = meta_model(config, next(model.parameters()).dtype)
    kinds, measured = layer_kinds(config), Counter(layer_kinds(model.config))
    return FullDepth(published.name, len(kinds), sum(measured.values()),
                     [LayerKind(kind, layers, measured[kind], "" if measured[kind] else stand_in(kind, measured))
                      for kind, layers in Counter(kinds).items()],
                     {str(c): floor_ms_per_step(full, c, workload.mean_length, bandwidth) for c in concurrencies})


def depth_point(depth: FullDepth, layers: Attribution, preset_kinds: list[str], row: Row) -> DepthPoint | None:
    """The whole model's step at ``row``'s variant and concurrency, from the preset's profile of it by layer
    (``attribute(..., by="layer")``; ``preset_kinds`` its layers' kinds, ``layer_kinds``); None for a profile that
    timed nothing."""
    by_layer = dict(zip(layers.table["label"], layers.table["gpu_ms_per_step"]))
    outside = by_layer.pop(NO_LAYER, 0.0)
    profiled = outside + sum(by_layer.values())
    if profiled <= 0:
        return None
    totals, counts = Counter(), Counter(preset_kinds)
    for index, kind in enumerate(preset_kinds):
        totals[kind] += by_layer.get(index, 0.0)
    ms_per_layer = {kind: totals[kind] / counts[kind] for kind in counts}
    scale = row.ms_per_step / profiled
    ms = (outside + sum(k.layers * ms_per_layer[k.stand_in or k.kind] for k in depth.kinds)) * scale
    return DepthPoint(row.variant, row.concurrency, outside, ms_per_layer, profiled, row.ms_per_step, scale, ms,
                      row.concurrency / ms * 1e3, 100 * depth.floor_ms_per_step[str(row.concurrency)] / ms)
