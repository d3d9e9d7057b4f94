"""Test settings: no silent CPU fallback, a fixed seed per test, and ``fresh_dynamo``."""

import os

os.environ.setdefault("TORCHTPU_CPU_FALLBACK", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied around a test: graphs cached for another test's model would
    change what gets compiled (and counted) here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
