"""What a whole step's program bakes in, changed between calls with nothing else changed: each
step's loss and parameters against CPU eager running the same changes (``compile/whole_step.py``).

A replay reads the storages its capture found and the constants it traced: a module's parameter
or buffer replaced (an attribute assigned, ``.data`` set), a ``requires_grad`` toggled, a tensor
learning rate written in place, or the default dtype changed must each capture again, and an
optimizer's CPU step counts advance only for the parameters the program steps.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from torchtpu import metrics


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(6, 8)
        self.l2 = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x))) * self.scale


def step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def _captures() -> int:
    return metrics.snapshot().get("captures", 0)


def _train(change, make_opt, steps: int = 6, fn=step) -> int:
    """Run fn eagerly on CPU and compiled on tpu, ``change(i, model, opt)`` before each step on
    both; every loss and parameter must agree. Returns the captures made."""
    torch.manual_seed(0)
    cpu = _Net()
    dev = copy.deepcopy(cpu).to("tpu")
    cpu_opt, dev_opt = make_opt(cpu), make_opt(dev)
    compiled = torch.compile(fn, backend="tpu")
    gen = torch.Generator().manual_seed(1)
    before = _captures()
    for i in range(steps):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float32)
        y = torch.randn(5, 3, generator=gen, dtype=torch.float32)
        for model, opt in ((cpu, cpu_opt), (dev, dev_opt)):
            change(i, model, opt)
        want = fn(cpu, cpu_opt, x, y)
        got = compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
        assert got.dtype == want.dtype, i
        torch.testing.assert_close(got.cpu(), want.detach(), atol=2e-5, rtol=2e-5,
                                   msg=lambda m, i=i: f"step {i}'s loss: {m}")
        for (name, p), q in zip(dev.named_parameters(), cpu.parameters(), strict=True):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=2e-5, rtol=2e-5,
                                       msg=lambda m, i=i, name=name: f"step {i}, {name}: {m}")
    return _captures() - before


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _replace_buffer(i, model, opt):
    if i >= 3:  # a new tensor each step, as a user's code would assign it
        model.scale = torch.full((3,), 2.0 + i, device=model.scale.device)


def _set_buffer_data(i, model, opt):
    if i == 3:
        model.scale.data = torch.full((3,), 3.0, device=model.scale.device)


def _replace_parameter(i, model, opt):
    if i == 3:  # the optimizer keeps the old one, which gets no .grad from now on
        with torch.no_grad():
            model.l2.weight = torch.nn.Parameter(model.l2.weight * 0.5)


@pytest.mark.parametrize("change", [_replace_buffer, _set_buffer_data, _replace_parameter])
def test_a_replaced_parameter_or_buffer_is_read_as_eager_reads_it(change):
    # Before: the replay read the capture's buffer (step 3's loss 1.107 where CPU's is 3.554),
    # and after a replaced parameter it read an array the program had donated (an error).
    _train(change, _adamw)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_requires_grad_toggled_off_and_on_steps_as_eager(optimizer):
    def toggle(i, model, opt):
        if i in (3, 5):
            model.l1.weight.requires_grad_(i == 5)

    def make(model):
        if optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return _adamw(model)

    # Before: the frozen weight kept moving (step 3: 0.018 off CPU's), and AdamW's step count
    # of the skipped weight advanced at each replay of the frozen step's program, so the weight
    # came back with a wrong bias correction (step 5: 0.0018 off).
    _train(toggle, make, steps=7)


def test_a_tensor_learning_rate_written_in_place_is_the_one_used():
    def schedule(i, model, opt):
        if i == 0:
            opt.param_groups[0]["lr"] = torch.tensor(0.05)
        elif i in (3, 5):  # after a replay that found it unchanged (the guards' snapshot)
            opt.param_groups[0]["lr"].fill_(0.05 / i)

    # Before: the replay kept the captured lr's value (step 3's l1.weight 0.029 off).
    _train(schedule, lambda model: torch.optim.Adam(model.parameters(), lr=0.05))


def test_the_default_dtype_is_part_of_the_steps_signature():
    def with_a_made_constant(model, opt, x, y):
        # arange(3) * 0.1 takes the default dtype, and so does the loss it is added to.
        loss = F.mse_loss(model(x), y) + (torch.arange(3, device=x.device) * 0.1).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def default_dtype(i, model, opt):
        torch.set_default_dtype(torch.float64 if i >= 3 else torch.float32)

    try:
        # Before: the loss stayed float32 after the change (CPU's: float64).
        _train(default_dtype, _adamw, fn=with_a_made_constant)
    finally:
        torch.set_default_dtype(torch.float32)


def test_nothing_changed_replays_without_capturing_again():
    # The guards above cost nothing when nothing changes: the first step and the steady one.
    assert _train(lambda i, model, opt: None, _adamw) == 2


def test_values_computed_from_a_parameter_before_a_step_read_after_it():
    # Strict keeps a product or a narrowing cast of a parameter uncomputed, its source array
    # lent; a replay donated that array (the parameter's update reuses its buffer), and the
    # value read afterwards raised "Array has been deleted".
    kept = []

    def keep(i, model, opt):
        if i == 3:
            with torch.no_grad():
                kept.append((model.l1.weight * 0.5, model.l1.weight.to(torch.bfloat16)))

    _train(keep, _adamw, steps=5)
    for want, got in zip(*kept, strict=True):
        torch.testing.assert_close(got.cpu(), want)


def _l1_only(model):
    return torch.optim.AdamW(model.l1.parameters(), lr=0.02, weight_decay=0.1)


def _clear_state(i, model, opt):
    if i == 3:
        opt.state.clear()


def _add_group(i, model, opt):
    if i == 3:
        opt.add_param_group({"params": list(model.l2.parameters()), "lr": 0.05})


@pytest.mark.parametrize("change", [(_clear_state, _adamw), (_add_group, _l1_only)],
                         ids=["state_cleared", "param_group_added"])
def test_optimizer_state_made_again_mid_run_is_made_as_eager_makes_it(change):
    # A known optimizer's state made again (cleared, a group added) inside a steady capture
    # aborts it, and the first-step capture that follows must make it outside the recording as
    # for a new optimizer: the aborted capture's state (device counts of a default optimizer)
    # stayed, and the whole step raised "a host read ... inside a graph capture" at opt.step().
    assert _train(*change) == 4  # first, steady, the first step again, steady
