"""A compiled graph's call does only the host work its graph needs (``compile/backend.py``):
its constants are read once while their values stay the same (``compile/graph_constants.py``:
a constant that reads as a view is otherwise a program call at every call), a CPU constant
crosses to the device, and a changed constant is read anew; the short read of an input
(``tensors.read_parts``) serves whole tensors only, never a view, a negative view or an offset
one."""

import cProfile
import gc
import pstats

import numpy as np
import pytest
import torch

import torchtpu.compile.backend as backend
from torchtpu.compile import graph_constants
from torchtpu.device import tensors
from torchtpu.device.hooks import HOOKS


@pytest.fixture
def launches(monkeypatch):
    """A list that collects each launched program's label."""
    seen = []

    def observe(label, fn, args):
        seen.append(label)
        return fn(*args)

    monkeypatch.setattr(HOOKS, "launch_observer", observe)
    return seen


def _graphs_of(compiled_before: set) -> list:
    return [o for o in gc.get_objects()
            if type(o) is backend.CompiledGraph and id(o) not in compiled_before]


def _existing() -> set:
    return {id(o) for o in gc.get_objects() if type(o) is backend.CompiledGraph}


def _empty_constant(a):
    # A 0-element tensor made while tracing: a graph constant whose storage is read as a
    # view of zero bytes (a program call per read).
    return torch.cat([torch.tensor([], dtype=torch.float32, device=a.device), a.flatten()]) * 2


def test_a_constant_is_read_once(launches, monkeypatch):
    torch._dynamo.reset()
    reads = []
    read = graph_constants.value
    monkeypatch.setattr(graph_constants, "value", lambda t: reads.append(t) or read(t))
    x = torch.randn(4, 4)
    f = torch.compile(_empty_constant, backend="tpu")
    xt = x.to("tpu")
    f(xt)
    assert len(reads) == 1
    launches.clear()
    for _ in range(3):
        out = f(xt)
    assert len(reads) == 1
    assert len(launches) == 3, launches  # the graph's program, once a call
    torch.testing.assert_close(out.cpu(), _empty_constant(x))


def _cpu_constant(a):
    return a + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(a.device)


def test_a_cpu_constant_crosses_to_the_device(launches):
    torch._dynamo.reset()
    x = torch.randn(4)
    f = torch.compile(_cpu_constant, backend="tpu")
    for _ in range(2):
        torch.testing.assert_close(f(x.to("tpu")).cpu(), _cpu_constant(x))


def _tpu_constant(a):
    return a * torch.tensor([1.0, 2.0, 3.0, 4.0], device=a.device)


def test_a_constant_written_since_is_read_anew():
    torch._dynamo.reset()
    before = _existing()
    x = torch.randn(4)
    f = torch.compile(_tpu_constant, backend="tpu")
    torch.testing.assert_close(f(x.to("tpu")).cpu(), _tpu_constant(x))
    (graph,) = _graphs_of(before)
    (node,) = graph.fn.constants
    constant = getattr(graph.gm, node.target)
    constant.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # a new array in its storage
    torch.testing.assert_close(f(x.to("tpu")).cpu(), x * torch.tensor([5.0, 6.0, 7.0, 8.0]))
    # A write into part of it (the storage takes a new array too).
    constant[1:3].fill_(0.0)
    torch.testing.assert_close(f(x.to("tpu")).cpu(), x * torch.tensor([5.0, 0.0, 0.0, 8.0]))


@pytest.mark.parametrize("view", ["prefix", "offset", "reshaped", "negative", "transposed",
                                  "dtype"])
def test_the_short_read_serves_whole_tensors_only(view):
    base_cpu = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    base = base_cpu.to("tpu")
    made = {
        "prefix": lambda b: b[:2],
        "offset": lambda b: b[2:],
        "reshaped": lambda b: b.view(16),
        "negative": lambda b: torch._neg_view(b),
        "transposed": lambda b: b.t(),
        "dtype": lambda b: b.view(torch.int32),
    }[view]
    t = made(base)
    array, geometry = tensors.read_parts(t)
    if geometry is None:  # only a negative view reads whole: read(t) resolved it
        assert view == "negative"
        value = array
    else:
        value = tensors.read(t)
    expected = made(base_cpu)
    if view == "negative":
        expected = expected.resolve_neg()
    assert tuple(value.shape) == tuple(expected.shape)
    torch.testing.assert_close(torch.from_numpy(np.array(value)), expected)
    # And through a compiled graph, which reads its inputs with it.
    torch._dynamo.reset()
    g = torch.compile(lambda a: a + 1, backend="tpu")
    torch.testing.assert_close(g(t).cpu(), expected + 1)


def _python_calls(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    return pstats.Stats(profile).total_calls / n


def test_a_plain_graph_call_makes_few_python_calls():
    """The graph function of ``a * 2 + 1`` (no mutations, constants, keys, donation, checks):
    its host work is a bounded number of Python calls, builtins included (59 before session
    17, 37 since: the steps the graph does not need skipped, the short read, the result's
    wrap)."""
    torch._dynamo.reset()
    before = _existing()
    x = torch.randn(4, 4).to("tpu")
    f = torch.compile(lambda a: a * 2 + 1, backend="tpu")
    f(x)
    (graph,) = _graphs_of(before)
    calls = _python_calls(lambda: graph([x]))
    assert calls < 39, calls  # the lambda and the profiler counted


def _returns_its_constant(a):
    c = torch.tensor([1.0, 2.0, 3.0, 4.0], device=a.device)
    return a + c, c


def test_a_constant_handed_back_is_a_copy():
    """A program may hand a constant back as an output: the output's storage gets a copy, so a
    write into it (which donates its storage's buffer) leaves the kept constant whole."""
    torch._dynamo.reset()
    x = torch.randn(4)
    f = torch.compile(_returns_its_constant, backend="tpu")
    for _ in range(3):
        total, c = f(x.to("tpu"))
        c.add_(10.0)
        torch.testing.assert_close(total.cpu(), x + torch.tensor([1.0, 2.0, 3.0, 4.0]))
        torch.testing.assert_close(c.cpu(), torch.tensor([11.0, 12.0, 13.0, 14.0]))
