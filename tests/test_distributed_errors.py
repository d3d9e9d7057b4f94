"""tpu_dist in real processes when ranks disagree or fail: ranks running different eager code
between collectives, mismatched collectives and a hang raise on every rank in words naming both
sides; a rank that dies makes every other rank raise (``test_faults_distributed.py``: the same
on the XLA transport, and resuming after a restart)."""

import os

import torch
import torch.distributed as dist

from torchtpu.distributed.spawn import run
from torchtpu.testing.distributed import outwait_timeout


def _cpu(t):
    return t.detach().cpu()


def _mpmd(rank, world):
    """Ranks run different eager code (DeferAndFuse holding different pending work) between
    collectives, then call mismatched ones, then one rank hangs past the timeout."""
    from torchtpu.distributed import CollectiveMismatchError

    out = {}
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        x = torch.arange(4.0, device="tpu")
        y = (x * 2 + 1) if rank == 0 else x.sin().cos()  # pending, different per rank
        z = y.exp() if rank == 0 else None
        dist.all_reduce(y)
        out["defer"] = (_cpu(y), _cpu(z) if z is not None else None)

    @torch.compile(backend="tpu")
    def compiled(x):  # a different graph on each rank around the same collective
        y = x * 2 if rank == 0 else x.sin()
        dist.all_reduce(y)
        return y + 1

    out["compiled"] = _cpu(compiled(torch.arange(4.0, device="tpu")))
    errors = []
    for case in ("op", "shape", "dtype", "bulk shape"):
        try:
            if case == "op":
                if rank == 0:
                    dist.all_reduce(torch.ones(4, device="tpu"))
                else:
                    dist.broadcast(torch.ones(4, device="tpu"), 0)
            elif case == "shape":
                dist.all_reduce(torch.ones(4 + rank, device="tpu"))
            elif case == "dtype":
                dist.all_reduce(torch.ones(4, device="tpu",
                                           dtype=torch.int32 if rank == 0 else torch.float32))
            else:
                dist.all_gather_into_tensor(torch.empty(world * (5000 + rank), device="tpu"),
                                            torch.ones(5000 + rank, device="tpu"))
            errors.append(None)
        except CollectiveMismatchError as e:
            errors.append(str(e))
    out["errors"] = errors
    for shape in ((5,), (2, 2)):  # send/recv: another size, then the same bytes as another shape
        try:
            if rank == 0:
                dist.send(torch.ones(4, device="tpu"), dst=1)
            else:
                dist.recv(torch.ones(shape, device="tpu"), src=0)
        except CollectiveMismatchError as e:
            out.setdefault("p2p", []).append(str(e))
    x = torch.ones(3, device="tpu")
    dist.all_reduce(x)
    out["after"] = _cpu(x)
    try:
        dist.all_reduce(torch.ones(4, device="tpu"), op=dist.ReduceOp.BAND)
    except TypeError as e:
        out["bad op"] = str(e)
    try:
        dist.all_reduce(torch.ones(4))
    except ValueError as e:
        out["cpu tensor"] = str(e)
    # Past the 3 s timeout: rank 0 must raise, not hang.
    out["hang"] = outwait_timeout(rank, 8, lambda: dist.all_reduce(torch.ones(4, device="tpu")))
    return out


def test_mpmd_mismatch_and_hang_raise():
    results = run(_mpmd, 2, pg_timeout=3, init=True)
    x = torch.arange(4.0)
    torch.testing.assert_close(results[0]["defer"][0], (x * 2 + 1) + x.sin().cos())
    torch.testing.assert_close(results[1]["defer"][0], (x * 2 + 1) + x.sin().cos())
    torch.testing.assert_close(results[0]["defer"][1], (x * 2 + 1).exp())
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["compiled"], x * 2 + x.sin() + 1)
        other = 1 - rank
        for case, text in zip(("op", "shape", "dtype", "bulk shape"), out["errors"], strict=True):
            assert text is not None, (rank, case)
            assert f"this rank (rank {rank})" in text and f"rank {other} called" in text
        assert "all_reduce(SUM)" in out["errors"][0] and "broadcast(src/dst 0)" in out["errors"][0]
        assert "float32[4]" in out["errors"][1] and "float32[5]" in out["errors"][1]
        assert "int32[4]" in out["errors"][2] and "float32[4]" in out["errors"][2]
        assert "[5000]" in out["errors"][3] and "[5001]" in out["errors"][3]
        sent, want = ("sent", "which expected") if rank == 0 else ("but it sent", "expected")
        for text, shape in zip(out["p2p"], ("[5]", "[2, 2]"), strict=True):
            assert f"{sent} float32[4]" in text and f"{want} float32{shape}" in text, text
        torch.testing.assert_close(out["after"], torch.full((3,), 2.0))
        assert "BAND needs an integer" in out["bad op"]
        assert "serves tpu tensors only" in out["cpu tensor"]
    text, seconds = results[0]["hang"]
    assert "timeout (3 s)" in text and seconds < 10


def _dead_rank(rank, world):
    """Four processes started by mp.spawn-style init (no torchrun environment): the CUDA
    idioms still work after init_process_group; then the last rank dies mid-job."""
    assert torch.tpu.device_count() == world
    x = torch.ones(2, device=f"tpu:{rank}")
    try:
        torch.ones(2, device=f"tpu:{(rank + 1) % world or 1}")
        other = "no error"
    except RuntimeError as e:
        other = str(e)
    if rank == world - 1:
        os._exit(3)
    try:
        dist.all_reduce(x)
        return other, "no error"
    except dist.DistBackendError as e:
        return other, str(e)


def test_dead_rank_makes_every_other_rank_raise():
    outcomes = run(_dead_rank, 4, torchrun_env=False, backend=None, pg_timeout=5,
                   expect_failure=True)
    assert outcomes[3] is None  # it died
    for rank in range(3):
        ok, (other, error) = outcomes[rank]
        assert ok
        assert "belongs to another process" in other
        assert "tpu_dist: all_reduce" in error and "failed" in error
        assert "rank 3 (process" in error and "exited" in error, error
