"""A recipe's own code (its fusion module's import, its ``[patch] with`` factory, its kernel) run so that however it
fails, the failure is that recipe's, said in one line, and the run goes on without it.

User code may raise anything, ``SystemExit`` included (a kernel that calls ``sys.exit(0)`` must not end the run
with exit 0 and no report), so ``FAILURES`` is every exception but KeyboardInterrupt, which is the user's and stops
the run as an interrupt. It may also never return. A thread cannot be killed, so a watchdog thread could only
notice a hung kernel, not stop it; instead ``deadline`` arms a real-time timer whose SIGALRM handler raises
``DeadlineExceeded`` in the main thread, where the code runs, at its next bytecode. That ends Python loops, sleeps,
waits on locks and Triton's interpreter (the CPU's kernels are Python), and the recipe is rejected with "did not
return within N s"; the timer fires again every second, should the code catch the first. ``DeadlineExceeded`` is a
BaseException so that a kernel's own ``except Exception`` does not swallow it. What it cannot end is a native call
that never returns (a GPU kernel spinning forever blocks the host in a synchronize): no Python code runs until it
returns, in this thread or any other, short of killing the process. Off the main thread (where signals cannot be
delivered) or on a platform without setitimer, the block runs without a deadline.

How long is too long: an import, IMPORT_SECONDS; building a recipe's replacements, that and more for a larger model
(``build_deadline``); a kernel call (``call_deadline``), a floor (a GPU's first call of a Triton kernel compiles it,
autotuning included; a CPU has only the interpreter's overhead) plus ``SLOWDOWN`` times what the original path took
on the same inputs, so that larger models get proportionally longer; a patched decode (``decode_deadline``), a floor
of minutes, as its interpreted kernels on the CPU may take thousands of times torch's own ops.
``OPTIQ_USER_CODE_TIMEOUT_S`` sets one fixed number of seconds for all of them instead.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

from optiq.errors import OptiqError, first_line

IMPORT_SECONDS = 10.0  # a fusion module's import (it compiles nothing, so no device's floor) ...
BUILD_SECONDS_PER_BILLION = 10.0  # ... and a recipe's factories over a model, plus this per billion parameters
FLOOR_SECONDS = {"cuda": 60.0, "cpu": 5.0}  # a kernel call at the least (the CPU's first interpreted call of a
# kernel pays a one-time start-up that a loaded machine stretches to seconds)
DECODE_FLOOR_SECONDS = 300.0  # a patched decode at the least: every kernel of every recipe, interpreted on the CPU
# (~10^4 times torch's eager op), for every step; a kernel that hangs does so at its first call, in the per-call check
SLOWDOWN = 1000.0  # ... plus this many times what the original path took on the same inputs
TIMEOUT_VARIABLE = "OPTIQ_USER_CODE_TIMEOUT_S"


class DeadlineExceeded(BaseException):
    """User code ran past its ``deadline`` (a BaseException: see the module docstring)."""


FAILURES = (Exception, SystemExit, DeadlineExceeded)  # what a recipe's code may raise that fails the recipe alone


class UserCodeFailed(Exception):
    """User code failed (``run``); the message says where and how. Never a ValueError, which patch kinds keep for a
    model they cannot patch."""


def run(what: str, function, *args):
    """``function(*args)``, user code, with any of its failures as one UserCodeFailed("{what} raised ...")."""
    try:
        return function(*args)
    except FAILURES as exc:
        raise UserCodeFailed(f"{what} {describe(exc)}") from None

_armed = threading.local()


def describe(exc: BaseException) -> str:
    """What user code did, as a phrase of at most 300 characters to follow its name: "raised TypeError: ...",
    "called sys.exit(0)", "did not return within 5 s", "failed: <an OptiqError's line>"; a UserCodeFailed is a whole
    sentence already."""
    if isinstance(exc, (DeadlineExceeded, UserCodeFailed)):
        return str(exc)
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"[:300]
    if isinstance(exc, OptiqError):  # optiq's own one-line report of what the code did (the engine's, say)
        return f"failed: {first_line(exc)}"[:300]
    return f"raised {type(exc).__name__}: {first_line(exc)}"[:300]


def seconds_allowed(floor: float, original_seconds: float = 0.0) -> float:
    """The deadline of user code whose original path took ``original_seconds`` (module docstring)."""
    fixed = os.environ.get(TIMEOUT_VARIABLE)
    if fixed is not None:
        try:
            seconds = float(fixed)
        except ValueError:
            raise OptiqError(f"{TIMEOUT_VARIABLE} must be a number of seconds, not '{fixed}'") from None
        if not seconds > 0:
            raise OptiqError(f"{TIMEOUT_VARIABLE} must be a positive number of seconds, not '{fixed}'")
        return seconds
    return floor + SLOWDOWN * original_seconds


def import_deadline() -> float:
    """The deadline of importing a fusion module."""
    return seconds_allowed(IMPORT_SECONDS)


def build_deadline(parameters: int) -> float:
    """The deadline of building one recipe's replacements over a model of ``parameters`` parameters (factories that
    concatenate or restack weights take time in proportion)."""
    return seconds_allowed(IMPORT_SECONDS + BUILD_SECONDS_PER_BILLION * parameters / 1e9)


def call_deadline(device_type: str, original_seconds: float) -> float:
    """The deadline of a kernel call on a device of ``device_type``."""
    return seconds_allowed(FLOOR_SECONDS.get(device_type, FLOOR_SECONDS["cuda"]), original_seconds)


def decode_deadline(original_seconds: float) -> float:
    """The deadline of a patched decode whose unpatched decode took ``original_seconds``."""
    return seconds_allowed(DECODE_FLOOR_SECONDS, original_seconds)


@contextmanager
def deadline(seconds: float):
    """The block, ended by ``DeadlineExceeded("did not return within {seconds} s")`` if it runs longer. Inside another
    deadline it adds none of its own (the outer one bounds it)."""
    if (threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer")
            or getattr(_armed, "active", False)):
        yield
        return

    def expire(signum, frame):
        raise DeadlineExceeded(f"did not return within {seconds:.3g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    _armed.active = True
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _armed.active = False
