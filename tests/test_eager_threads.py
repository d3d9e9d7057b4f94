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


def _train(model: torch.nn.Module, device: str, steps: int, opened=None) -> list:
    """SGD steps (momentum: state of its own) of model on seeded batches: the losses, then the
    parameters; opened() after the first forward, which a recording holds pending."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        loss = model(torch.randn(8, 16, generator=g).to(device)).pow(2).mean()
        if i == 0 and opened is not None:
            opened()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses + [p.detach().cpu() for p in model.parameters()]


def _mlp(seed: int) -> torch.nn.Module:
    # Made before any thread starts: the CPU generator is the process's (two threads each
    # seeding it and building a model build one from the other's stream: audit5's wrong rounds).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 1))


@pytest.mark.filterwarnings("ignore:torchtpu.unsupported. DeferAndFuse records thread")
def test_another_thread_records_while_the_owner_makes_its_optimizer_state():
    """The owner's first AdamW step makes its moments outside the recording (``adopt``): only
    the owner's calls run at once then. They all did once (a switch of the executor's, not of
    the thread), and a thread whose forward was pending ran its backward's calls on pending
    values through Strict's programs:
    ``ValueError: Triggering __jax_array__() during abstractification``."""
    from torchtpu.device import ownership

    worker_cpu, owner_cpu = _mlp(1), _mlp(0)
    worker_tpu, owner_tpu = _mlp(1).to("tpu"), _mlp(0).to("tpu")
    want = _train(worker_cpu, "cpu", 2)
    x = torch.randn(4, 16)
    opt = torch.optim.AdamW(owner_cpu.parameters(), lr=1e-2)
    owner_cpu(x).sum().backward()
    opt.step()

    pending, finished, outcome = threading.Event(), threading.Event(), []

    def worker():
        try:
            outcome.append(_train(worker_tpu, "tpu", 2, opened=lambda: (pending.set(),)))
        except BaseException as e:  # noqa: BLE001 (reported below)
            outcome.append(e)
        finally:
            pending.set()
            finished.set()

    made = []
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        opt = torch.optim.AdamW(owner_tpu.parameters(), lr=1e-2)
        make = opt._init_group

        def init_group(*args, **kwargs):  # the worker's whole training while it runs
            finished.wait(120)
            out = make(*args, **kwargs)
            made.extend(ownership.is_materialized(s["exp_avg"]) for s in opt.state.values())
            return out

        opt._init_group = init_group  # (``adopt`` wraps it)
        thread = threading.Thread(target=worker, name="worker")
        thread.start()
        try:
            assert pending.wait(120)
            owner_tpu(x.to("tpu")).sum().backward()
            opt.step()
            got = [p.detach().cpu() for p in owner_tpu.parameters()]
        finally:
            finished.wait(120)
            thread.join(120)
    assert not thread.is_alive()
    assert not isinstance(outcome[0], BaseException), outcome[0]
    for g, w in zip(outcome[0], want):
        torch.testing.assert_close(torch.as_tensor(g), torch.as_tensor(w), atol=1e-5, rtol=1e-5)
    assert made and all(made)  # the owner's state was made at once, outside the recording
    for g, w in zip(got, owner_cpu.parameters()):
        torch.testing.assert_close(g, w.detach(), atol=1e-5, rtol=1e-5)
