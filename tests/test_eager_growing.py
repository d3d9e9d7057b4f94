"""Eager loops over growing lengths: a new length inside a size bucket compiles nothing.

A greedy sampler feeds a TinyGPT its whole growing context each step (cropped at its block
size), in each eager mode: its tokens equal CPU's, and once a bucket has been entered, the
lengths after it in the same bucket load no program (``compile/eager_buckets.py``).
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from torchtpu import metrics
from torchtpu.compile import call_sites, eager_buckets
from torchtpu.demo.gpt import TinyGPT
from torchtpu.eager.modes import EagerMode, set_eager_mode
from torchtpu.testing.buckets import fresh_buckets

# A block of 24: every length and the cropped windows run in the first bucket (64); one layer
# keeps the programs few.
BLOCK = 24


def _greedy(model: TinyGPT, idx: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(idx[:, -model.block:])
            nxt = logits[:, -1, :].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
    return idx


def _programs() -> int:
    """Programs compiled or loaded (from JAX's cache or by key: a warm cache's load is one too)."""
    return metrics.programs_made()


@pytest.fixture(scope="module", autouse=True)
def buckets_on():
    # The sites and exact calls as a fresh process has them, here and for the worker's next
    # file (with the sizes seen here kept, its first calls of the same specs resolved as
    # growing: test_lazy_casts failed after this file in one process).
    with fresh_buckets():
        yield


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cpu = TinyGPT(13, BLOCK, n_layer=1, n_head=2, n_embd=16).eval()
    tpu = TinyGPT(13, BLOCK, n_layer=1, n_head=2, n_embd=16).eval()
    tpu.load_state_dict(cpu.state_dict())
    prompt = torch.tensor([[3, 7]])
    return cpu, tpu.to("tpu"), prompt, _greedy(cpu, prompt, 28)


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
                                  EagerMode.DEFER_AND_FUSE])
def test_growing_loop_compiles_per_bucket_not_per_length(models, mode):
    _, model, prompt, expected = models
    # A collection that runs mid-loop (when is up to the other threads' allocations too) frees
    # tensors earlier files left in cycles and changes which outputs a DeferAndFuse recording
    # keeps alive: its flush then records another program than the step before (the values
    # are still right). The count below is about buckets, so the collector waits.
    gc.collect()
    gc.disable()
    try:
        _grow(model, prompt, expected, mode)
    finally:
        gc.enable()


def _grow(model, prompt, expected, mode) -> None:
    with set_eager_mode(mode):
        idx = _greedy(model, prompt.to("tpu"), 16)  # inputs of lengths 2..17
        before = _programs()
        snap = metrics.snapshot()
        calls = snap.get("eager_bucketed_calls", 0)
        idx = _greedy(model, idx, 6)                 # 18..23, and cat's results to 24
        now = metrics.snapshot()
        # in the buckets 17 entered; the message names what moved (an order dependence seen at
        # high load: a clearing of JAX's caches reloads programs, a new key compiles)
        assert _programs() - before == 0, {k: now.get(k, 0) - snap.get(k, 0) for k in (
            "executable_compiles", "persistent_cache_hits", "executable_caches_cleared",
            "executions", "deferred_ops")}
        assert metrics.snapshot().get("eager_bucketed_calls", 0) > calls
        idx = _greedy(model, idx, 6)                 # 24, then cropped windows of 24
    assert torch.equal(idx.cpu(), expected)


def test_buckets_are_the_compiled_paths():
    assert [eager_buckets._bucket(n) for n in (2, 64, 65, 129, 512, 513)] == \
        [64, 64, 128, 256, 512, 1024]


@pytest.mark.parametrize("after_another", [False, True])
def test_every_block_of_a_deeper_model_grows_with_the_first(after_another):
    """Blocks of one class run at the same lines, each with its own sizes: the first block to
    run a length must not take it for the others, and a block that first runs once the first
    one's sizes vary grows with it; also when another model of those shapes ran the same
    lengths before. (Before: the later blocks ran exact, a program per length, for lengths
    after the first block went padded.)"""
    torch.manual_seed(2)
    cpu = TinyGPT(13, 40, n_layer=3, n_head=2, n_embd=16).eval()
    tpu = TinyGPT(13, 40, n_layer=3, n_head=2, n_embd=16).eval()
    tpu.load_state_dict(cpu.state_dict())
    prompt = torch.tensor([[5]])
    if after_another:  # its calls at lengths 1..8, exact until they varied
        _greedy(TinyGPT(13, 40, n_layer=1, n_head=2, n_embd=16).eval().to("tpu"),
                prompt.to("tpu"), 8)
    tpu = tpu.to("tpu")
    # Lengths 1..4 show the growth, 5 reads the first padded context: then nothing is new.
    idx = _greedy(tpu, prompt.to("tpu"), call_sites.VARYING_VALUES + 1)
    before = _programs()
    idx = _greedy(tpu, idx, 12)
    assert _programs() - before == 0
    assert torch.equal(idx.cpu(), _greedy(cpu, prompt, call_sites.VARYING_VALUES + 13))


def test_ranges_of_a_growing_length_are_bucketed():
    """arange(0, n) and arange(0, n, 1) (nanoGPT's positions) of a growing n: padded like
    arange(n), one program per bucket; arange(2, n) and a step of 2 have no padded layout."""
    weight = torch.randn(70, 3)
    table = weight.to("tpu")
    for k, n in enumerate(range(2, 40)):
        if k == call_sites.VARYING_VALUES + 1:
            before = _programs()
        got = [F.embedding(torch.arange(0, n, device="tpu"), table),
               F.embedding(torch.arange(0, n, 1, device="tpu"), table),
               torch.arange(2, n, device="tpu"), torch.arange(0, n, 2, device="tpu")]
        want = [F.embedding(torch.arange(0, n), weight), F.embedding(torch.arange(0, n, 1), weight),
                torch.arange(2, n), torch.arange(0, n, 2)]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w)
    new = _programs() - before
    assert new <= 2 * (40 - 2 - call_sites.VARYING_VALUES - 1) + 1, new  # the last two


def test_negative_indices_into_a_growing_dim_count_from_its_real_end():
    # x[:, [-1, 0]] at a line whose x grows: padded, -1 must still be the last real position.
    torch.manual_seed(0)
    index = torch.tensor([-1, 0, -3])
    calls = metrics.snapshot().get("eager_bucketed_calls", 0)
    for n in range(3, 20):
        x = torch.randn(2, n)
        assert torch.equal(x.to("tpu")[:, index.to("tpu")].cpu(), x[:, index])
    assert metrics.snapshot().get("eager_bucketed_calls", 0) > calls


def test_a_growing_view_that_reinterprets_its_dtype_keeps_its_bits():
    # x.view(int32) has its float storage's shape: read on the host it must not become floats.
    torch.manual_seed(0)
    for n in range(3, 12):
        x = torch.randn(2, n)
        assert torch.equal((x.to("tpu").view(torch.int32) + 1).cpu(), x.view(torch.int32) + 1)


def test_a_varying_0d_view_read_on_the_host_stays_0d():
    # v[0][i] for each i at one line (PyTorch's test_storage): from the 4th offset on it is read
    # on the host, where np.ascontiguousarray made a 0-d view 1-d, and clone() then failed.
    host = torch.arange(15.0).reshape(3, 5)
    v = host.to("tpu")
    views = metrics.snapshot().get("eager_host_views", 0)
    for i in range(5):
        y = v[0][i].clone()
        assert y.shape == () and y.item() == host[0][i].item()
    assert metrics.snapshot().get("eager_host_views", 0) > views


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.bfloat16])
def test_varying_views_of_ml_dtypes_are_read_on_the_host_with_their_bits(dtype):
    # numpy's as_strided cannot name float8 ('<f1' not understood): PyTorch's test_index_select
    # failed for float8_e5m2 once its views were read on the host.
    host = torch.randn(4, 6).to(dtype)
    v = host.to("tpu")
    views = metrics.snapshot().get("eager_host_views", 0)
    bits = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    for i in range(6):
        got = v[1:, i].clone().cpu()
        assert got.dtype == dtype
        assert torch.equal(got.view(bits), host[1:, i].contiguous().view(bits))
    assert metrics.snapshot().get("eager_host_views", 0) > views


def test_another_model_of_the_class_keeps_its_fixed_sizes_exact(models):
    # The grown model's lines took many sizes; another TinyGPT at those lines has its own.
    _, grown, prompt, _ = models
    _greedy(grown, prompt.to("tpu"), 6)
    torch.manual_seed(1)
    other = TinyGPT(13, BLOCK, n_layer=1, n_head=2, n_embd=16).eval().to("tpu")
    calls = metrics.snapshot().get("eager_bucketed_calls", 0)
    with torch.no_grad():
        other(torch.arange(1, 12).unsqueeze(0).to("tpu"))
    assert metrics.snapshot().get("eager_bucketed_calls", 0) == calls


def test_backward_calls_keep_the_exact_path():
    # Every backward op comes from the one line that calls backward(), whatever layer it
    # belongs to: sizes there say nothing about growth, so autograd's calls are never padded.
    torch.manual_seed(0)
    start, in_backward = metrics.snapshot().get("eager_bucketed_calls", 0), 0
    for n in range(3, 12):
        x = torch.randn(2, n)
        xt, xc = x.to("tpu").requires_grad_(), x.clone().requires_grad_()
        loss = (xt.softmax(-1) * xt).sum()
        calls = metrics.snapshot().get("eager_bucketed_calls", 0)
        loss.backward()
        in_backward += metrics.snapshot().get("eager_bucketed_calls", 0) - calls
        (xc.softmax(-1) * xc).sum().backward()
        torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    assert metrics.snapshot().get("eager_bucketed_calls", 0) > start  # the forward's were
    assert in_backward == 0


def test_copies_of_views_at_different_lines_are_different_sites():
    # copy_ runs inside errors.at_user's wrapper: were its line the site, the four geometries
    # below (one each line) would be one family's, varying, and the fourth read on the host.
    x = torch.randn(4, 6, 8).to("tpu")
    views = metrics.snapshot().get("eager_host_views", 0)
    torch.empty(6, 4, 8, device="tpu").copy_(x.transpose(0, 1))
    torch.empty(4, 8, 6, device="tpu").copy_(x.transpose(1, 2))
    torch.empty(8, 4, 6, device="tpu").copy_(x.permute(2, 0, 1))
    got = torch.empty(3, 6, 8, device="tpu").copy_(x[1:])
    assert metrics.snapshot().get("eager_host_views", 0) == views
    assert torch.equal(got.cpu(), x.cpu()[1:])


def test_a_call_site_keeps_no_local_of_its_method_alive():
    # ``site`` reads the method's ``self`` through ``f_locals``, a copy of every local the frame
    # keeps: emptied again, a local the method drops is freed at once, as without the lookup.
    import weakref

    class Box:
        pass

    class Caller:
        def drops(self):
            box = Box()
            ref = weakref.ref(box)  # (checked before the frame ends, which frees all)
            found = call_sites.site()
            box = None  # noqa: F841  (the name dropped: nothing else holds it)
            return ref() is None, found

        def holds(self):
            names = locals()  # the caller's own view of its locals stays whole
            value = 1
            call_sites.site()
            return names, value

    caller = Caller()
    freed, found = caller.drops()
    assert freed
    assert found[0][2] == call_sites._token(caller)
    names, _ = caller.holds()
    assert names["value"] == 1 and names["self"] is caller


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    # TRL's chunked log-probabilities: the head's weight taken a vocabulary chunk at a time,
    # one line whose view moves (its offset, then the last chunk's size)
    return torch.cat([torch.mm(hidden, weight[s:s + chunk].t())
                      for s in range(0, weight.shape[0], chunk)], 1)


_MOVED = ("eager_host_views", "eager_window_views", "device_to_host_bytes",
          "host_to_device_bytes")


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
@pytest.mark.parametrize("rows", [slice(None), slice(1, 4)], ids=["whole", "view"])
def test_moving_chunks_of_a_weight_are_read_on_the_device(mode, rows):
    # Their offsets vary at one site: read at a traced start, one program for every offset, not
    # each a host read of the whole weight (and put back) every pass. The other input, a view
    # of an activation whose geometry stays (TRL's ``hidden[token_start:token_end]``), is read
    # by its one geometry's program, not on the host at each chunk.
    call_sites.clear()  # (the site's family as the views of this case make it)
    eager_buckets._exact.clear()
    torch.manual_seed(3)
    hidden, weight = torch.randn(5, 8), torch.nn.Parameter(torch.randn(71, 8))
    with torch.no_grad():
        want = _chunked(hidden[rows], weight, 12)
    ht = hidden.to("tpu")
    wt = torch.nn.Parameter(weight.detach().to("tpu"))
    with set_eager_mode(mode), torch.no_grad():
        for _ in range(2):  # its offsets vary from the fourth chunk on; then every chunk's
            _chunked(ht[rows], wt, 12).cpu()
        before = (metrics.snapshot(), _programs())
        got = _chunked(ht[rows], wt, 12).cpu()
        after = (metrics.snapshot(), _programs())
    delta = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in _MOVED}
    assert delta["eager_host_views"] == 0 and delta["eager_window_views"] >= 3, delta
    # Nothing through the host but the result's read
    assert delta["device_to_host_bytes"] == got.nbytes and delta["host_to_device_bytes"] == 0
    assert after[1] - before[1] == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_chunks_of_a_growing_storage_are_read_on_the_host_and_counted(mode):
    # The last 12 rows of a storage one row longer each pass: a new shape each time, so read on
    # the host (no program per length); the whole storage comes over and the chunk goes back,
    # both counted as host bytes.
    torch.manual_seed(4)
    hidden = torch.randn(3, 8)
    weights = [torch.randn(n, 8) for n in range(20, 20 + call_sites.VARYING_VALUES + 3)]
    ht, wts = hidden.to("tpu"), [w.to("tpu") for w in weights]
    with set_eager_mode(mode):
        for i, w in enumerate(wts):
            if i == len(wts) - 1:
                before = (metrics.snapshot(), _programs())
            got = torch.mm(ht, w[-12:].t()).cpu()  # (one site)
        after = (metrics.snapshot(), _programs())
    delta = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in _MOVED}
    assert delta["eager_host_views"] == 1 and delta["eager_window_views"] == 0, delta
    assert delta["device_to_host_bytes"] == weights[-1].nbytes + got.nbytes, delta
    assert delta["host_to_device_bytes"] == weights[-1][-12:].nbytes, delta
    assert after[1] - before[1] == 0
    torch.testing.assert_close(got, hidden @ weights[-1][-12:].t(), rtol=1e-5, atol=1e-5)
