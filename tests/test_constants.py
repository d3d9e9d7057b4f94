"""Numbers XLA should see: special exponents and operands are baked into the program (x ** 2 runs
as x * x), other numbers stay program inputs (a changing value does not recompile)."""

import numpy as np
import pytest
import torch

from torchtpu import metrics


def _compiles() -> int:
    """Programs built so far, compiled or loaded from the persistent cache."""
    counts = metrics.snapshot()
    return counts["executable_compiles"] + counts["persistent_cache_hits"]


@pytest.mark.parametrize("exponent", [2, 3, -1, -2, 0.5, -0.5, 2.0, 0, 1.7])
def test_pow_matches_cpu_for_special_and_other_exponents(exponent):
    x = torch.rand(64) + 0.25
    np.testing.assert_allclose(x.to("tpu").pow(exponent).cpu(), x.pow(exponent), rtol=2e-6)


def test_special_numbers_are_baked_and_others_share_one_program():
    x = torch.rand(33, device="tpu") + 0.5
    for e in (1.3, 1.7):  # warm: the traced-exponent program
        (x ** e).cpu()
    before = _compiles()
    for e in (1.1, 1.9, 2.3, 3.7):
        np.testing.assert_allclose((x ** e).cpu(), x.cpu() ** e, rtol=2e-6)
    assert _compiles() == before  # other exponents are inputs of one program
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = x ** 2
        squared = torch.tpu.pending_hlo()
        z = x ** 1.5
        general = torch.tpu.pending_hlo()
    # A squared tensor is a multiply in the program, not a general power.
    assert "stablehlo.multiply" in squared and "stablehlo.power" not in squared
    assert "stablehlo.power" in general
    np.testing.assert_allclose(y.cpu(), x.cpu() ** 2, rtol=1e-6)
    np.testing.assert_allclose(z.cpu(), x.cpu() ** 1.5, rtol=1e-6)


def test_compiled_graphs_bake_special_numbers_as_eager_does():
    # The same rule in a compiled graph: x ** 2 is a multiply, x ** 1.5 a power of a traced input.
    texts = []
    f = torch.compile(lambda x: (x.pow(2), x.pow(1.5)), backend="tpu",
                      options={"debug_callback": lambda gm, text: texts.append(text)})
    x = torch.rand(33) + 0.5
    squared, general = f(x.to("tpu"))
    np.testing.assert_allclose(squared.cpu(), x ** 2, rtol=1e-6)
    np.testing.assert_allclose(general.cpu(), x ** 1.5, rtol=1e-6)
    (text,) = texts
    assert text.count("stablehlo.power") == 1 and "stablehlo.multiply" in text


def test_compiled_addcmul_and_addcdiv_in_place_match_cpu():
    # Inductor's decompositions of the in-place forms end in prims.fma.
    def f(p, a, b):
        p.addcmul_(a, b, value=0.5)
        p.addcdiv_(a, b.abs() + 1, value=0.25)
        return p

    x = torch.randn(8)
    out = torch.compile(f, backend="tpu")(x.to("tpu"), x.to("tpu"), x.to("tpu"))
    np.testing.assert_allclose(out.cpu(), f(x.clone(), x, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("first", [0.0, -0.0])
def test_a_zeros_sign_picks_its_own_program(first):
    # nan's value is baked in; 0.0 == -0.0, so a key or spec comparing numbers by == alone
    # ran the second call with the first one's program.
    x = torch.tensor([float("nan"), 1.0])
    for nan in (first, -first):
        out = x.to("tpu").nan_to_num(nan=nan).cpu()
        assert torch.equal(out.signbit(), x.nan_to_num(nan=nan).signbit()), nan


def _pow(x, e):
    return x ** e


def test_an_int_exponent_and_its_float_twin_are_apart_at_a_growing_site():
    # Ints varying at one site make its pow calls a growing family (sizes: the length and the
    # exponent). 2.0 there once shared 2's spec, and so its family, noting sizes without the
    # exponent; a pow of another length at a new site then matched it and ran padded, and
    # under DeferAndFuse ran at once instead of being recorded.
    x = torch.rand(64, device="tpu") + 0.5
    for e in (2, 3, -1, -2, 2.0):
        _pow(x, e)
    y = torch.rand(33, device="tpu") + 0.5
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        z = y ** 2
        assert "stablehlo.multiply" in torch.tpu.pending_hlo()
    np.testing.assert_allclose(z.cpu(), y.cpu() ** 2, rtol=1e-6)
