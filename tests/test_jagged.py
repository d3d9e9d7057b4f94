"""A jagged (nested) tensor's rows padded to a dense tensor on tpu, as on CPU: verl's actor
unpads its responses into one and pads them back (aten._jagged_to_padded_dense_forward)."""

import pytest
import torch

from torchtpu.testing.compare import assert_same

pad_dense = torch.ops.aten._jagged_to_padded_dense_forward


@pytest.mark.parametrize("rest", [(), (3,), (2, 3)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("lengths,max_length,padding", [
    ([2, 0, 3, 1], 3, 0.0),     # an empty row, a row as long as max_length
    ([4, 1], 2, -1.5),          # a row cut to max_length, a padding value
    ([1, 1, 1], 5, float("-inf")),
    ([0, 0], 2, 7.0),           # no values at all
], ids=["ragged", "cut", "inf", "empty"])
def test_jagged_to_padded_dense_matches_cpu(rest, lengths, max_length, padding):
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    values = torch.randn(sum(lengths), *rest)
    want = pad_dense(values, [offsets], [max_length], padding)
    # (CPU fallbacks are errors in the suite: a missing lowering fails here)
    got = pad_dense(values.to("tpu"), [offsets.to("tpu")], [max_length], padding)
    assert_same(got, want)


def test_nested_tensor_round_trip_matches_cpu():
    """How verl reaches the op: a padded batch unpadded into a jagged nested tensor and padded
    back (int32 offsets, a bf16 value)."""
    lengths = torch.tensor([3, 1, 4], dtype=torch.int32)
    rows = [torch.randn(int(n), 5).to(torch.bfloat16) for n in lengths]

    def round_trip(device):
        nested = torch.nested.nested_tensor([r.to(device) for r in rows], layout=torch.jagged)
        return torch.nested.to_padded_tensor(nested, 0.0, (3, 6, 5))

    assert_same(round_trip("tpu"), round_trip("cpu"))
