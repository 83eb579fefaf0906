"""Every launch a CPU kernel test makes under the Triton interpreter is also compiled for Hopper, on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler, so a kernel can pass every CPU test and still fail to
compile for the GPU (a helper whose constexpr branches return two types, an op the backend lowers differently, the
PDL wait's inline assembly), which only the device tests would show, when a GPU is lent. Here each launch is
described (its tensors' dtypes and alignment, its scalars, its constexprs) and a worker process without the
interpreter compiles it with Triton's real compiler for an sm_90 target, through ptxas to a cubin: once as the test
launched it, and once as a GPU launches it (``gpu_variant``: with programmatic dependent launch and its weight
prefetch, and the tensor-core dots the interpreter cannot run). Shapes are what the CPU tests use; the kernels at
the presets' shapes are the device tests' part.

The worker is this file run as a script: it reads one launch a line (JSON) and answers one line, ``{"error": ...}``.
"""

import json
import os
import subprocess
import sys
import warnings

HALF_DTYPES = ("torch.bfloat16", "torch.float16")


def describe(value):
    """A launch argument as JSON: a tensor by what compilation specialises on (dtype, 16-byte alignment)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a launch argument of type {type(value).__name__} cannot be described for compilation")


def gpu_variant(args: list, kwargs: dict) -> dict:
    """The constexprs a GPU launch sets where the interpreter's differ: PDL on (with a few prefetched weight lines
    where the kernel prefetches), dots on tensor cores in the operands' own precision (fp32 IEEE dots only for fp32
    operands), no upcast of a dot's operands."""
    half = any(isinstance(a, dict) and a["dtype"] in HALF_DTYPES for a in args)
    switches = {"USE_PDL": True, "PREFETCH_LINES": 4, "UPCAST_DOT": False, "FP32_DOT": not half}
    return {**kwargs, **{name: value for name, value in switches.items() if name in kwargs}}


class LaunchRecorder:
    """Within ``with``, every interpreted kernel launch is described into ``launches`` (each distinct one once)."""

    def __init__(self):
        self.launches: dict[str, dict] = {}

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._class, self._run = InterpretedFunction, InterpretedFunction.run
        recorder = self

        def recording_run(kernel, *args, grid, warmup, **kwargs):
            launch = {"module": kernel.fn.__module__, "name": kernel.fn.__name__,
                      "args": [describe(a) for a in args], "kwargs": {k: describe(v) for k, v in kwargs.items()}}
            recorder.launches.setdefault(json.dumps(launch, sort_keys=True), launch)
            return recorder._run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run
        return self

    def __exit__(self, *exc):
        self._class.run = self._run


class HopperCompiler:
    """The worker process, started at the first launch to compile; ``errors(launches)`` compiles those not compiled
    before and answers their failures."""

    def __init__(self):
        self.worker = None
        self.verdicts: dict[str, str | None] = {}

    def errors(self, launches: dict[str, dict]) -> list[str]:
        for key, launch in launches.items():
            if key not in self.verdicts:
                self.verdicts[key] = self._ask(launch)
        return [self.verdicts[key] for key in launches if self.verdicts[key]]

    def _ask(self, launch: dict) -> str | None:
        if self.worker is None:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            self.worker = subprocess.Popen([sys.executable, __file__], env=env, text=True, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE)
        self.worker.stdin.write(json.dumps(launch) + "\n")
        self.worker.stdin.flush()
        answer = self.worker.stdout.readline()
        if not answer:
            raise RuntimeError(f"the Hopper compile worker died (exit {self.worker.wait()})")
        return json.loads(answer)["error"]

    def close(self):
        if self.worker is not None:
            self.worker.stdin.close()
            self.worker.wait(timeout=60)


def _compile(launch: dict) -> str | None:
    """Compile one launch and its GPU variant; the first failure as a line, or None."""
    import importlib

    import torch

    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])

    def build(value):
        if isinstance(value, dict):  # a tensor: its dtype, at an address as aligned as the test's
            tensor = torch.empty(32, dtype=getattr(torch, value["dtype"].removeprefix("torch.")))
            return tensor if value["aligned"] else tensor[1:]
        return value

    args = [build(a) for a in launch["args"]]
    for variant, kwargs in (("as launched", launch["kwargs"]), ("as a GPU launches it", gpu_variant(
            launch["args"], launch["kwargs"]))):
        options = {k: build(v) for k, v in kwargs.items() if k != "launch_pdl"}
        try:
            kernel.warmup(*args, grid=(1,), **options)
        except Exception as error:  # noqa: BLE001 - any compiler failure is the answer
            causes = [error]
            while causes[-1].__cause__ is not None:
                causes.append(causes[-1].__cause__)
            where = " ".join(str(causes[-2] if len(causes) > 1 else error).split())[-300:]  # the source line
            return (f"{launch['name']} ({variant}; constexprs {kwargs}) does not compile for sm_90: ...{where} "
                    f"{type(causes[-1]).__name__}: {' '.join(str(causes[-1]).split())[:400]}")
    return None


def _serve():
    """The worker: Triton's compiler aimed at an sm_90 GPU that is not here (ptxas runs; nothing is loaded)."""
    import triton
    from triton.backends.compiler import GPUTarget

    warnings.simplefilter("ignore")

    class HopperTarget:
        """The driver queries compilation makes, answered for an H100/H200 without one."""

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(HopperTarget())
    for line in sys.stdin:
        print(json.dumps({"error": _compile(json.loads(line))}), flush=True)


if __name__ == "__main__":
    _serve()
