"""Fixtures of the kernel tests."""

import pytest
import torch


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty inside the op starts as NaN, so an output element left unwritten shows up."""
    plain_empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = plain_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_empty)
