"""Shape and layout ops that produce new buffers: cat, clone, padding, flip, roll, repeat, tril/triu."""

import torch

aten = torch.ops.aten
