"""Eager modes and threads (eager/modes.py, eager/defer.py): the mode is the process's.

Issue 37: threads entering different modes with ``set_eager_mode`` ran one another's pending
values through the wrong executor (``ValueError: Triggering __jax_array__() during
abstractification`` from inside JAX), and 4 threads sharing DeferAndFuse's one recording
recompiled at every flush. Now a thread that would change the mode while another thread is
inside a ``set_eager_mode`` block gets a ``torchtpu.unsupported`` error at once, threads may
share a mode (it reverts when the last leaves), and a second thread recording into
DeferAndFuse's recording is warned about. Each thread's training step is checked against CPU.
"""

import threading
import warnings

import pytest
import torch

from torchtpu.eager import modes

EagerMode = torch.tpu.EagerMode
_THREADS = 4


def _step(seed: int, device: str) -> list[torch.Tensor]:
    """One thread's work: an MLP's loss and gradients from seed's weights and batch."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(32, 4, generator=g)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    w1, w2 = (w.to(device).requires_grad_() for w in (w1, w2))
    loss = torch.nn.functional.mse_loss(torch.tanh(x.to(device) @ w1) @ w2, y.to(device))
    loss.backward()
    return [t.detach().cpu() for t in (loss, w1.grad, w2.grad)]


def _threads(work) -> list:
    outcomes: list = [None] * _THREADS
    barrier = threading.Barrier(_THREADS)

    def main(i: int) -> None:
        try:
            outcomes[i] = (True, work(i, barrier))
        except BaseException as e:  # noqa: BLE001 (reported below)
            outcomes[i] = (False, e)
            barrier.abort()

    threads = [threading.Thread(target=main, args=(i,), name=f"worker {i}")
               for i in range(_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return outcomes


def test_threads_entering_different_modes_are_refused_and_compute_as_cpu():
    wanted = [EagerMode.DEFER_AND_FUSE, EagerMode.DEFER_NEVER] * 2
    entered = threading.Event()
    leave = threading.Event()

    def work(i, barrier):
        if i > 0:
            entered.wait(60)  # thread 0 enters first: which modes are refused is known
        try:
            with torch.tpu.set_eager_mode(wanted[i]):
                if i == 0:
                    entered.set()
                barrier.wait(60)  # every thread has entered or been refused
                result = _step(i, "tpu")
                barrier.wait(60)
                if i == 0:
                    leave.wait(60)  # the others leave first: the mode stays until the last
                return "entered", result, modes.get_eager_mode()
        except RuntimeError as e:
            if "torchtpu.unsupported" not in str(e):
                raise
            barrier.wait(60)
            result = _step(i, "tpu")  # in the mode the process is in
            barrier.wait(60)
            leave.set()
            return str(e), result, modes.get_eager_mode()

    before = modes.get_eager_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refused threads record into thread 0's recording
        outcomes = _threads(work)
    assert modes.get_eager_mode() is before
    for i, (ok, value) in enumerate(outcomes):
        assert ok, value
        how, result, mode = value
        if wanted[i] is EagerMode.DEFER_AND_FUSE:
            assert how == "entered" and mode is EagerMode.DEFER_AND_FUSE
        else:
            assert "set_eager_mode EagerMode.DEFER_NEVER" in how, how
            assert "runs in EagerMode.DEFER_AND_FUSE" in how and "per process" in how, how
        for got, want in zip(result, _step(i, "cpu")):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_threads_share_defer_and_fuse_with_a_warning(monkeypatch):
    from torchtpu.eager import defer

    monkeypatch.setattr(defer.RECORDER, "_warned_threads", False)  # once per process

    def work(i, barrier):
        with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
            barrier.wait(60)
            result = _step(i, "tpu")
            barrier.wait(60)
            return result

    before = modes.get_eager_mode()
    with warnings.catch_warnings(record=True) as caught:  # process-wide: every thread's
        warnings.simplefilter("always")
        outcomes = _threads(work)
    assert modes.get_eager_mode() is before
    for i, (ok, value) in enumerate(outcomes):
        assert ok, value
        for got, want in zip(value, _step(i, "cpu")):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    texts = [str(w.message) for w in caught if "one recording of the process" in str(w.message)]
    assert len(texts) == 1, texts  # once per process


def test_one_thread_still_nests_modes():
    before = modes.get_eager_mode()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
            assert modes.get_eager_mode() is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
            for got, want in zip(_step(0, "tpu"), _step(0, "cpu")):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert modes.get_eager_mode() is EagerMode.DEFER_AND_FUSE
    assert modes.get_eager_mode() is before


def test_assigning_the_mode_while_another_thread_holds_one_is_refused():
    inside, done = threading.Event(), threading.Event()

    def hold():
        with torch.tpu.set_eager_mode(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
            inside.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        inside.wait(60)
        with pytest.raises(RuntimeError, match="torchtpu.unsupported: eager_mode = .*per process"):
            torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    finally:
        done.set()
        holder.join(60)


def test_a_captured_step_on_one_thread_is_not_warned_about():
    """A capture records into a recording of its own, which no thread entered as DeferAndFuse:
    the other-thread warning is not for it (it fired for every whole step, issue 35's model)."""
    lin = torch.nn.Linear(4, 4).to("tpu")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x):
        loss = lin(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = torch.compile(step, backend="tpu")
    x = torch.randn(2, 4, device="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            step(x).item()
