"""Measuring decode: throughput sweeps (``sweep``), the timer (``timing``) and the bandwidth floor (``roofline``);
here, what every measurement depends on besides the code."""

from __future__ import annotations

import platform

import torch
import transformers

from optiq import __version__
from optiq.measure.roofline import device_name
from optiq.measure.timing import triton_interpreted
from optiq.record import Environment


def environment(device: torch.device) -> Environment:
    """What a benchmark number depends on besides the code: device, library versions, and whether Triton's kernels
    run compiled or interpreted."""
    return Environment(device_name(device), torch.__version__, transformers.__version__, torch.version.cuda,
                       platform.python_version(), __version__, device.type, triton_interpreted())
