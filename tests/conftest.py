"""Test settings: no silent CPU fallback, and a fixed seed per test."""

import os

os.environ.setdefault("TORCHTPU_CPU_FALLBACK", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
