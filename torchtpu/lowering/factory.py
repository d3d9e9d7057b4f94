"""Factory ops: full, arange, linspace, eye, scalar_tensor and friends."""

import torch

aten = torch.ops.aten
