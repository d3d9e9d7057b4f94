"""Constants sent from the host (``lowers(constant=...)``, ``constants.host_constant``).

``torch.zeros``/``ones``/``full``, ``zero_``/``fill_`` and a never-written storage's first read
at a new shape compiled a program each (AdamW's first step: a ``zero`` per parameter shape); a
small one whose value its dtype holds exactly is now sent from the host. What the shortcut
depends on, each changed alone against CPU: the value (exact, rounded, NaN, a signed zero, out
of the dtype's range), the dtype, the size (past the bound: a program), a transfer guard (a
program), a view target, and a reading call (a tensor fill value: a program).
"""

import jax
import pytest
import torch

from torchtpu import metrics
from torchtpu.device import constants
from torchtpu.eager.modes import EagerMode, set_eager_mode
from torchtpu.lowering.registry import TABLE

aten = torch.ops.aten
MODES = [EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
         EagerMode.DEFER_AND_FUSE]


def _programs() -> int:
    snap = metrics.snapshot()
    return sum(snap.get(n, 0) for n in ("executable_compiles", "persistent_cache_hits",
                                        "programs_loaded_by_key"))


def _programs_of(fn):
    """(fn's result on the host, the programs compiled while it ran)."""
    torch.tpu.synchronize()
    before = _programs()
    out = fn().cpu()
    return out, _programs() - before


def test_the_records_declare_their_constants():
    for op, args, value in [(aten.zero.default, (None,), 0),
                            (aten.fill.Scalar, (None, 2.5), 2.5),
                            (aten.zeros.default, ([2],), 0), (aten.ones.default, ([2],), 1),
                            (aten.full.default, ([2], 7), 7),
                            (aten.scalar_tensor.default, (3.5,), 3.5)]:
        assert TABLE[op].constant(*args) == value, op


FACTORIES = [  # (make on a device, programs it compiles in Strict at a new shape)
    (lambda d, n: torch.zeros(n, 3, device=d), 0),
    (lambda d, n: torch.ones(n, 4, device=d, dtype=torch.int8), 0),
    (lambda d, n: torch.full((n, 5), 2.5, device=d, dtype=torch.bfloat16), 0),
    (lambda d, n: torch.full((n, 6), -0.0, device=d), 0),
    (lambda d, n: torch.full((n, 7), float("-inf"), device=d, dtype=torch.float16), 0),
    (lambda d, n: torch.full((n, 8), True, device=d), 0),
    (lambda d, n: torch.full((n, 9), 1 + 2j, device=d), 0),
    (lambda d, n: torch.scalar_tensor(n, device=d, dtype=torch.int64), 0),
    # What the dtype does not hold exactly is the program's to round, as before.
    (lambda d, n: torch.full((n, 10), 1 / 3, device=d, dtype=torch.float16), 1),
    (lambda d, n: torch.full((n, 11), float("nan"), device=d), 1),
    (lambda d, n: torch.full((n, 12), 2**40 + 1, device=d, dtype=torch.float32), 1),
    # Past the size bound (1.4 MB): a program.
    (lambda d, n: torch.zeros(600 + n, 601, device=d), 1),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [m for m, _ in FACTORIES])
def test_factories_against_cpu(mode, make):
    with set_eager_mode(mode):
        got = make("tpu", 13).cpu()
    want = make("cpu", 13)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if want.dtype is torch.float32:  # -0.0 keeps its sign
        assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("make, programs", FACTORIES)
def test_factory_programs(make, programs):
    # Shapes of their own (17 x k): no other test compiles their programs first.
    got, compiled = _programs_of(lambda: make("tpu", 17))
    torch.testing.assert_close(got, make("cpu", 17), rtol=0, atol=0, equal_nan=True)
    assert compiled == programs


@pytest.mark.parametrize("mode", MODES)
def test_in_place_fills_against_cpu(mode):
    base = torch.randn(14, 6)
    cases = [lambda x: x.zero_(), lambda x: x[2:5].fill_(3.0), lambda x: x.t()[1].zero_(),
             lambda x: x.fill_(torch.tensor(1.5, device=x.device)),  # a tensor: read
             lambda x: x.to(torch.uint8).fill_(7), lambda x: torch.zeros_like(x.t())]
    with set_eager_mode(mode):
        for case in cases:
            got, want = case(base.to("tpu").clone()), case(base.clone())
            assert got.stride() == want.stride()
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_zeros_like_and_an_unwritten_read_compile_no_zeros():
    w = torch.randn(15, 19, device="tpu")
    _, compiled = _programs_of(lambda: torch.zeros_like(w))
    assert compiled == 0
    t = torch.empty(15, 20, device="tpu")
    sent = metrics.snapshot().get("host_to_device_bytes", 0)
    t[3].fill_(2.0)  # written through a view: the storage's zeros first, then the row
    assert metrics.snapshot().get("host_to_device_bytes", 0) - sent == (15 * 20 + 20) * 4
    want = torch.zeros(15, 20)
    want[3] = 2.0
    assert torch.equal(t.cpu(), want)


def test_a_transfer_guard_keeps_the_program():
    with jax.transfer_guard_host_to_device("disallow"):
        assert constants.host_constant((13, 13), torch.zeros(0).numpy().dtype, 0) is None
        got, compiled = _programs_of(lambda: torch.zeros(13, 14, device="tpu"))
    assert torch.equal(got, torch.zeros(13, 14)) and compiled == 1


def test_a_repeated_factory_stays_a_transfer():
    # The second call of a signature takes seen_calls' short path, which sends it too.
    torch.ones(13, 15, device="tpu")
    got, compiled = _programs_of(lambda: torch.ones(13, 15, device="tpu") * 1)
    assert torch.equal(got, torch.ones(13, 15))
    assert compiled == 1  # the multiply's
