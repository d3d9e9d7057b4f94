"""Convolution (1-3d, transposed) and pooling, forward and backward."""

import torch

aten = torch.ops.aten
