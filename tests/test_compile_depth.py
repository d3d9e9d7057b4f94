"""Tracing ``torchtpu.scan_layers`` does not grow faster than the model: Dynamo reads each layer's
tensors by attribute, without a ``named_parameters()`` walk, and a patched decoder's blocks are
checked (and their tensors' names taken) at the patch, not in every trace.

Dynamo interprets every Python line a trace runs (a named_parameters walk, an attribute read),
so the Python around the scan is what grew with depth (``bench/compile_depth.py``: the scanned
8-layer Llama's Dynamo time was 4.8x the 2-layer one's). Dynamo alone is what is measured here
(the "eager" backend, CPU tensors): no XLA program is built.
"""

import torch

import torchtpu
from torchtpu import layers as layers_mod


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class _Decoder(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers[: len(self.layers)]:  # as Hugging Face decoders slice them
            x = layer(x)
        return x


def _counting(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(layers_mod, name)

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(layers_mod, name, counted)
    return calls


def test_a_patched_decoder_trace_walks_no_layer_and_skips_the_check(monkeypatch):
    torch.manual_seed(0)
    n = 5
    model = _Decoder(n)
    x = torch.randn(3, 8)
    ref = model(x)
    torchtpu.scan_layers.patch(model)  # checks the blocks here
    reads = _counting(monkeypatch, "_tensors")
    checks = _counting(monkeypatch, "_check_identical")
    torch._dynamo.reset()
    out = torch.compile(model, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, ref)
    assert checks == []
    assert reads == []  # was layer 0's names, then each layer's tensors: n + 1 walks


def test_a_part_of_a_patched_decoder_is_still_its_blocks_in_order():
    model = torchtpu.scan_layers.patch(_Decoder(4))
    blocks = list(model.layers._modules.values())
    assert list(model.layers[1:3]._modules.values()) == blocks[1:3]
    assert list(model.layers[::-1]._modules.values()) == blocks[::-1]
    # The whole range is the container itself: a copy costs a trace an add_module per block.
    assert model.layers[:] is model.layers


def test_a_direct_scan_layers_call_is_still_checked_under_compile(monkeypatch):
    blocks = torch.nn.ModuleList(_Block() for _ in range(3))
    checks = _counting(monkeypatch, "_check_identical")
    torch._dynamo.reset()
    torch.compile(lambda x: torchtpu.scan_layers(blocks, x), backend="eager",
                  fullgraph=True)(torch.randn(2, 8))
    assert len(checks) == 1
