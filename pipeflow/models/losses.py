"""The built-in models' losses, shared by the models that classify."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def classification_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy: logits (B, classes), targets (B,) long -> scalar."""
    return F.cross_entropy(logits, targets)
