"""``SharedLinear``: an ``nn.Linear`` subclass built over another linear's own parameters.

The CPU linears (``models/cpu_linear.py``) and the batch-invariant ones
(``kernels/batch_invariant.py``) replace a model's ``nn.Linear`` layers after loading with a
subclass whose ``forward`` runs another kernel; ``sharing`` makes one without copying weights.
"""

from __future__ import annotations

from typing import Self, cast

from torch import nn


class SharedLinear(nn.Linear):
    """Base of the linears whose ``forward`` differs from ``nn.Linear``'s (subclasses set it)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> Self:
        """An instance over ``linear``'s own parameter tensors (nothing copied)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.register_parameter("weight", cast(nn.Parameter, linear.weight))
        new.register_parameter("bias", cast(nn.Parameter | None, linear.bias))
        return new
