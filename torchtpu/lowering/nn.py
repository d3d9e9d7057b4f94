"""Neural-network ops: activations, softmax, normalization layers, losses, attention."""

import torch

aten = torch.ops.aten
