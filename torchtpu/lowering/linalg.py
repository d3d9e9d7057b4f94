"""Matrix products and linear algebra: mm, bmm, addmm, baddbmm, dot, linalg ops."""

import torch

aten = torch.ops.aten
