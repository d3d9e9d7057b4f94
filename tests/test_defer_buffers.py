"""DeferAndFuse's buffer reuse: an in-place update is written into the buffer it replaces, a
loop's dead results lend their buffers to the next flush's outputs, and leaving the mode frees
what was kept; the numbers stay CPU's."""

import pytest
import torch

import torchtpu
from torchtpu import metrics
from torchtpu.device import tensors

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


def _pointer(t: torch.Tensor) -> int:
    return tensors.storage_array(t).unsafe_buffer_pointer()


def _update(p, m, v, g):
    # Three same-shape tensors updated in place, p first read and last written (AdamW's
    # order): each buffer takes its own tensor's new value only if the program pairs them so.
    p.mul_(0.999)
    m.mul_(0.9).add_(g, alpha=0.1)
    v.mul_(0.99).addcmul_(g, g, value=0.01)
    p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)


def test_in_place_updates_keep_their_buffers_and_match_cpu():
    cpu = [torch.randn(64, 32) for _ in range(4)]
    cpu[2] = cpu[2].abs()
    dev = [t.to("tpu") for t in cpu]
    with torch.tpu.set_eager_mode(DEFER):
        for step in range(3):
            before = [_pointer(t) for t in dev[:3]]
            _update(*dev)
            torch.tpu.synchronize()
            if step:  # the first inputs came from the host, whose buffers XLA may not own
                assert [_pointer(t) for t in dev[:3]] == before
            _update(*cpu)
    for d, c in zip(dev, cpu):
        torch.testing.assert_close(d.cpu(), c, rtol=1e-6, atol=1e-6)


def test_a_dead_result_lends_its_buffer_to_the_next_flush():
    x = torch.randn(256, 128)  # 128 KiB: results under defer.SPARE_MIN_BYTES are not kept
    xd = x.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        out = torch.tanh(xd) * 2
        torch.tpu.synchronize()
        first = _pointer(out)
        reused = torchtpu.metrics.snapshot().get("reused_buffers", 0)
        out = torch.tanh(xd) * 3  # the first result dies before this flush
        torch.tpu.synchronize()
        assert torchtpu.metrics.snapshot().get("reused_buffers", 0) == reused + 1
        assert _pointer(out) == first
        kept = torch.tanh(xd) + 1  # alive: its buffer is not lent
        torch.tpu.synchronize()
        assert _pointer(kept) != _pointer(out)
    torch.testing.assert_close(out.cpu(), torch.tanh(x) * 3)
    torch.testing.assert_close(kept.cpu(), torch.tanh(x) + 1)


def test_leaving_the_mode_frees_the_kept_results():
    xd = torch.randn(256, 256).to("tpu")
    base = torch.tpu.memory_allocated()
    with torch.tpu.set_eager_mode(DEFER):
        out = xd * 2
        torch.tpu.synchronize()
        del out
        kept = torch.tpu.memory_allocated()
    assert kept >= base + 256 * 256 * 4  # held for the next flush while in the mode
    assert torch.tpu.memory_allocated() <= base


@pytest.mark.parametrize("shape, lent", [((128, 128), True), ((128, 64), False)])
def test_only_results_of_spare_min_bytes_lend_their_buffers(shape, lent):
    # float32: 64 KiB (defer.SPARE_MIN_BYTES, counted in bytes, not elements), then 32 KiB.
    x = torch.randn(shape)
    xd = x.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        out = torch.tanh(xd) * 2
        torch.tpu.synchronize()
        reused = torchtpu.metrics.snapshot().get("reused_buffers", 0)
        out = torch.tanh(xd) * 3  # the first result dies before this flush
        torch.tpu.synchronize()
        assert torchtpu.metrics.snapshot().get("reused_buffers", 0) == reused + lent
    torch.testing.assert_close(out.cpu(), torch.tanh(x) * 3)


def test_an_input_placed_on_the_device_is_not_donated():
    # x, a program's result that read no input (randn), is not committed to a device; y, sent
    # from the host, is. The flush places x beside y as a new array over x's buffer, which x
    # still holds: donated, it was deleted under x ("Array has been deleted" at x's next read;
    # AdamW's first step deleted its gradients so once its state was sent from the host).
    with torch.tpu.set_eager_mode(DEFER):
        x = torch.randn(8, 4, device="tpu")
        x_cpu = x.cpu()
        y = torch.ones(8, 4).to("tpu")
        y.add_(x * 2)
        torch.tpu.synchronize()
        assert torch.equal(x.cpu(), x_cpu)
        assert torch.equal(y.cpu(), 1 + x_cpu * 2)



def test_a_placed_input_replaced_in_place_is_donated_from_the_first_step():
    # A parameter made on the device by torch.randn is not committed (its program read no
    # input); the first flush places it beside the step's other inputs. Nothing but the
    # recording holds it once the update replaces it, so it is donated as the next steps donate
    # the first's results: one program, built at the first step alone (a Llama's first
    # DeferAndFuse step built its program twice).
    p = torch.randn(64, 32, device="tpu")
    cpu_p, g = p.cpu(), torch.randn(64, 32)
    m, v = torch.zeros(64, 32, device="tpu"), torch.zeros(64, 32, device="tpu")
    cpu_m, cpu_v = torch.zeros(64, 32), torch.zeros(64, 32)
    built = []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(3):
            made = metrics.programs_made()
            _update(p, m, v, g.to("tpu"))
            torch.tpu.synchronize()
            built.append(metrics.programs_made() - made)
            _update(cpu_p, cpu_m, cpu_v, g)
    assert built[0] >= 1 and built[1:] == [0, 0]
    for d, c in zip((p, m, v), (cpu_p, cpu_m, cpu_v)):
        torch.testing.assert_close(d.cpu(), c, rtol=1e-6, atol=1e-6)
