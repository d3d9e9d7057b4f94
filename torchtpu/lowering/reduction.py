"""Reductions: sum, mean, prod, min/max, arg-reductions, var/std, norms, any/all, cumulative ops, sort/topk."""

import torch

aten = torch.ops.aten
