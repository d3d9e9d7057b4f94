"""Ops whose lowering reads only an input's shape and dtype (``lowers(shape_only)``): random
draws in place, ``fill_``, ``zero_``.

Such a call takes no storage array: ``torch.empty(...)`` then an init or ``zero_`` reads no
never-written storage (each read made a zeros program per shape: 4 of the 25 programs a Llama
compiled in init, 2 of its first step's). What the call still depends on, each changed alone
here against CPU: the target's shape, dtype and layout (a view, a transposed or strided one,
one of a never-written storage, whose other elements stay zeros), the fill value (a number or
a tensor), and the generator's state, which a draw advances as before.
"""

import pytest
import torch
from torch import nn

from torchtpu import metrics
from torchtpu.eager.modes import EagerMode, set_eager_mode
from torchtpu.lowering.registry import TABLE

aten = torch.ops.aten
MODES = [EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
         EagerMode.DEFER_AND_FUSE]


def _counter(name: str) -> int:
    return metrics.snapshot().get(name, 0)


def _programs() -> int:
    snap = metrics.snapshot()
    return sum(snap.get(n, 0) for n in ("executable_compiles", "persistent_cache_hits",
                                        "programs_loaded_by_key"))


def test_the_records_name_their_shape_only_arguments():
    for op in (aten.uniform.default, aten.normal_functional.default, aten.bernoulli.p,
               aten.bernoulli.Tensor, aten.random.default, aten.exponential.default,
               aten.fill.Scalar, aten.fill.Tensor, aten.zero.default):
        assert TABLE[op].shape_only == ("self",), op
    # bernoulli(p) draws with p's values as probabilities: they are read.
    assert TABLE[aten.bernoulli.default].shape_only == ()


def test_linear_init_reads_no_unwritten_storage():
    # Shapes no other test makes: the delta is this construction's own programs.
    torch.tpu.synchronize()  # its barrier program compiled before
    reads, programs = _counter("unwritten_reads"), _programs()
    layer = nn.Linear(37, 29, device="tpu")
    torch.tpu.synchronize()
    assert _counter("unwritten_reads") == reads
    # kaiming_uniform_ of the weight, uniform_ of the bias (bounds differ): no zeros program.
    assert _programs() - programs == 2
    bound = 1 / 37 ** 0.5
    assert layer.bias.cpu().abs().max() <= bound and layer.weight.cpu().abs().max() <= bound


def test_adamw_first_step_reads_no_unwritten_storage():
    w = nn.Parameter(torch.randn(31, 17, device="tpu"))
    w.grad = torch.randn(31, 17, device="tpu")
    opt = torch.optim.AdamW([w], lr=0.1)
    reads = _counter("unwritten_reads")
    opt.step()  # its state: zeros_like (empty_like, then zero_) of w, twice
    torch.tpu.synchronize()
    assert _counter("unwritten_reads") == reads
    state = opt.state[w]
    assert torch.equal(state["exp_avg"].cpu(), (1 - 0.9) * w.grad.cpu())


@pytest.mark.parametrize("mode", MODES)
def test_fill_and_zero_against_cpu(mode):
    base = torch.randn(6, 8)
    cases = [
        lambda x: x.fill_(2.5),
        lambda x: x.zero_(),
        lambda x: x[1:4].fill_(-1.0),            # a view: the rest keeps its values
        lambda x: x.t()[::2].zero_(),            # strided columns
        lambda x: x.fill_(torch.tensor(7.0, device=x.device)),
        lambda x: x.to(torch.float16).fill_(1 / 3),
        lambda x: x.to(torch.int32).fill_(5),
        lambda x: x.bool().fill_(True),
        lambda x: torch.full_like(x, 4.0),
        lambda x: torch.zeros_like(x.t()),       # a transposed layout kept
    ]
    with set_eager_mode(mode):
        for case in cases:
            got, want = case(base.to("tpu").clone()), case(base.clone())
            assert got.dtype == want.dtype and got.stride() == want.stride()
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_in_place_on_a_view_of_an_unwritten_storage(mode):
    with set_eager_mode(mode):
        t = torch.empty(4, 4, device="tpu")
        t[1].uniform_(2, 3)
        u = torch.empty(4, 4, device="tpu")
        u[:, 2].fill_(5)
        t, u = t.cpu(), u.cpu()
    # The rest of a never-written storage reads as zeros, as it did before the call.
    assert ((t[1] >= 2) & (t[1] < 3)).all()
    assert torch.equal(torch.cat([t[:1], t[2:]]), torch.zeros(3, 4))
    want = torch.zeros(4, 4)
    want[:, 2] = 5
    assert torch.equal(u, want)


@pytest.mark.parametrize("mode", MODES)
def test_a_draw_is_the_same_whatever_its_target_held(mode):
    # The draw depends on the generator and the shape alone: a never-written target, a
    # written one, and one holding a pending value draw alike, and leave the generator alike.
    def draws(make):
        torch.tpu.manual_seed(123)
        x = make()
        x.uniform_(-1, 1)
        y = make().normal_(0.0, 2.0)
        z = make().bernoulli_(0.3)
        after = torch.rand(5, device="tpu")
        return [v.cpu() for v in (x, y, z, after)], torch.tpu.get_rng_state()

    with set_eager_mode(mode):
        fresh = draws(lambda: torch.empty(64, 3, device="tpu"))
        written = draws(lambda: torch.ones(64, 3, device="tpu"))
        pending = draws(lambda: torch.ones(64, 3, device="tpu") * 3)
    for other in (written, pending):
        for a, b in zip(fresh[0], other[0]):
            assert torch.equal(a, b)
        assert torch.equal(fresh[1], other[1])
    x, y, z, _ = fresh[0]
    assert x.min() >= -1 and x.max() < 1 and set(z.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_a_draw_keeps_its_targets_dtype_and_shape(dtype):
    x = torch.empty(3, 50, device="tpu", dtype=dtype)
    if dtype.is_floating_point:
        x.exponential_()
        assert (x.cpu() >= 0).all()
    else:
        x.random_(3, 9)
        c = x.cpu()
        assert c.min() >= 3 and c.max() < 9
    assert x.dtype == dtype and x.shape == (3, 50)
    wide = torch.empty(7, device="tpu").random_(0, 4)
    assert wide.dtype == torch.float32 and set(wide.cpu().tolist()) <= {0.0, 1.0, 2.0, 3.0}
