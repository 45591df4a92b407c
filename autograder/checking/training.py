"""The grader's own training: plain SGD in one process, which data-, model- and
pipeline-parallel training must equal (in float64 where the check compares with it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sgd_steps(model: nn.Module, batches, lr: float, *, loss=F.cross_entropy, shares: int = 1
              ) -> tuple[list[float], list]:
    """For each ``(X, y)`` in ``batches``: the mean ``loss`` over the batch, backward, and
    ``p -= lr * p.grad`` for every parameter with a gradient. Returns (each step's loss, the
    gradients of the last step: None for a parameter that got none).

    ``shares > 1``: each batch is split in that many equal shares (``torch.tensor_split``), and
    the step's gradient is the mean of the shares' gradients, each of the mean loss over its
    share: the same value, summed in the order of data-parallel ranks (each rank's backward,
    then the average), whose float32 rounding differs from the whole batch's."""
    losses, grads = [], []
    for X, y in batches:
        model.zero_grad(set_to_none=True)
        values = [loss(model(Xs), ys) for Xs, ys in zip(torch.tensor_split(X, shares),
                                                        torch.tensor_split(y, shares))]
        for v in values:
            v.backward()  # the shares' gradients add up in .grad, as an all-reduce sums them
        if shares > 1:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad /= shares
        value = sum(values) / shares if shares > 1 else values[0]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        losses.append(value.item())
    model.zero_grad(set_to_none=True)
    return losses, grads


class FunctionalModel(nn.Module):
    """A model given as ``forward(X, params)`` and a list of parameter tensors (Assignment 1's
    LeNet), as an ``nn.Module`` that :func:`sgd_steps` can train."""

    def __init__(self, forward, params: list[torch.Tensor]):
        super().__init__()
        self._forward = forward
        self.params = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])

    def forward(self, X):
        return self._forward(X, list(self.params))
