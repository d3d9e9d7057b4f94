"""``torch._higher_order_ops.scan`` as one XLA while loop and ``torchtpu.scan_layers``: values and
gradients equal CPU's unscanned ones, one while loop per program (forward and backward), random
draws inside the body, the Hugging Face switch, and refusals of blocks that are not identical."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

import torchtpu
from torchtpu import metrics
from torchtpu.layers import scan_layers


def _compiled(fn, hlo: list):
    return torch.compile(fn, backend="tpu", fullgraph=True,
                         options={"debug_callback": lambda gm, text: hlo.append(text)})


def _leaves(*ts):
    return [t.detach().clone().to("tpu").requires_grad_() for t in ts]


def _rnn(h, w, xs):
    def body(c, x):
        c2 = torch.tanh(c @ w + x)
        return c2, c2.sum()
    c, ys = scan(body, h, xs)
    return c.sum() + (ys ** 2).sum()


def test_scan_is_one_while_loop_forward_and_backward_with_cpu_gradients():
    torch.manual_seed(0)
    h, w, xs = torch.randn(4, 6), torch.randn(6, 6) * 0.5, torch.randn(7, 4, 6)
    cpu = [t.clone().requires_grad_() for t in (h, w, xs)]
    _rnn(*cpu).backward()
    hlo: list = []
    dev = _leaves(h, w, xs)
    before = metrics.snapshot().get("compiled_graphs", 0)
    out = _compiled(_rnn, hlo)(*dev)
    out.backward()
    assert metrics.snapshot().get("compiled_graphs", 0) - before == 2  # forward, backward
    assert [t.count("stablehlo.while") for t in hlo] == [1, 1]
    assert torch.allclose(out.cpu(), _rnn(h, w, xs), atol=1e-5)
    for c, d in zip(cpu, dev, strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5)


def test_random_draws_in_the_body_differ_per_iteration_and_backward_reuses_the_mask():
    def fn(h, xs):
        def body(c, x):
            c = F.dropout(c + x, 0.5)
            return c, c.clone()
        return scan(body, h, xs)[1]

    h, xs = _leaves(torch.ones(8, 16), torch.ones(5, 8, 16))
    ys = _compiled(fn, [])(h, xs)
    ys.sum().backward()
    kept = ys.detach().cpu() != 0
    assert not all(torch.equal(kept[0], kept[i]) for i in range(1, 5))
    # A dropped element of the last iteration passes no gradient to that iteration's input.
    assert bool((xs.grad[-1].cpu()[~kept[-1]] == 0).all())


class _Block(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, scale):
        return x + torch.tanh(self.lin(self.norm(x))) * scale


def _layers(n: int):
    torch.manual_seed(1)
    cpu = torch.nn.ModuleList(_Block() for _ in range(n))
    return cpu, copy.deepcopy(cpu).to("tpu")


def _loss(layers, x, scale):
    return (scan_layers(layers, x, scale=scale) ** 2).mean()


def test_scan_layers_compiled_is_one_loop_with_the_unscanned_cpu_gradients():
    cpu, dev = _layers(5)
    x, s = torch.randn(3, 16), torch.tensor(0.7)
    ref = _loss(cpu, x, s)  # eager: the layers one by one
    ref.backward()
    hlo: list = []
    out = _compiled(lambda xx, ss: _loss(dev, xx, ss), hlo)(x.to("tpu"), s.to("tpu"))
    out.backward()
    assert [t.count("stablehlo.while") for t in hlo] == [1, 1]
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    for (name, c), d in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_scan_layers_program_does_not_grow_with_depth():
    sizes = []
    for n in (2, 6):
        _, dev = _layers(n)
        hlo: list = []
        _compiled(lambda xx, ss, d=dev: _loss(d, xx, ss), hlo)(
            torch.randn(3, 16, device="tpu"), torch.tensor(0.5, device="tpu"))
        sizes.append(hlo[0].count("stablehlo.tanh"))  # the block's ops appear once
    assert sizes == [1, 1], sizes


def test_scan_layers_in_eager_and_in_a_whole_step_runs_the_layers_with_cpu_results():
    cpu, dev = _layers(3)
    x, s = torch.randn(3, 16), torch.tensor(0.5)
    copt = torch.optim.SGD(cpu.parameters(), lr=0.1)
    dopt = torch.optim.SGD(dev.parameters(), lr=0.1)

    def step(layers, opt, xx, ss):
        loss = _loss(layers, xx, ss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(step, backend="tpu")
    for _ in range(3):
        ref = step(cpu, copt, x, s)
        got = compiled(dev, dopt, x.to("tpu"), s.to("tpu"))
        torch.testing.assert_close(got.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    for c, d in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(d.detach().cpu(), c.detach(), atol=1e-5, rtol=1e-5)


def test_scan_layers_refuses_blocks_that_differ():
    layers = torch.nn.ModuleList([_Block(16), _Block(16)]).to("tpu")
    layers[1].norm.eps = 1e-3
    fn = torch.compile(lambda x: scan_layers(layers, x, scale=1.0), backend="tpu",
                       fullgraph=True)
    with pytest.raises(Exception, match="scan_layers: layer 1 sets norm.eps"):
        fn(torch.randn(2, 16, device="tpu"))


def test_hugging_face_patch_scans_the_decoder_with_cpu_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa")
    cpu = transformers.AutoModelForCausalLM.from_config(config)
    dev = torchtpu.scan_layers.patch(copy.deepcopy(cpu).to("tpu"))
    assert list(dev.state_dict()) == list(cpu.state_dict())
    x, y = torch.randint(64, (2, 8)), torch.randint(64, (2, 8))

    def loss(model, xx, yy):
        return F.cross_entropy(model(input_ids=xx, use_cache=False).logits.flatten(0, 1),
                               yy.flatten())

    ref = loss(cpu, x, y)
    ref.backward()
    hlo: list = []
    out = torch.compile(loss, backend="tpu", options={
        "debug_callback": lambda gm, text: hlo.append(text)})(dev, x.to("tpu"), y.to("tpu"))
    out.backward()
    assert [t.count("stablehlo.while") for t in hlo] == [1, 1]
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    for (name, c), d in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5, msg=name)
