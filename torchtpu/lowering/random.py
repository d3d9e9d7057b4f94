"""Random ops drawn from the device generator: uniform, normal, bernoulli, randint, randperm, multinomial, dropout."""

import torch

aten = torch.ops.aten
