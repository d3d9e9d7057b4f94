"""DeferAndFuse's replay of calls over tensor lists (``eager/defer_replay_lists.py``): an
optimizer's and clipping's ``_foreach_*`` calls and ``cat`` repeating the call kept at their
place are appended without the op path; a list of another length, a tensor of another
geometry, a number of another type or sign, another constant, or arguments sharing storages
otherwise take the op path. Every step's values are compared with CPU's."""

import pytest
import torch

from torchtpu.eager import defer_replay

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE
ORDER = [0, 0, 1, 1, 0]  # consecutive steps differ in one thing at a time


@pytest.fixture(autouse=True)
def fresh_tape():
    defer_replay.REPLAY.tape.clear()


def _tensors(n: int, seed: int, shape=(3, 4)) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _loop(make, steps: int) -> list:
    """make(step, device) -> list of tensors, under DeferAndFuse (read each step) and on CPU:
    equal values; the list calls replayed per step."""
    counts = []
    with torch.tpu.set_eager_mode(DEFER):
        for i in range(steps):
            before = defer_replay.REPLAY.lists
            got = [t.cpu() for t in make(i, "tpu")]
            counts.append(defer_replay.REPLAY.lists - before)
            for g, w in zip(got, make(i, "cpu"), strict=True):
                torch.testing.assert_close(g, w)
    return counts


def test_adamw_and_clipping_replay_their_list_calls_with_cpus_values():
    params = {d: [torch.nn.Parameter(t.to(d)) for t in _tensors(5, 1)] for d in ("cpu", "tpu")}
    grads = _tensors(5, 2)
    opts = {d: torch.optim.AdamW(ps, lr=1e-1, weight_decay=0.1) for d, ps in params.items()}

    def make(i, device):
        ps = params[device]
        for p, g in zip(ps, grads):
            p.grad = (g * (i + 1)).to(device)
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        opts[device].step()
        opts[device].zero_grad(set_to_none=True)
        # (Read as they are: a call recorded after the step would start another recording,
        # whose calls take the same places.)
        return [p.detach() for p in ps] + [opts[device].state[p]["exp_avg_sq"] for p in ps]

    counts = _loop(make, 5)
    # clip: _foreach_norm, cat, _foreach_mul_; AdamW: 8 list calls (the bias corrections fed
    # as numbers that change every step).
    assert counts[0] == 0 and min(counts[2:]) >= 10, counts


def test_another_list_geometry_or_sharing_takes_the_op_path():
    a, b, c = (_tensors(3, s) for s in (3, 4, 5))
    on = {"tpu": [[t.to("tpu") for t in ts] for ts in (a, b, c)], "cpu": [a, b, c]}

    def make(i, device):
        x, y, z = ([t * 1 for t in ts] for ts in on[device])
        k = ORDER[i]
        # The same call at its place with: y's list or z's (sharing y's storages or not), a
        # shorter list, a transposed tensor (not its storage whole: the op path's view read).
        torch._foreach_addcmul_(x, y, (y, z)[k], 0.5)
        short = x[:3 - k]
        torch._foreach_mul_(short, 2.0)
        w = [y[0].t() * 1 if k else y[0] * 1, y[1] * 1]
        torch._foreach_add_(w, 1.0)
        return x + w

    counts = _loop(make, 5)
    # Step 3 repeats step 2 but for the transposed tensor (never kept); step 4 repeats only
    # the add_ kept at step 1.
    assert counts == [0, 3, 0, 2, 1], counts


def test_another_number_type_sign_or_constant_takes_the_op_path():
    a = _tensors(3, 6)
    on = {"tpu": [t.to("tpu") for t in a], "cpu": a}

    def make(i, device):
        x1, x2, x3, x4 = ([t * 1 for t in on[device]] for _ in range(4))
        k = ORDER[i]
        # A fed number whose value changes every step replays; its type or sign decides
        # (an int, a negative), as does a constant (the norm's order) or a fed list's types.
        # (The norm first: a call taking the op path may record more than its node, which
        # moves the places of the calls after it.)
        norms = torch._foreach_norm(x3, (3, 1)[k])  # (2, the default, is not passed)
        torch._foreach_mul_(x1, (0.25 + i, 5)[k])
        torch._foreach_add_(x2, (1.5, -1.5)[k])
        torch._foreach_div_(x4, [(1.5 + i, 2.0, 3.0), (7, 2.0, 3.0)][k])
        return x1 + x2 + x4 + list(norms) + [torch.stack(norms)]

    counts = _loop(make, 5)
    # mul, add, norm, div, cat (stack's) again; where one thing changed only the cat of norms
    # of the same shapes.
    assert counts == [0, 5, 1, 5, 1], counts


def test_a_list_read_in_another_order_or_through_another_storage_takes_the_op_path():
    g = torch.Generator().manual_seed(8)
    s, u = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    flat = torch.randn(16, generator=g)
    on = {"tpu": (s.to("tpu"), u.to("tpu"), flat.to("tpu"), flat.view(4, 4).to("tpu")),
          "cpu": (s, u, flat, flat.view(4, 4))}

    def make(i, device):
        s, u, flat, square = on[device]
        k = ORDER[i]
        # The same shape, strides and dtype: a (4, 4) storage, or a (16,) one read as (4, 4)
        # (a program reading it reshaped); a tensor or its transpose (read inside the program).
        rows = torch.cat([(square, flat.view(4, 4))[k], u])
        return [rows, torch.cat([(s, s.t())[k], u])]

    counts = _loop(make, 5)
    # Steps 2 and 4 differ from the step before in both calls; step 3 repeats step 2.
    assert counts == [0, 2, 0, 2, 0], counts


def test_functional_list_results_are_fresh_tensors_with_cpus_values():
    a = _tensors(4, 7, (2, 3))
    on = {"tpu": [t.to("tpu") for t in a], "cpu": a}

    def make(i, device):
        x = [t.abs() + i for t in on[device]]
        roots = torch._foreach_sqrt(x)
        roots[0].add_(1.0)  # each result its own storage
        return list(roots) + [torch.cat([r.unsqueeze(0) for r in roots])]

    counts = _loop(make, 3)
    assert counts[1] == 2 and counts[2] == 2, counts  # sqrt and cat


def test_a_cat_of_views_replays_and_a_view_at_another_offset_takes_the_op_path():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(9))
    on = {"tpu": x.to("tpu"), "cpu": x}

    def make(i, device):
        y = on[device] * 1
        # Rotary's turn: a fresh half and a slice of y, read inside cat's program; the slice
        # at offset 0 or 1 (the same shape, strides and storage value).
        half = (y[..., :4], y[..., 1:5])[ORDER[i]]
        return [torch.cat((-y[..., 4:], half), dim=-1)]

    assert _loop(make, 5) == [0, 1, 0, 1, 0]


def test_a_view_of_another_shape_with_the_same_strides_takes_the_op_path():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(11))
    on = {"tpu": x.to("tpu"), "cpu": x}

    def make(i, device):
        y = on[device] * 1
        # A slice of y of 4 or 3 columns: the same strides, offset and storage value.
        half = (y[..., :4], y[..., :3])[ORDER[i]]
        return [torch.cat((-y[..., 4:], half), dim=-1)]

    assert _loop(make, 5) == [0, 1, 0, 1, 0]


def test_a_pending_value_of_another_shape_behind_the_same_geometry_takes_the_op_path():
    g = torch.Generator().manual_seed(10)
    s, u, flat = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g), \
        torch.randn(16, generator=g)
    on = {"tpu": (s.to("tpu"), u.to("tpu"), flat.to("tpu")), "cpu": (s, u, flat)}

    def make(i, device):
        s, u, flat = on[device]
        # Both values pending in the recording: a (4, 4) one, or a (16,) one read as (4, 4).
        square = (s * 1, (flat * 1).view(4, 4))[ORDER[i]]
        return [torch.cat([square, u * 1])]

    assert _loop(make, 5) == [0, 1, 0, 1, 0]
