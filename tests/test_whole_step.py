"""``torch.compile(step, backend="tpu")`` of a whole training step: one program per call, the
losses of eager training (default and capturable AdamW), a scheduled lr without a recapture,
guards that recapture, and a step that cannot be one program warned about and run correctly."""

import copy

import pytest
import torch
import torch.nn.functional as F

from torchtpu import metrics

N, D_IN, H, D_OUT = 16, 12, 20, 6


def _nets():
    torch.manual_seed(3)
    cpu = torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.GELU(), torch.nn.Linear(H, D_OUT))
    return cpu, copy.deepcopy(cpu).to("tpu")


def _batches(n: int, rows: int = N) -> list:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(rows, D_IN, generator=gen), torch.randn(rows, D_OUT, generator=gen))
            for _ in range(n)]


def step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return loss


def _counts(*more: str) -> dict:
    m = metrics.snapshot()
    return {k: m.get(k, 0) for k in ("executions", "captures", "compiled_graphs", *more)}


def _delta(before: dict) -> dict:
    after = _counts(*before)
    return {k: after[k] - v for k, v in before.items()}


# capturable=True is the captured steps' own path (test_graphs.py); here in the full suite.
@pytest.mark.parametrize("capturable", [False, pytest.param(True, marks=pytest.mark.full)])
def test_whole_step_is_one_program_per_call_with_eager_losses_and_a_scheduled_lr(capturable):
    cpu, dev = _nets()
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.02, weight_decay=0.1)
    dev_opt = torch.optim.AdamW(dev.parameters(), lr=0.02, weight_decay=0.1,
                                capturable=capturable)
    compiled = torch.compile(step, backend="tpu")
    for i, (x, y) in enumerate(_batches(6)):
        if i == 3:  # step counts moved outside the compiled step (a checkpoint loaded)
            for opt in (cpu_opt, dev_opt):
                for state in opt.state.values():
                    state["step"] += 10
        if i == 4:  # a scheduler's change: an input of the program, not a recapture
            for opt in (cpu_opt, dev_opt):
                opt.param_groups[0]["lr"] = 0.005
        before = _counts("executable_compiles", "persistent_cache_hits")
        loss = compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
        delta = _delta(before)
        expected = step(cpu, cpu_opt, x, y)
        torch.testing.assert_close(loss.cpu(), expected.detach(), atol=2e-6, rtol=2e-6)
        # Every call is one program; the first step and the steady state are captured once each.
        # The first call makes AdamW's state eagerly, outside its program, which is then the
        # steady one: the second capture compiles nothing. That state (exp_avg, exp_avg_sq and
        # a device step count a parameter) runs no program, nor does refilling the counts' device
        # twins at step 3: small constants are sent from the host.
        assert delta["executions"] == 1 and delta["compiled_graphs"] == 0, \
            (i, delta)
        assert delta["captures"] == (1 if i < 2 else 0), (i, delta)
        if i == 1:
            assert delta["executable_compiles"] == delta["persistent_cache_hits"] == 0, delta
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5)
        step_count = dev_opt.state[p]["step"]
        assert step_count.is_cpu != capturable and step_count.item() == 16
    # Each call's loss is its own tensor (a later replay does not overwrite it).
    assert loss is not compiled(dev, dev_opt, *(t.to("tpu") for t in _batches(1)[0]))


def test_whole_step_guards_recapture_for_new_shapes_modes_and_hyperparameters():
    cpu, dev = _nets()
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)

    def train(x, y):  # the model and optimizer come from the closure, not the arguments
        dev_opt.zero_grad()
        loss = F.mse_loss(dev(x), y)
        loss.backward()
        dev_opt.step()
        return loss

    def expected(x, y):
        cpu_opt.zero_grad()
        loss = F.mse_loss(cpu(x), y)
        loss.backward()
        cpu_opt.step()
        return loss.detach()

    compiled = torch.compile(train, backend="tpu")
    batches = _batches(3) + _batches(2, rows=5)
    captures = []
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for opt in (cpu_opt, dev_opt):  # SGD's lr is a constant of the program
                opt.param_groups[0]["lr"] = 0.02
        loss = compiled(x.to("tpu"), y.to("tpu"))
        torch.testing.assert_close(loss.cpu(), expected(x, y), atol=2e-6, rtol=2e-6)
        captures.append(metrics.snapshot().get("captures", 0))
    # Captured: the first step, the steady state, again for the new lr, again for 5 rows.
    assert [c - captures[0] for c in captures] == [0, 1, 2, 3, 3]
    dev.eval()
    cpu.eval()
    before = _counts()
    for x, y in batches[:2]:
        view = torch.stack([x, x], 1).to("tpu")[:, 0]  # an argument that is a strided view
        loss = compiled(view, y.to("tpu"))
        torch.testing.assert_close(loss.cpu(), expected(x, y), atol=2e-6, rtol=2e-6)
    assert _delta(before)["captures"] == 1  # eval mode is another signature


def test_a_step_without_an_optimizer_replays_one_program():
    """A hand-written update under no_grad (no torch.optim): captured once warm, then replayed."""
    cpu, dev = _nets()

    def sgd(model, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        params = list(model.parameters())
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)
        model.zero_grad(set_to_none=True)
        return loss

    compiled = torch.compile(sgd, backend="tpu")
    for i, (x, y) in enumerate(_batches(5)):
        before = _counts()
        loss = compiled(dev, x.to("tpu"), y.to("tpu"))
        delta = _delta(before)
        torch.testing.assert_close(loss.cpu(), sgd(cpu, x, y).detach(), atol=2e-6, rtol=2e-6)
        assert delta == {"executions": 1, "captures": 1 if i < 2 else 0,
                         "compiled_graphs": 0}, (i, delta)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-6, rtol=1e-6)
        assert p.grad is None


def test_outputs_sharing_a_storage_each_come_back_with_their_values():
    """A step returning its loss, its ``detach()`` and a view of it (aot's train step returns
    ``(out, loss.detach())``, the same storage when the output is the loss): every replay's
    outputs equal eager CPU's. Moving the first out used to empty the storage the others read:
    they came back 0.0."""
    cpu, dev = _nets()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu, dev)]

    def aliased(model, opt, x, y):
        loss = step(model, opt, x, y)
        return loss, loss.detach(), loss.view(1), (loss * 2).detach()

    compiled = torch.compile(aliased, backend="tpu")
    for i, (x, y) in enumerate(_batches(4)):
        before = _counts()
        got = compiled(dev, opts[1], x.to("tpu"), y.to("tpu"))
        assert _delta(before)["executions"] == 1  # (AdamW's state: sent from the host)
        want = aliased(cpu, opts[0], x, y)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.detach().cpu(), w.detach(), atol=2e-6, rtol=2e-6,
                                       msg=lambda m, i=i: f"step {i}: {m}")


def test_a_step_that_calls_backward_through_a_closures_function_is_a_whole_step():
    """zero_grad, then a ``train`` defined elsewhere (bench/registry.py's shape): one program."""
    cpu, dev = _nets()
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.05)

    def make(model, opt):
        def train(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        def wrapper(x, y):
            opt.zero_grad(set_to_none=True)
            return train(x, y)
        return wrapper

    compiled = torch.compile(make(dev, dev_opt), backend="tpu")
    expected = make(cpu, cpu_opt)
    for i, (x, y) in enumerate(_batches(4)):
        before = _counts()
        loss = compiled(x.to("tpu"), y.to("tpu"))
        delta = _delta(before)
        torch.testing.assert_close(loss.cpu(), expected(x, y).detach(), atol=2e-6, rtol=2e-6)
        assert delta["executions"] == 1 and delta["compiled_graphs"] == 0, (i, delta)


def test_a_step_that_cannot_be_one_program_says_why_and_runs_through_dynamo(fresh_dynamo):
    cpu, dev = _nets()
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.05)
    seen = []

    def logging_step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        seen.append(loss.item())  # a host read: no value exists while capturing
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(logging_step, backend="tpu")
    x, y = _batches(1)[0]
    with pytest.warns(UserWarning, match=r"cannot run as one captured program: "
                      r"torchtpu.capture: a host read .*test_whole_step.py:\d+"):
        loss = compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
    torch.testing.assert_close(loss.cpu(), logging_step(cpu, cpu_opt, x, y).detach(),
                               atol=2e-6, rtol=2e-6)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-6, rtol=1e-6)
    assert len(seen) == 2  # once on tpu (Dynamo's graphs), once on CPU: the capture read none


def test_whole_step_option_is_checked():
    with pytest.raises(ValueError, match="torchtpu.compile: whole_step must be True or False"):
        torch.compile(step, backend="tpu", options={"whole_step": "yes"})


def test_the_llama_steps_first_program_is_its_steady_one():
    """The chip row's model (rotary ``neg``, RMSNorm, SDPA, cross-entropy; AdamW under autocast):
    the first call compiles the program every later call runs, so the second compiles nothing
    and loads nothing (no persistent-cache or warm-start load). Its recording must have a
    stable key for that: aten.neg lowers to ``jnp.negative``, a ``jnp.ufunc``, which once had
    none."""
    from torchtpu.testing.llama import Llama, LlamaConfig, train_step

    c = LlamaConfig(vocab=64, dim=32, layers=1, heads=2, hidden=48, seq=8)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(c)
    compiled = torch.compile(train_step(model)[0], backend="tpu")
    ids = torch.randint(c.vocab, (2, c.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    loads = ("executable_compiles", "persistent_cache_hits", "programs_loaded_by_key")
    for i in range(3):
        before = _counts(*loads)
        compiled(x, y)
        delta = _delta(before)
        if i > 0:  # the program in memory (the capture's program cache), nothing loaded
            assert [delta[k] for k in loads] == [0, 0, 0], (i, delta)


def test_the_first_calls_optimizer_state_past_the_hosts_constants_is_one_program():
    """AdamW's state of weights past ``HOST_CONSTANT_BYTES`` (two shapes, exp_avg and exp_avg_sq
    of each) is made by one program, not a ``zero`` program a shape run twice; the losses and
    weights are CPU's."""
    torch.manual_seed(5)
    cpu = torch.nn.Sequential(torch.nn.Linear(600, 512), torch.nn.Tanh(),
                              torch.nn.Linear(512, 600))
    dev = copy.deepcopy(cpu).to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (cpu, dev)]
    compiled = torch.compile(step, backend="tpu")
    gen = torch.Generator().manual_seed(6)
    for i in range(2):
        x, y = torch.randn(8, 600, generator=gen), torch.randn(8, 600, generator=gen)
        before = _counts()
        loss = compiled(dev, opts[1], x.to("tpu"), y.to("tpu"))
        delta = _delta(before)
        # The first call: its state's one program, then the step's.
        assert delta["executions"] == (2 if i == 0 else 1), (i, delta)
        torch.testing.assert_close(loss.cpu(), step(cpu, opts[0], x, y).detach(),
                                   atol=2e-6, rtol=2e-6)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        # (an element whose gradient is tiny moves by m / sqrt(v), sensitive to rounding)
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=5e-5, rtol=1e-5)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opts[1].state[p][k].cpu(), opts[0].state[q][k],
                                       atol=1e-6, rtol=1e-5)
