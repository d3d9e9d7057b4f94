"""Sparse layouts on tpu are refused by name wherever a sparse tensor would reach the device
(tpu tensors are strided only), and the OpInfos' error_inputs_sparse count that refusal."""

import pytest
import torch
from torch.testing._internal.common_dtype import floating_types
from torch.testing._internal.opinfo.core import ErrorInput, OpInfo, SampleInput

import torchtpu  # noqa: F401
from torchtpu.testing import errors

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


def _sum_on_sparse_rows(op, device, layout, **kwargs):
    # As PyTorch's own error_inputs_sparse for sum: CPU refuses a CSR row sum without keepdim;
    # given in every layout, CPU accepts the others (not counted).
    x = DENSE.to_sparse(layout=layout, blocksize=(1, 1) if layout in (
        torch.sparse_bsr, torch.sparse_bsc) else None)
    yield ErrorInput(SampleInput(x, kwargs={"dim": 0}), error_type=RuntimeError,
                     error_regex="reduction operations on CSR tensors with keepdim=False")


def test_error_inputs_sparse_count_the_refusal():
    info = OpInfo("sum_rows", op=lambda x, dim: x.sum(dim), dtypes=floating_types(),
                  sample_inputs_func=None, error_inputs_sparse_func=_sum_on_sparse_rows,
                  supports_sparse=True, supports_sparse_csr=True, supports_sparse_csc=True,
                  supports_sparse_bsr=True, supports_sparse_bsc=True)
    result = errors.check_sparse(info)
    assert result.name == "sum_rows [sparse]"
    assert (result.passed, result.failed, result.errored) == (1, 0, 0), result.first_error
    assert result.skipped == 4  # the layouts CPU does not refuse
