"""The recurrent modules on tpu against CPU: the fused LSTM and GRU cells forward and backward,
their state_dict round trip, and the fallback's error for an op that has no CPU kernel."""

import pytest
import torch
from torch.utils._pytree import tree_flatten

from torchtpu.testing.compare import assert_same, to_device

INPUT, HIDDEN = 4, 3


def _grads(module, x, hx):
    out = module(x, hx) if hx is not None else module(x)
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    # Weights 1, 2, ... make each output's gradient distinct (a swapped h and c would show).
    loss = sum((t * (i + 1)).sum() for i, t in enumerate(flat))
    inputs = [x, *module.parameters()] + ([] if hx is None else tree_flatten(hx)[0])
    return out, torch.autograd.grad(loss, inputs)


def _compare(cls, x, hx=None, **kwargs):
    torch.manual_seed(0)
    cpu = cls(INPUT, HIDDEN, **kwargs)
    tpu = cls(INPUT, HIDDEN, **kwargs)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    expected = _grads(cpu, x, hx)
    actual = _grads(tpu, to_device(x), to_device(hx))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls,kwargs", [
    (torch.nn.LSTM, {"bidirectional": True}),
    (torch.nn.LSTM, {"bias": False, "proj_size": 2}),
    (torch.nn.GRU, {"num_layers": 2, "batch_first": True}),
    (torch.nn.GRU, {"bias": False}),
])
def test_recurrent_layers_match_cpu(cls, kwargs, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "error")  # every op has a lowering
    x = torch.randn(3, 2, INPUT, requires_grad=True)
    _compare(cls, x, **kwargs)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
def test_cells_with_given_state_match_cpu(cls, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "error")
    x = torch.randn(2, INPUT, requires_grad=True)
    h = torch.randn(2, HIDDEN, requires_grad=True)
    hx = (h, torch.randn(2, HIDDEN, requires_grad=True)) if cls is torch.nn.LSTMCell else h
    _compare(cls, x, hx)


def test_fused_cells_check_sizes():
    gates = torch.randn(2, 12, device="tpu")
    with pytest.raises(RuntimeError, match="hidden state"):
        torch.ops.aten._thnn_fused_lstm_cell(gates, gates, torch.randn(2, 4, device="tpu"))
    with pytest.raises(RuntimeError, match="same 2-d shape"):
        torch.ops.aten._thnn_fused_gru_cell(gates, gates[:, :9], torch.randn(2, 4, device="tpu"))


def test_rnn_state_dict_loads():
    # torchtpu swaps parameters on conversion, which made load_state_dict swap too and fail
    # on the weak references the RNN modules keep to their weights (on CPU as well).
    source, target = torch.nn.LSTM(INPUT, HIDDEN), torch.nn.LSTM(INPUT, HIDDEN).to("tpu")
    target.load_state_dict(source.state_dict())
    assert_same(dict(target.state_dict()), dict(source.state_dict()))
    x = torch.randn(3, 1, INPUT)
    assert_same(target(x.to("tpu")), source(x), atol=1e-5, rtol=1e-5)


def test_fallback_names_an_op_without_a_cpu_kernel(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "warn")
    w = torch.randn(4, 2, device="tpu")
    with pytest.raises(NotImplementedError, match="no CPU kernel for it"):
        torch.ops.aten._cudnn_rnn_flatten_weight([w], 1, 2, 0, 3, 0, 1, False, False)
