"""DeferAndFuse reaches a steady state: a training loop that changes nothing between steps loads
no program after its first steps (neither compiled nor read from the persistent cache), also when
its steps are longer than the recording's size bound, with or without a host read each step
(split at backward's start, the default: two programs a Llama step; or not: one). The Llama
step's programs are fit for a TPU: bfloat16 products under autocast, 64-bit types only
on the token ids."""

import math
import re

import pytest
import torch

import torchtpu
from torchtpu.eager import defer
from torchtpu.testing.compare import assert_same
from torchtpu.testing.llama import Llama, LlamaConfig, train_step
from torchtpu.testing.step_census import census


@pytest.fixture(autouse=True)
def _fresh_call_sites():
    # Call sites are remembered per process: the Llama run at other sizes by earlier test files
    # makes its views look varying (bucketed, read on the host), which these counts do not expect.
    from torchtpu.compile import call_sites
    call_sites.clear()

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=2, hidden=64, seq=16)


def _loaded(before: dict, after: dict) -> int:
    """Programs a call needed that were not already in memory: compiled or read from disk."""
    return sum(after[k] - before[k] for k in ("executable_compiles", "persistent_cache_hits"))


def _model(c: LlamaConfig, device: str) -> Llama:
    torch.manual_seed(0)
    return Llama(c).to(device)


def _batch(c: LlamaConfig, device: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, c.vocab, (1, c.seq), generator=g) for _ in range(2))
    return ids.to(device), targets.to(device)


def _run(step, steps: int) -> tuple[list, list]:
    """Per step: (programs loaded, programs run)."""
    loads, runs = [], []
    for _ in range(steps):
        before = torchtpu.metrics.snapshot()
        step()
        after = torchtpu.metrics.snapshot()
        loads.append(_loaded(before, after))
        runs.append(after["executions"] - before["executions"])
    return loads, runs


def _sgd_step(model: Llama, ids, targets) -> float:
    loss = model(ids, targets)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad, alpha=0.1)
            p.grad = None
    return loss.item()


def test_a_loop_cut_by_the_size_bound_is_steady_when_it_reads_a_value_already_run(monkeypatch):
    # The bound (200 of the step's ~290 ops) cuts each step after its loss: the read at the
    # step's end finds the loss run, and must still end the recording there. Otherwise the rest
    # of the step opens the next one's recording and the cut falls elsewhere every step.
    monkeypatch.setattr(defer.RECORDER, "max_ops", 200)
    model, cpu = _model(SMALL, "tpu"), _model(SMALL, "cpu")
    batch, cpu_batch = _batch(SMALL, "tpu"), _batch(SMALL, "cpu")
    losses = []
    with torch.tpu.set_eager_mode(DEFER):
        loads, runs = _run(lambda: losses.append(_sgd_step(model, *batch)), 6)
    assert loads[3:] == [0, 0, 0], loads
    assert runs[3:] == [2, 2, 2], runs  # the bound's cut, and the read
    expected = [_sgd_step(cpu, *cpu_batch) for _ in range(6)]
    assert_same(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_a_loop_that_never_reads_is_steady_at_its_optimizer_steps(monkeypatch):
    # No host read until the end: each optimizer step ends a recording (before the next op, so
    # that the gradients zero_grad drops are not written out).
    monkeypatch.setattr(defer.RECORDER, "max_ops", 200)
    model = _model(SMALL, "tpu")
    step, _ = train_step(model)
    batch = _batch(SMALL, "tpu")
    losses = []
    with torch.tpu.set_eager_mode(DEFER):
        loads, runs = _run(lambda: losses.append(step(*batch)), 6)
        values = [loss.item() for loss in losses]
    assert loads[3:] == [0, 0, 0], loads
    assert runs[3:] == [3, 3, 3], runs  # the bound's cut, the split, the optimizer step's end
    cpu = _model(SMALL, "cpu")
    cpu_step, _ = train_step(cpu)
    expected = [cpu_step(*_batch(SMALL, "cpu")).item() for _ in range(6)]
    assert_same(torch.tensor(values), torch.tensor(expected), atol=2e-3, rtol=2e-3)


def _llama_loop(c: LlamaConfig, steps: int) -> tuple[list, list]:
    model = _model(c, "tpu")
    step, _ = train_step(model)
    batch = _batch(c, "tpu")
    with torch.tpu.set_eager_mode(DEFER):
        return _run(lambda: step(*batch).item(), steps)


@pytest.mark.parametrize("split", [True, False])
def test_an_uncut_llama_step_is_one_or_two_programs_and_steady(monkeypatch, split):
    # Split at backward's start (the default) or not (``TORCHTPU_DEFER_SPLIT=0``: one program).
    monkeypatch.setattr(defer.RECORDER, "split_min_ops", defer.SPLIT_CALLS if split else math.inf)
    loads, runs = _llama_loop(SMALL, 5)
    # The first step makes AdamW's moments outside its recording (in Strict, sent from the
    # host: small zeros), so it records the steady programs already: nothing loads after it.
    assert loads[1:] == [0, 0, 0, 0], loads
    assert runs == [2 if split else 1] * 5, runs


@pytest.mark.full
@pytest.mark.parametrize("bound", [2000, defer.MAX_OPS])
def test_a_12_layer_llama_step_is_steady(monkeypatch, bound):
    # The chip benchmark's depth. The first step makes AdamW's moments outside its recording, so
    # every step (~1,700 ops, under a bound of 2000 too) is two programs (split at backward's
    # start), the same two: nothing
    # loads after the first step (it used to cut the first step at 2000 ops, ~2,150 with the
    # moments' zeros, and the second step loaded the steady program).
    monkeypatch.setattr(defer.RECORDER, "max_ops", bound)
    c = LlamaConfig(vocab=256, dim=64, layers=12, heads=4, hidden=128, seq=64)
    loads, ran = _llama_loop(c, 5)
    assert loads[1:] == [0] * 4, loads
    assert ran[1:] == [2] * 4, ran


def test_the_llama_steps_program_multiplies_in_bf16_and_keeps_64_bits_to_the_ids():
    # A TPU emulates int64 and float64 with 32-bit ops: the (tokens, vocab) one-hot of the loss's
    # gradient and the (seq, seq) causal mask compare int32, and no product reads float32.
    model = _model(SMALL, "tpu")
    step, _ = train_step(model)
    batch = _batch(SMALL, "tpu")
    with torch.tpu.set_eager_mode(DEFER):
        step(*batch).item()
        loss = step(*batch)  # pending until the read below
        text = torch.tpu.pending_hlo()
        loss.item()
    dots = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    assert len(dots) >= 7 * SMALL.layers and all("bf16" in a and "bf16" in b for a, b in dots)
    wide = {m for m in re.findall(r"tensor<([0-9x]+)x[if]64>", text)
            if math.prod(map(int, m.split("x"))) > SMALL.seq}
    assert not wide, wide


def test_holding_last_steps_loss_one_step_longer_loads_no_program():
    # A logging line or a profiled step may keep the previous loss alive through the next flush;
    # the program must not depend on it (it did when every dead result lent its buffer: the
    # held loss lent none, another program, ~1 min to compile on the chip).
    model = _model(SMALL, "tpu")
    step, _ = train_step(model)
    batch = _batch(SMALL, "tpu")
    held, count = [], [0]

    def run():
        loss = step(*batch)  # flushed at the read below: held has last step's loss every other step
        loss.item()
        count[0] += 1
        held[:] = [loss] if count[0] % 2 else []

    with torch.tpu.set_eager_mode(DEFER):
        loads, runs = _run(run, 6)
    assert loads[1:] == [0, 0, 0, 0, 0], loads
    assert runs[1:] == [2] * 5, runs  # (the first step's: AdamW's state, made outside, and it)


def test_a_steady_llama_step_without_a_read_runs_the_step_before_and_waits_for_nothing():
    # A loop that reads its losses later (the chip benchmark's timed rounds): each step's first
    # op runs the step before's backward and optimizer step as one program, launched while the
    # host goes on recording (the forward's ran at the split). Nothing
    # in the step reads the device: not clip_grad_norm_'s total norm, not AdamW's foreach math
    # (the census runs as on a TPU, whose host reads stall: data checks stay on the device);
    # no Python number crosses with the program (AdamW's lists: 2 a parameter).
    model = _model(SMALL, "tpu")
    step, _ = train_step(model)
    batch = _batch(SMALL, "tpu")
    losses = []
    with torch.tpu.set_eager_mode(DEFER), census(dots=False) as c:
        loads, runs = _run(lambda: losses.append(step(*batch)), 6)
    values = [loss.item() for loss in losses]
    assert c.host_waits == [], c.host_waits
    assert not c.scalar_transfers, c.scalar_transfers  # numbers cross once, kept on the device
    assert loads[3:] == [0, 0, 0], loads
    assert runs[1:] == [2, 2, 2, 2, 2], runs  # the first step's: AdamW's state, made outside
    assert all(math.isfinite(v) for v in values) and values[-1] < values[0]


class _Scorer:
    """A method whose first call at new sizes has the call-site lookup read its frame, and which
    drops a result before its flush (TRL's importance-sampling ratio, masked in place of itself)."""

    def step(self, x: torch.Tensor) -> float:
        ratio = torch.exp(x)
        ratio = ratio.masked_fill(ratio > 2.0, 0.0)  # exp's result has no name from here on
        return _total(ratio)  # (a function's frame: the lookup reads no copy of its locals)


def _total(x: torch.Tensor) -> float:
    return x.sum().item()


def test_a_method_at_new_sizes_records_its_first_step_as_the_next_ones():
    # The lookup at the first step's new sizes once kept every local of the method alive to the
    # flush (``f_locals``' copy), so exp's result was an output there and not after: a second
    # program at the second step (TRL's rollout on the chip compiled one more).
    x = torch.linspace(-1.0, 1.0, 39).reshape(3, 13)
    scorer, values = _Scorer(), []
    xt = x.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        news = []
        for _ in range(3):  # programs new to the process: also those a new process loads by key
            before = torchtpu.metrics.snapshot()
            values.append(scorer.step(xt))
            after = torchtpu.metrics.snapshot()
            news.append(_loaded(before, after) + after.get("programs_loaded_by_key", 0)
                        - before.get("programs_loaded_by_key", 0))
    assert news[1:] == [0, 0], news
    assert values == [pytest.approx(_Scorer().step(x), rel=1e-6)] * 3
