"""Shared fixtures: tiny presets on the CPU (fp32, so comparisons can be tight) and an isolated optiq cache.

Without a GPU, Triton kernels run under the interpreter; the variable must be set before triton is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hopper_compile import HopperCompiler, LaunchRecorder  # noqa: E402

from optiq.models import load_model  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIQ_CACHE_DIR", str(tmp_path / "optiq-cache"))


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3-moe"])
def tiny_model(request):
    return load_model(request.param, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def hopper_compiler():
    compiler = HopperCompiler()
    yield compiler
    compiler.close()


@pytest.fixture(autouse=True)
def compiled_for_hopper(hopper_compiler):
    """A test run under the interpreter also has every kernel launch it made compiled for sm_90 (hopper_compile)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    with LaunchRecorder() as recorder:
        yield
    errors = hopper_compiler.errors(recorder.launches)
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
