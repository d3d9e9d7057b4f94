"""Indexing: index, index_put, gather, scatter, scatter_reduce, index_select, masked ops, embedding, nonzero."""

import torch

aten = torch.ops.aten
