"""Device memory exhausted under a limit (TORCHTPU_MEMORY_LIMIT, set_per_process_memory_fraction):
a torchtpu.memory error naming the program, the bytes and the largest live tensors with their
stacks, and the process frees them and goes on."""

from __future__ import annotations

import pytest
import torch

from torchtpu.device import memory, memory_limit

MB = 1 << 20
N = 4 * MB // 4 * 4  # 16 MiB of float32


def _line_of(code: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip().startswith(code))


@pytest.mark.parametrize("text, size", [
    ("512M", 512 * MB), ("512m", 512 * MB), ("512MB", 512 * MB), ("512MiB", 512 * MB),
    ("512 Mi", 512 * MB), ("64K", 64 << 10), ("2GiB", 2 << 30), ("2gb", 2 << 30),
    ("1.5G", 3 << 29), ("1T", 1 << 40), (" 1048576 ", MB), ("4096B", 4096), ("1", 1),
    ("0.25", 0.25), (".5", 0.5), ("0", None), ("0.0", None), ("0M", None), ("off", None),
    ("", None), ("none", None)])
def test_sizes_parse(text, size):
    """Every form the README names (bytes, K/M/G/T suffixes, a fraction below 1, off)."""
    assert memory_limit.parse_size(text) == size


@pytest.mark.parametrize("text, says", [
    ("1.5", "is neither a whole number of bytes nor a fraction below 1"), ("1.0", "is neither"),
    ("0.5B", "is neither"), ("1.5b", "is neither"), ("lots", "is not a size"),
    ("-1", "is not a size"), ("1e6", "is not a size"), ("2X", "is not a size"),
    ("512i", "is not a size")])
def test_sizes_that_are_not_sizes_are_refused_by_name(text, says):
    with pytest.raises(ValueError, match=rf"torchtpu\.config: TORCHTPU_MEMORY_LIMIT='{text}'"
                                         rf" {says}"):
        memory_limit.parse_size(text)


def test_memory_fraction():
    with pytest.raises(ValueError, match=r"torchtpu\.argument: set_per_process_memory_fraction"):
        torch.tpu.set_per_process_memory_fraction(1.5)
    torch.tpu.set_per_process_memory_fraction(0.5)
    try:
        assert memory_limit.limit() == memory.total_memory() // 2
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    assert memory_limit.limit() is None


_doubled = torch.compile(lambda a: a * 2, backend="tpu")
_sorted_sum = torch.compile(lambda a: torch.sort(a).values.sum(), backend="tpu")


@torch.compile(backend="tpu")
def _scaled_in_place(a):
    a.mul_(3)


def test_compiled_graphs_ask_for_outputs_and_temporaries_less_donations():
    """A compiled graph's program is counted too (it comes compiled: no lowering to analyse)."""
    x = torch.ones(MB, device="tpu")  # 4 MiB
    for f in (_doubled, _sorted_sum, _scaled_in_place):  # compiled without a limit
        f(x)
    x = torch.ones(MB, device="tpu")
    base = memory_limit._in_use()
    memory_limit.set_limit(base + 2 * MB)
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            _doubled(x)  # an output of 4 MiB
        text = str(caught.value)
        assert text.startswith("torchtpu.memory: out of device memory running compiled_"), text
        assert f"asks for {4 * MB:,} bytes" in text and f"(at {__file__}:" in text, text
        del caught
        with pytest.raises(torch.OutOfMemoryError, match=r"running compiled_.* asks for (\d|,)+"):
            _sorted_sum(x)  # an output of 4 bytes, a sort's temporaries of 8 MiB
        _scaled_in_place(x)  # an output of 4 MiB, where x was: donated, it asks for nothing
        assert memory_limit._in_use() == base
    finally:
        memory_limit.set_limit(None)
    assert torch.equal(x.cpu(), torch.full((MB,), 3.0))


def test_copies_from_the_host_are_counted():
    base = memory_limit._in_use()
    memory_limit.set_limit(base + 2 * MB)
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.ones(MB).to("tpu")  # 4 MiB
        text = str(caught.value)
        assert text.startswith("torchtpu.memory: out of device memory copying a tensor from the "
                               f"host (at {__file__}:{_line_of('torch.ones(MB).to(')})"), text
        assert f"asks for {4 * MB:,} bytes with {base:,} in use" in text, text
        del caught
        small = torch.ones(1000).to("tpu")  # within the limit: copied
        with pytest.raises(torch.OutOfMemoryError, match="copying a storage from the host"):
            torch.UntypedStorage(bytes(4 * MB), device="tpu")  # torch.load's way to the device
    finally:
        memory_limit.set_limit(None)
    assert torch.equal(small.cpu(), torch.ones(1000))


def test_out_of_memory_names_program_bytes_and_tensors_and_the_process_goes_on():
    torch.tpu.memory._record_memory_history()
    base = memory_limit._in_use()
    memory_limit.set_limit(base + 40 * MB)
    try:
        a = torch.ones(N, device="tpu")          # 16 MiB
        b = torch.full((N,), 2.0, device="tpu")  # 16 MiB: 32 of 40 in use
        with pytest.raises(torch.OutOfMemoryError) as caught:
            c = a * b                            # 16 more: over
        text = str(caught.value)
        assert text.startswith("torchtpu.memory: out of device memory running aten.mul.Tensor")
        assert f"asks for {16 * MB:,} bytes" in text, text
        assert f"over the limit of {base + 40 * MB:,}" in text
        for made in ("a = torch.ones(N", "b = torch.full((N,)"):  # a's and b's lines
            assert f"{16 * MB:>14,} B  {__file__}:{_line_of(made)} in test_out" in text, text
        assert caught.value.__class__ is torch.cuda.OutOfMemoryError
        del b, caught  # free (the traceback holds the arguments too), and go on
        c = a * a
        assert torch.equal(c.cpu(), torch.ones(N))
    finally:
        memory_limit.set_limit(None)
        torch.tpu.memory._record_memory_history(None)
    assert memory_limit.limit() is None


def test_a_fused_run_over_the_limit_is_refused_at_the_flush_and_holds_nothing():
    a = torch.ones(N, device="tpu")
    b = torch.full((N,), 2.0, device="tpu")
    torch.tpu.synchronize()
    before = memory_limit._in_use()
    memory_limit.set_limit(before + 8 * MB)
    try:
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            product = a * b  # kept, so the fused run must make it (a sum alone would need none)
            with pytest.raises(torch.OutOfMemoryError, match=r"running defer_and_fuse\["):
                product.sum().item()
            del product
        assert memory_limit._in_use() == before  # nothing ran, nothing was kept
    finally:
        memory_limit.set_limit(None)
    assert torch.equal((a * b)[:3].cpu(), torch.full((3,), 2.0))


# ---------------------------------------------------------------------------- without a limit

KEEP = 20_000_000  # float32 elements: 80 MB
HUGE = 2**48  # float32 elements: 1 PiB, past what the host can map, so XLA:CPU refuses at once


def _per_op(x):
    return x.expand(HUGE) + 1


def _deferred(x):
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = x.expand(HUGE) + 1
        torch.tpu.synchronize()
    return y


_compiled_fn = None


def _compiled(x):
    global _compiled_fn
    _compiled_fn = _compiled_fn or torch.compile(lambda a: a.expand(HUGE) + 1, backend="tpu")
    return _compiled_fn(x)


def _captured(x):
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):  # a sort's temporaries: XLA:CPU allocates them as it runs
        y = torch.sort(torch.arange(HUGE // 4, device="tpu", dtype=torch.float32) * x).values.sum()
    g.replay()
    return y.item()


@pytest.mark.parametrize("path, running, asked", [
    (_per_op, "aten.add.Tensor", HUGE * 4),
    (_deferred, "defer_and_fuse[1 ops]", HUGE * 4),
    (_compiled, "compiled_inference_", HUGE * 4),
    (_captured, "an earlier program (its results waited for here)", None),
])
def test_the_runtime_refusing_memory_is_torchs_out_of_memory_error_and_the_process_goes_on(
        path, running, asked):
    """No torchtpu limit: XLA's own RESOURCE_EXHAUSTED at a launch (or, for temporaries XLA:CPU
    allocates as the program runs, at the wait for its results) is a torchtpu.memory error."""
    assert memory_limit.limit() is None
    x = torch.ones(1, device="tpu")
    # The largest live tensor, also beside what other tests in this worker left alive (16 MB).
    keep = torch.full((KEEP,), 3.0, device="tpu")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        path(x)
    text = str(caught.value)
    assert text.startswith(f"torchtpu.memory: out of device memory running {running}"), text
    assert f"(at {__file__}:" in text and "the runtime refused an allocation of " in text, text
    if asked is not None:
        assert f"of {asked:,} bytes" in text, text
    assert "RESOURCE_EXHAUSTED" in text and f"{KEEP * 4:,} B  float32[{KEEP}]" in text, text
    del caught
    assert torch.equal((x + keep).cpu(), torch.full((KEEP,), 4.0))  # it goes on
