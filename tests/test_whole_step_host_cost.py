"""The whole step's per-call short paths give way where what they skip changed: CPU step counts
kept in one buffer still say each parameter's own count (a count moved alone is refilled alone;
two signatures' steps hand the counts back and forth), a module tree changed under a cached walk
is walked again, and a batch passed as a tuple is still bound tensor by tensor."""

import collections
import copy

import torch
import torch.nn.functional as F

from torchtpu import metrics
from torchtpu.compile.module_trees import ModuleTrees


def _nets():
    torch.manual_seed(7)
    cpu = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.0), torch.nn.Tanh(),
                              torch.nn.Linear(8, 3))
    return cpu, copy.deepcopy(cpu).to("tpu")


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen))
            for _ in range(n)]


def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _captures() -> int:
    return metrics.snapshot().get("captures", 0)


def test_one_count_moved_alone_is_refilled_alone_and_counts_stay_the_optimizers_tensors():
    cpu, dev = _nets()
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.02)
    dev_opt = torch.optim.AdamW(dev.parameters(), lr=0.02)  # CPU step counts
    compiled = torch.compile(step, backend="tpu")
    counts = None
    for i, (x, y) in enumerate(_batches(6)):
        if i == 3:  # one parameter's count only (a partial load), on both sides
            for opt in (cpu_opt, dev_opt):
                opt.state[next(iter(opt.param_groups[0]["params"]))]["step"] += 100
        if i == 2:
            counts = [dev_opt.state[p]["step"] for p in dev.parameters()]
        loss = compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
        torch.testing.assert_close(loss.cpu(), step(cpu, cpu_opt, x, y).detach(),
                                   atol=2e-6, rtol=2e-6)
    for p, q, c in zip(dev.parameters(), cpu.parameters(), counts, strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5)
        assert dev_opt.state[p]["step"] is c  # the same tensor object, its own value
        assert c.is_cpu and c.shape == () and c.item() == cpu_opt.state[q]["step"].item()
    assert [c.item() for c in counts] == [106.0, 6.0, 6.0, 6.0]


def test_module_trees_walk_again_when_a_tree_changes():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2),
                                torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    trees = ModuleTrees()

    def same() -> bool:
        return trees.modules(model) == list(model.modules()) == trees.modules(model)

    assert same()
    model[1][0] = torch.nn.GELU()                 # replaced deep in the tree
    assert same()
    model[1].add_module("extra", torch.nn.Dropout())  # added
    assert same()
    del model[1][1]                               # removed
    assert same()
    model[0]._modules = {"a": torch.nn.Tanh()}    # a dict replaced whole
    assert same()


def test_a_submodule_swapped_for_one_in_eval_mode_is_a_new_signature():
    cpu, dev = _nets()
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.05)
    compiled = torch.compile(step, backend="tpu")
    batches = _batches(3)
    for x, y in batches:
        compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
    before = _captures()
    compiled(dev, dev_opt, *(t.to("tpu") for t in batches[0]))
    assert _captures() == before  # the cached walk serves an unchanged tree
    dev[1] = torch.nn.Dropout(0.0).eval()  # the same parameters; one module's mode differs
    compiled(dev, dev_opt, *(t.to("tpu") for t in batches[0]))
    assert _captures() == before + 1


Batch = collections.namedtuple("Batch", "x y")


def test_a_batch_in_a_tuple_or_namedtuple_is_bound_tensor_by_tensor():
    cpu, dev = _nets()
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)

    def train(model, opt, batch):
        return step(model, opt, batch[0], batch[1])

    compiled = torch.compile(train, backend="tpu")
    captures = []
    for i, (x, y) in enumerate(_batches(6)):
        batch = (x.to("tpu"), y.to("tpu"))
        loss = compiled(dev, dev_opt, Batch(*batch) if i % 2 else batch)
        torch.testing.assert_close(loss.cpu(), step(cpu, cpu_opt, x, y).detach(),
                                   atol=2e-6, rtol=2e-6)
        captures.append(_captures())
    # The first step and the steady state are captured; each later batch, in either container,
    # is bound into the steady state's program (its signature is the tensors' shapes).
    assert [c - captures[0] for c in captures] == [0, 1, 1, 1, 1, 1]


def test_counts_stay_right_when_two_signatures_alternate():
    """Two captured steps (two batch sizes) share one optimizer's CPU counts: each step finds
    the counts the other advanced (its device twins refilled) and advances them itself."""
    cpu, dev = _nets()
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.02)
    dev_opt = torch.optim.AdamW(dev.parameters(), lr=0.02)
    compiled = torch.compile(step, backend="tpu")
    gen = torch.Generator().manual_seed(9)
    for i in range(8):
        rows = 5 if i % 2 else 7
        x, y = torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)
        loss = compiled(dev, dev_opt, x.to("tpu"), y.to("tpu"))
        torch.testing.assert_close(loss.cpu(), step(cpu, cpu_opt, x, y).detach(),
                                   atol=2e-6, rtol=2e-6)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5)
        assert dev_opt.state[p]["step"].item() == 8
