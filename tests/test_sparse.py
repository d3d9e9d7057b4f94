"""Sparse layouts on tpu are refused by name wherever a sparse tensor would reach the device
(tpu tensors are strided only), and the OpInfos' error_inputs_sparse count that refusal."""

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.testing import opinfo

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

DENSE = torch.tensor([[1.0, 0.0], [0.0, 2.0]])


def _moves():
    return {
        torch.sparse_coo: lambda: DENSE.to_sparse().to("tpu"),
        torch.sparse_csr: lambda: DENSE.to_sparse_csr().to("tpu"),
        torch.sparse_csc: lambda: DENSE.to("tpu").to_sparse_csc(),  # made on tpu: the fallback's
        torch.sparse_bsr: lambda: DENSE.to_sparse_bsr((1, 1)).to("tpu"),
        torch.sparse_bsc: lambda: torch.sparse_bsc_tensor(
            torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2, 1, 1), (2, 2),
            device="tpu"),
        "empty": lambda: torch.empty(2, 2, layout=torch.sparse_csr, device="tpu"),
        "coo constructor": lambda: torch.sparse_coo_tensor(
            torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), device="tpu"),
    }


@pytest.mark.parametrize("how", list(_moves()), ids=str)
def test_sparse_layouts_are_refused_by_name(how):
    layout = how if isinstance(how, torch.layout) else \
        torch.sparse_csr if how == "empty" else torch.sparse_coo
    with pytest.raises(NotImplementedError,
                       match=rf"torchtpu.unsupported: sparse tensors \({layout}\) are not "
                             r"supported on tpu.*to_dense\(\)"):
        _moves()[how]()
    # the way out the message names
    assert torch.equal((DENSE.to_sparse().to_dense().to("tpu") * 2).cpu(), DENSE * 2)


def test_error_inputs_sparse_count_the_refusal():
    report = opinfo.run("mul", mode="errors", max_samples=50)
    sparse = {r.name: r for r in report.results}["mul [sparse]"]
    assert sparse.passed >= 4 and sparse.failed == sparse.errored == 0, report.format()
