"""Multi-tensor ops for optimizers: _foreach_* and the fused Adam/AdamW steps."""

import torch

aten = torch.ops.aten
