"""DeferAndFuse's replay of calls of several nodes or results (``defer_replay._tape_steps``):
SDPA's forward (the attention's node, its output laid out by a recorded transpose, sizes among
its results) and backward (dq, dk, dv each laid out) repeat as the op path made them; any
difference in their arguments takes the op path, and a call that drew a key (dropout) is never
kept. Every step's values and strides are compared with CPU's."""

import pytest
import torch
import torch.nn.functional as F

from torchtpu.eager import defer_replay

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_tape():
    defer_replay.REPLAY.tape.clear()


def _steps_replayed() -> int:
    """How many kept calls of several nodes or results the tape holds."""
    return sum(1 for kept in defer_replay.REPLAY.tape.values()
               if getattr(kept, "steps", None) is not None)


def _heads(x):  # (b, t, h, d) -> (b, h, t, d): a transposed view, as a Llama's q, k and v
    return x.transpose(1, 2)


def _attend(xs, grad, causal=True, same=False):
    views = [_heads(x) for x in xs]
    q, k, v = (views[0],) * 3 if same else views
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad)
    return out


# Step i's form: (causal, tokens, q, k and v one tensor): each differs from the step before
# in one thing, after two equal steps (the second replays the first).
FORMS = [(True, 8, False), (True, 8, False), (False, 8, False), (False, 8, False),
         (False, 6, False), (False, 8, True), (False, 8, False)]


def test_sdpa_forward_and_backward_replay_with_cpus_values_and_strides():
    torch.manual_seed(0)
    data = [[torch.randn(2, 8, 3, 16) for _ in range(3)] for _ in FORMS]
    grads = [torch.randn(2, 3, 8, 16) for _ in FORMS]
    replayed = []
    with torch.tpu.set_eager_mode(DEFER):
        for i, (causal, t, same) in enumerate(FORMS):
            xs = [x[:, :t].contiguous() for x in data[i]]
            g = grads[i][:, :, :t].contiguous()
            cpu = [x.clone().requires_grad_() for x in xs]
            dev = [x.to("tpu").requires_grad_() for x in xs]
            before = defer_replay.REPLAY.replayed
            out = _attend(cpu, g, causal, same)
            dout = _attend(dev, g.to("tpu"), causal, same)
            # A host read: the step's end (k and v take no gradient where q is all three).
            grads_dev = [None if d.grad is None else d.grad.cpu() for d in dev]
            replayed.append(defer_replay.REPLAY.replayed - before)
            torch.testing.assert_close(dout.cpu(), out, rtol=1e-4, atol=1e-4)
            assert dout.stride() == out.stride()
            for d, c in zip(grads_dev, cpu):
                assert (d is None) == (c.grad is None)
                if d is not None:
                    torch.testing.assert_close(d, c.grad, rtol=1e-4, atol=1e-4)
    # Both SDPA calls kept with their nodes; each step repeating the one before replays more
    # (its SDPA pair among them) than one that differs from it.
    assert _steps_replayed() >= 2
    for i in (1, 3):
        assert replayed[i] >= replayed[i - 1] + 2, replayed


def test_sdpa_results_are_fresh_tensors_with_the_op_paths_sizes():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    results = []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(3):
            dq, dk, dv = (x.to("tpu") for x in (q, k, v))
            r = aten._scaled_dot_product_fused_attention_overrideable(dq, dk, dv, None, 0.0, True)
            results.append(r)
            torch.testing.assert_close(r[0].cpu(), F.scaled_dot_product_attention(
                q, k, v, is_causal=True), rtol=1e-4, atol=1e-4)
    assert _steps_replayed() == 1
    first, again = results[1], results[2]
    assert [type(x) for x in first] == [type(x) for x in again]
    assert [x for x in again if type(x) is int] == [5, 5]  # the sizes the op path gave
    tensors = [x for x in again if isinstance(x, torch.Tensor)]
    storages = {x.untyped_storage().data_ptr() for x in tensors}
    assert len(storages) == len(tensors)  # one storage each, none an earlier result's
    assert not storages & {x.untyped_storage().data_ptr() for x in first
                           if isinstance(x, torch.Tensor)}


def test_a_call_that_drew_a_key_is_never_kept():
    torch.manual_seed(2)
    q = torch.randn(1, 2, 6, 8).to("tpu")
    outs = []
    with torch.tpu.set_eager_mode(DEFER):
        for p in (0.0, 0.0, 0.5, 0.5, 0.5):
            before = defer_replay.REPLAY.replayed
            outs.append(aten._scaled_dot_product_fused_attention_overrideable(
                q, q * 1.0, q * 2.0, None, p, False)[0].cpu())
            if p:
                # The mul's replay at most: the attention draws a key each call.
                assert defer_replay.REPLAY.replayed - before <= 2
    want = F.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu() * 2.0)
    torch.testing.assert_close(outs[1], want, rtol=1e-4, atol=1e-4)
    # Dropout's masks are drawn anew at every call: no two outputs alike, none without it.
    for i in (2, 3, 4):
        assert not torch.allclose(outs[i], want)
    assert not torch.equal(outs[2], outs[3]) and not torch.equal(outs[3], outs[4])
