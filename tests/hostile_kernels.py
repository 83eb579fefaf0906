"""User fusions and factories that fail in the ways a careless or hostile one does, for the RMSNorm recipe's
signatures (``rmsnorm(x, weight, eps, offset, out)``, factory ``(module, fusion)``): the gate must reject each with
the reason and go on with the other recipes. The fusion modules that cannot even be imported are written as files
by the tests (``broken_module``)."""

import sys
import time

import torch

from optiq.fusions.rmsnorm import rmsnorm_reference
from optiq.patching.replacements.norm import rmsnorm_forward


def norm_in_float64(x, weight, eps, offset=False, out=None):
    """The right values, in float64: the model would go on in another precision than it was measured in."""
    return rmsnorm_reference(x.double(), weight.double(), eps, offset)


def norm_on_meta(x, weight, eps, offset=False, out=None):
    """A tensor of the right shape and dtype that holds no values at all."""
    return torch.empty_like(x, device="meta")


def norm_of_half_width(x, weight, eps, offset=False, out=None):
    """The first half of the hidden size only."""
    half = x.shape[-1] // 2
    return rmsnorm_reference(x[..., :half], weight[:half], eps, offset)


def norm_returning_none(x, weight, eps, offset=False, out=None):
    """Writes nowhere and returns nothing."""
    return None


def norm_that_exits(x, weight, eps, offset=False, out=None):
    """Ends the process, reporting success."""
    sys.exit(0)


def norm_that_hangs(x, weight, eps, offset=False, out=None):
    """Never returns, and swallows what an ordinary exception handler would catch on the way."""
    while True:
        try:
            time.sleep(3600)
        except Exception:  # noqa: BLE001 - as a careless kernel does
            pass


_calls = [0]


def norm_nan_every_second_call(x, weight, eps, offset=False, out=None):
    """Right on its first call, NaN on its second, and so on: the gate's second run of each call sees the NaN."""
    _calls[0] += 1
    result = rmsnorm_reference(x, weight, eps, offset)
    return result if _calls[0] % 2 else torch.full_like(result, float("nan"))


def norm_raising_keyboard_interrupt(x, weight, eps, offset=False, out=None):
    """The user's Ctrl-C arriving inside a kernel: that is the user's, not the kernel's failure."""
    raise KeyboardInterrupt


def raising_factory(module, fusion):
    """A ``[patch] with`` that fails while building the replacement."""
    raise ValueError(f"cannot patch {type(module).__name__}")


def factory_of_one_argument(module):
    """A ``[patch] with`` of the wrong signature."""
    return rmsnorm_forward(module, rmsnorm_reference)


def factory_that_exits(module, fusion):
    raise SystemExit(2)


def factory_that_hangs(module, fusion):
    while True:
        time.sleep(1)


def factory_returning_none(module, fusion):
    return None


not_callable = 42
