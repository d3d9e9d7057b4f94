"""Values computed later read arrays that the program goes on to write: Strict's held casts and
calls (``eager/lazy_casts.py``) read their sources when a reader computes them, DeferAndFuse's
recording (``eager/defer.py``) and an optimizer step's fused program
(``compile/optimizer_steps.py``) read their inputs when they flush. Meanwhile the tensors may be
written in place, through a view, by a ``.data`` swap, by an op that donates its argument
(``jax_op(donate_argnums=...)``) or by a captured replay, and every one of those that gives a
buffer away must first let go of, copy around or compute each value still reading it
(``device/ownership.py``'s ``lend``, ``still_lent`` and ``donation_refusal``,
``fused_program.donatable``, ``capture._copy_lent``); else the later value reads a deleted
buffer ("Array has been deleted", issue 49) or one reused for another value.

Each pattern runs against CPU, in Strict and DeferAndFuse; under bfloat16 autocast against Debug,
which holds nothing (CPU's bfloat16 rounds otherwise).
"""

import contextlib

import jax
import pytest
import torch
from torch import nn

from torchtpu.eager import lazy_casts
from torchtpu.kernels.jax_op import jax_op

EagerMode = torch.tpu.EagerMode
DEFER, DEBUG = EagerMode.DEFER_AND_FUSE, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
MODES = pytest.mark.parametrize("mode", [None, DEFER], ids=["strict", "defer"])


def _mode(mode):
    return contextlib.nullcontext() if mode is None else torch.tpu.set_eager_mode(mode)


def _held(t: torch.Tensor) -> bool:
    return type(getattr(t.untyped_storage(), "_tpu_array", None)) is lazy_casts.Converted


def _close(got: list, want: list, tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.float().cpu(), w.float().cpu(), rtol=tol, atol=tol,
                                   msg=lambda m, i=i: f"value {i}: {m}")


def _rand(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ held reads, then writes

def _cast_then_in_place(dev, held):
    x = _rand(6, 8).to(dev)
    out = []
    for _ in range(3):
        h = x.to(torch.bfloat16)
        held.append(_held(h))
        x.add_(1)
        out.append(h.float() * 2)
    return [*out, x]


def _cast_then_view_writes(dev, held):
    x = _rand(6, 8).to(dev)
    out = []
    for i in range(3):
        h = x.to(torch.bfloat16)
        held.append(_held(h))
        x[1:3] = float(i)           # a run of rows
        x[:, 2].mul_(3)             # a strided column
        out.append(h * 2)
    return [*out, x]


def _call_then_view_writes(dev, held):
    x, w = _rand(6, 8).to(dev), _rand(6, 8, seed=1).to(dev)
    out = []
    for i in range(3):
        y = x * w + 1
        held.append(_held(y))
        x[0].fill_(i)
        w[2:4, 1:3] = -1.0
        x.t()[1].add_(2)            # a view of a view
        out.append(y.sum(0))
    return [*out, x, w]


def _call_then_data_swaps(dev, held):
    x, w = _rand(6, 8).to(dev), _rand(6, 8, seed=1).to(dev)
    out = []
    for i in range(3):
        y = x * w
        held.append(_held(y))
        x.data = x.data * 0 + i
        w.data[1] = 5.0
        out.append(y + 0)
    return out


def _accumulated_then_read(dev, held):
    # A gradient's accumulation: the sum is held in the tensor it adds into, and read after.
    g, x = _rand(5, 4).to(dev), _rand(5, 4, seed=1).to(dev)
    out = []
    for _ in range(3):
        new = x * 2
        held.append(_held(new))
        g.add_(new)
        g[0].mul_(0.5)
        out.append(g * 1)
    return [*out, g]


PATTERNS = {
    "a cast, then written in place": _cast_then_in_place,
    "a cast, then written through views": _cast_then_view_writes,
    "a call, then its inputs written through views": _call_then_view_writes,
    "a call, then its inputs swapped by .data": _call_then_data_swaps,
    "an accumulation, then written through a view": _accumulated_then_read,
}


@MODES
@pytest.mark.parametrize("name", PATTERNS)
def test_values_read_before_a_write_keep_what_they_read(name, mode, buckets_off):
    want = PATTERNS[name]("cpu", [])
    held = []
    with _mode(mode):
        got = [t.cpu() for t in PATTERNS[name]("tpu", held)]
    _close(got, want)
    if mode is None:
        assert any(held)  # Strict held the values written after (what the test is about)


# ------------------------------------------------------------------ training steps

def _optimizer(kind: str, params):
    return {
        "adamw foreach": lambda: torch.optim.AdamW(params, lr=0.05, foreach=True),
        "adamw for-loop": lambda: torch.optim.AdamW(params, lr=0.05, foreach=False),
        "adamw fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
        "adam": lambda: torch.optim.Adam(params, lr=0.05),
        "sgd momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    }[kind]()


def _train(dev, kind: str, between: str, autocast: bool = False, steps: int = 4) -> list:
    """Steps with no zero_grad (each backward adds into the gradients the last step read), with
    ``between`` done after each backward or step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).to(dev)
    opt = _optimizer(kind, m.parameters())
    out = []
    for i in range(steps):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            y = m(_rand(4, 6, seed=i).to(dev))
        loss = y.float().pow(2).sum()
        loss.backward()
        if between == "clip, and reads before the step":
            out.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            out.append(m[0].weight.grad * m[0].weight)    # held, over what the step writes
            out.append(m[2].bias.grad.to(torch.bfloat16))
        opt.step()
        out.append(loss.detach())
        if between == "views written" or autocast:
            with torch.no_grad():
                m[0].weight[0].mul_(0.5)
                m[2].bias.grad[1:].add_(1.0)
        if between == "a .grad dropped" and i == 1:
            m[0].bias.grad = None
    return [*out, *(p.detach() for p in m.parameters())]


STEPS = [
    ("adamw foreach", "none"),
    ("adamw foreach", "views written"),
    ("adamw foreach", "clip, and reads before the step"),
    ("adamw for-loop", "a .grad dropped"),
    ("adamw fused", "none"),
    ("adam", "views written"),
    ("sgd momentum", "none"),
    ("sgd momentum", "clip, and reads before the step"),
]


@MODES
@pytest.mark.parametrize("kind,between", STEPS, ids=[f"{k}-{b}" for k, b in STEPS])
def test_accumulating_steps_equal_cpu(kind, between, mode):
    want = _train("cpu", kind, between)
    with _mode(mode):
        got = [t.cpu() for t in _train("tpu", kind, between)]
    _close(got, want, 1e-4)


@pytest.mark.parametrize("kind", ["adamw foreach", "sgd momentum"])
def test_accumulating_bfloat16_autocast_steps_equal_debug(kind):
    with _mode(DEBUG):
        want = [t.cpu() for t in _train("tpu", kind, "views written", autocast=True)]
    got = [t.cpu() for t in _train("tpu", kind, "views written", autocast=True)]
    _close(got, want, 1e-6)


@MODES
def test_steps_over_gradients_made_on_the_device_equal_cpu(mode):
    # Gradients from a device draw: their arrays are not committed to a device (their programs
    # read no committed input), so the step's program places them beside its other inputs, a
    # new array over the same buffer that the .grad still holds: never donated (issue 49).
    torch.manual_seed(0)
    cpu = nn.Linear(4, 5)
    tpu = nn.Linear(4, 5).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.25) for m in (cpu, tpu)]
    with _mode(mode):
        for i in range(3):
            x = _rand(3, 4, seed=i)
            grad = torch.randn(3, 5, device="tpu")
            tpu(x.to("tpu")).backward(grad)
            cpu(x).backward(grad.cpu())
            for opt in opts:
                opt.step()
        got = [p.detach().cpu() for p in tpu.parameters()]
    _close(got, [p.detach() for p in cpu.parameters()], 1e-5)


# ------------------------------------------------------------------ donating calls and replays

def _update(cache: jax.Array, rows: jax.Array, at: int) -> jax.Array:
    return jax.lax.dynamic_update_slice(cache, rows, (at, 0))


update = jax_op("test_held_sources::update", _update, donate_argnums=(0,))


@pytest.mark.parametrize("reader", ["cast", "call"])
def test_a_donating_op_computes_the_held_values_reading_its_buffer_first(reader, buckets_off):
    # Strict held h over the cache's buffer; the op takes that buffer. Refused before ("a
    # collective still reads it"), though nothing the user did lends it: as with nothing held
    # (Debug, CPU), h keeps the value it read and the op writes into the buffer.
    cpu, rows = _rand(16, 8), _rand(2, 8, seed=1)
    cache = cpu.to("tpu").clone()
    if reader == "cast":
        h, want = cache.to(torch.bfloat16), cpu.to(torch.bfloat16)
    else:
        h, want = cache * torch.full((16, 8), 3.0, device="tpu"), cpu * 3
    assert _held(h)
    out = update(cache, rows.to("tpu"), 3)
    assert torch.equal(h.cpu(), want)
    expected = cpu.clone()
    expected[3:5] = rows
    assert torch.equal(out.cpu(), expected)
    with pytest.raises(RuntimeError, match="donated to jax_op"):
        cache.cpu()


def test_a_donating_op_sees_the_buffer_of_a_value_defer_and_fuse_computed(buckets_off):
    # The cache's storage still holds DeferAndFuse's computed value (not its array), whose
    # array a held cast reads: the refusal compared the value's id with the lent arrays', and
    # the op deleted the buffer under the cast ("Array has been deleted" at its reader).
    cpu, rows = _rand(16, 8), _rand(2, 8, seed=1)
    cache = cpu.to("tpu").clone()
    with torch.tpu.set_eager_mode(DEFER):
        cache.add_(1)
    h = cache.to(torch.bfloat16)
    out = update(cache, rows.to("tpu"), 3)
    assert torch.equal(h.cpu(), (cpu + 1).to(torch.bfloat16))
    expected = cpu + 1
    expected[3:5] = rows
    assert torch.equal(out.cpu(), expected)


@MODES
@pytest.mark.parametrize("reader", ["sin", "cast", "product"])
def test_a_replay_leaves_what_was_read_before_it(reader, mode):
    # The replay donates p's buffer to the program that writes p. Under DeferAndFuse the
    # recording read that buffer as an input, and ran after the replay had deleted it.
    p, q = _rand(8, 4).to("tpu"), _rand(8, 4, seed=1).to("tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        p.mul_(2).add_(q)
    read = {"sin": torch.sin, "cast": lambda t: t.to(torch.bfloat16),
            "product": lambda t: t * q}[reader]
    cpu_p, cpu_q = p.cpu(), q.cpu()
    got, want = [], []
    with _mode(mode):
        for _ in range(3):
            got.append(read(p))
            want.append(read(cpu_p) if reader != "product" else cpu_p * cpu_q)
            g.replay()
            cpu_p = cpu_p * 2 + cpu_q
        got = [t.cpu() for t in (*got, p)]
    _close(got, [*want, cpu_p], 1e-2 if reader == "cast" else 1e-5)
