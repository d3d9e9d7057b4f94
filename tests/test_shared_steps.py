"""A captured step of a capturable optimizer reads and writes its step counts as one array
(``eager/shared_steps.py``): the program's inputs grow by three arrays a parameter (weight and
two moments), not four; the counts keep their own values (one written alone between replays is
used by the next replay), and losses and parameters equal CPU's."""

import torch

N_SMALL, N_LARGE = 4, 8


def _params(n: int, device: str) -> list:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(3, 3, generator=gen).to(device).requires_grad_() for _ in range(n)]


def _step(ws, opt, x):
    loss = sum(((x @ w).tanh() ** 2).sum() for w in ws)
    loss.backward()
    opt.step()
    return loss


def _captured(n: int):
    """(CPU params and AdamW, tpu params and capturable AdamW, static input, graph, its loss),
    both after two warm-up steps."""
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(4))
    cpu = _params(n, "cpu")
    tpu = _params(n, "tpu")
    cpu_opt = torch.optim.AdamW(cpu, lr=0.05, weight_decay=0.1)
    tpu_opt = torch.optim.AdamW(tpu, lr=0.05, weight_decay=0.1, capturable=True)
    static_x = x.to("tpu")
    for _ in range(2):
        for ws, opt, inp in ((cpu, cpu_opt, x), (tpu, tpu_opt, static_x)):
            opt.zero_grad(set_to_none=True)
            _step(ws, opt, inp)
    tpu_opt.zero_grad(set_to_none=True)
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = _step(tpu, tpu_opt, static_x)
    return cpu, cpu_opt, x, tpu, tpu_opt, g, loss


def _program_inputs(n: int) -> int:
    *_, g, _ = _captured(n)
    return len(g._captured._io.sources)



def _replay_equals_cpu(g, loss, tpu, cpu, cpu_opt, x) -> None:
    """One replay of g beside the same step on CPU: the loss and every parameter equal."""
    cpu_opt.zero_grad(set_to_none=True)
    expected = _step(cpu, cpu_opt, x)
    g.replay()
    torch.testing.assert_close(loss.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for p, q in zip(tpu, cpu, strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5)

def test_the_counts_are_one_input_of_the_program():
    per_parameter = (_program_inputs(N_LARGE) - _program_inputs(N_SMALL)) / (N_LARGE - N_SMALL)
    assert per_parameter == 3  # the weight and two moments; 4 with a count each


def test_replays_equal_cpu_and_each_count_keeps_its_own_value():
    cpu, cpu_opt, x, tpu, tpu_opt, g, loss = _captured(N_SMALL)
    counts = [tpu_opt.state[w]["step"] for w in tpu]
    assert len({c.untyped_storage().data_ptr() for c in counts}) == 1
    for i in range(4):
        if i == 2:  # one count moved alone (a parameter's state loaded, say)
            with torch.no_grad():
                cpu_opt.state[cpu[1]]["step"] += 5
                tpu_opt.state[tpu[1]]["step"] += 5
        _replay_equals_cpu(g, loss, tpu, cpu, cpu_opt, x)
    assert [c.item() for c in counts] == [cpu_opt.state[w]["step"].item() for w in cpu]
    assert [c.item() for c in counts] == [6.0, 11.0, 6.0, 6.0]


def test_a_second_capture_leaves_the_counts_in_their_buffer():
    """A second capture of the same optimizer (another batch shape) finds the counts in the
    first one's buffer and leaves them there (a program captured earlier reads that buffer);
    its replays equal CPU."""
    cpu, cpu_opt, x, tpu, tpu_opt, g, loss = _captured(N_SMALL)
    counts = [tpu_opt.state[w]["step"] for w in tpu]
    buffer = counts[0].untyped_storage().data_ptr()
    g.replay()
    cpu_opt.zero_grad(set_to_none=True)
    _step(cpu, cpu_opt, x)
    x2 = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
    static_x2 = x2.to("tpu")
    tpu_opt.zero_grad(set_to_none=True)
    g2 = torch.tpu.TPUGraph()
    with torch.tpu.graph(g2):
        loss2 = _step(tpu, tpu_opt, static_x2)
    assert {c.untyped_storage().data_ptr() for c in counts} == {buffer}
    for _ in range(3):
        _replay_equals_cpu(g2, loss2, tpu, cpu, cpu_opt, x2)
    assert [c.item() for c in counts] == [cpu_opt.state[w]["step"].item() for w in cpu]
