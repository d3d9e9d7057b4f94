"""jax_op(..., donate_argnums=...) (torchtpu/kernels/donation.py): the donated tensor's buffer
is the one XLA writes the result into, in Strict, DeferAndFuse and torch.compile; the tensor is
consumed; a donation anything else could see is refused before anything runs."""

import jax
import pytest
import torch

from torchtpu import errors
from torchtpu.device import tensors
from torchtpu.kernels.jax_op import jax_op

EagerMode = torch.tpu.EagerMode


def _update(cache: jax.Array, rows: jax.Array, at: int) -> jax.Array:
    return jax.lax.dynamic_update_slice(cache, rows, (at, 0))


update = jax_op("test_donation::update", _update, donate_argnums=(0,))


def _expected(cache, rows, at):
    out = cache.clone()
    out[at:at + rows.shape[0]] = rows
    return out


def _buffer(t: torch.Tensor) -> int:
    torch.tpu.synchronize()
    return tensors.storage_array(t).unsafe_buffer_pointer()


def _cache():
    cpu = torch.randn(16, 8)
    # A copy made on the device: on XLA:CPU a transfer's buffer may be the host's own memory,
    # which XLA cannot write a result into.
    cache = cpu.to("tpu").clone()
    return cpu, cache, _buffer(cache)


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_the_result_is_written_into_the_donated_buffer(mode):
    rows = torch.randn(2, 8)
    with torch.tpu.set_eager_mode(mode):
        cpu, cache, before = _cache()
        out = update(cache, rows.to("tpu") * 2, 3)
        assert _buffer(out) == before  # XLA wrote the result where the cache was
        assert torch.equal(out.cpu(), _expected(cpu, rows * 2, 3))
        with pytest.raises(RuntimeError, match=r"donated to jax_op 'test_donation::update'.*"
                                               r"copy_") as caught:
            cache.cpu()
        assert errors.category_of(caught.value) == "argument"
        cache.copy_(out)  # written whole: it holds a value again
        assert torch.equal(cache.cpu(), out.cpu())


def test_a_donation_others_could_see_is_refused_and_nothing_is_consumed():
    cpu, cache, _ = _cache()
    rows = torch.zeros(1, 8, device="tpu")
    row = cache[0]
    with pytest.raises(RuntimeError, match=r"'test_donation::update' cannot take the buffer of "
                                           r"argument 'cache'.*1 other live tensor.*"
                                           r"cache\.clone\(\)") as caught:
        update(cache, rows, 0)
    assert errors.category_of(caught.value) == "kernel"
    assert torch.equal(row.cpu(), cpu[0]) and torch.equal(cache.cpu(), cpu)
    copy = update(cache.clone(), rows, 0)  # a copy may go; the original and its view stay
    assert torch.equal(copy.cpu(), _expected(cpu, rows.cpu(), 0))
    assert torch.equal(cache.cpu(), cpu)
    del row
    with pytest.raises(RuntimeError, match="another argument of this call"):
        update(cache, cache, 0)
    grad = cpu.to("tpu").requires_grad_()
    with pytest.raises(RuntimeError, match="requires grad"):
        update(grad, rows, 0)
    with pytest.raises(RuntimeError, match=r"derived backward \(jax.vjp\).*cache was donated"):
        update(cache.clone(), rows.clone().requires_grad_(), 0)  # at the call, not in backward
    assert torch.equal(update(cache, rows, 0).cpu(), _expected(cpu, rows.cpu(), 0))


def test_compiled_graphs_donate_an_input_passed_straight_to_the_op(fresh_dynamo):
    step = torch.compile(lambda cache, rows: update(cache, rows * 2, 3), backend="tpu")
    rows = torch.randn(2, 8)
    cpu, cache, before = _cache()
    out = step(cache, rows.to("tpu"))
    assert _buffer(out) == before
    assert torch.equal(out.cpu(), _expected(cpu, rows * 2, 3))
    with pytest.raises(RuntimeError, match=r"donated to 'test_donation::update' \(compiled"):
        cache.cpu()
    again = step(out, rows.to("tpu"))  # the same program, fed its own result
    assert torch.equal(again.cpu(), _expected(cpu, rows * 2, 3))
    row = again[0]
    with pytest.raises(RuntimeError, match=r"\(compiled\) cannot take the buffer of argument "
                                           r"'cache'.*1 other live tensor"):
        step(again, rows.to("tpu"))
    assert torch.equal(row.cpu(), _expected(cpu, rows * 2, 3)[0])
