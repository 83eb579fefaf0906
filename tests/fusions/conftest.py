"""Fixtures of the kernel tests."""

import os

import pytest
import torch
from hopper_compile import HopperCompiler, LaunchRecorder


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty inside the op starts as NaN, so an output element left unwritten shows up."""
    plain_empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = plain_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.fixture(scope="session")
def hopper_compiler():
    compiler = HopperCompiler()
    yield compiler
    compiler.close()


@pytest.fixture(autouse=True)
def compiled_for_hopper(request):
    """A test run under the interpreter also has every kernel launch it made compiled for sm_90 (hopper_compile)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    compiler = request.getfixturevalue("hopper_compiler")
    with LaunchRecorder() as recorder:
        yield
    errors = compiler.errors(recorder.launches)
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
