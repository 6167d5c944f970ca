"""Per-example gradients on demand (``GhostClipping.grad_samples``): p.grad_sample (B, *p.shape),
materialised from the factors the norm rules built, with no second implementation per layer."""
from __future__ import annotations

import torch

from ..norms.factors import example_chunks
from .modes import new_factor_store


class SampleRequest:
    """The parameters whose per-example gradients a ``grad_samples`` block wants, and its byte bound."""

    def __init__(self, wanted, max_bytes: int):
        self.wanted = wanted        # ids of the parameters wanted, or None for every trainable one
        self.max_bytes = max_bytes  # bound of B * sum(p.numel()) * itemsize

    def wants(self, param) -> bool:
        return self.wanted is None or id(param) in self.wanted

    def start(self, parameters, B: int):
        """Refuse a request above max_bytes before the backward computes anything; clear the wanted
        parameters' grad_sample; return the store the norm pass fills (parameter -> its factors)."""
        params = [p for p in parameters if p.requires_grad and self.wants(p)]
        size = B * sum(p.numel() * p.element_size() for p in params)
        if size > self.max_bytes:
            raise ValueError(
                f"grad_samples would hold {size / 2 ** 20:.1f} MiB of per-example gradients ({B} examples), above "
                f"max_bytes={self.max_bytes}. Ask for fewer parameters (params=...), use a smaller physical batch "
                "(max_physical_batch_size), or raise max_bytes.")
        for p in params:
            p.grad_sample = None
        return new_factor_store()


@torch.no_grad()
def write_samples(samples, B: int) -> None:
    """p.grad_sample = the sum of each use's materialised factor, in example chunks."""
    for param, factors in samples.items():
        out = torch.empty(B, *param.shape, dtype=param.dtype, device=param.device)
        for lo, hi in example_chunks(B, param.numel()):
            part = factors[0].materialize(lo, hi)
            for factor in factors[1:]:  # further uses of the parameter (tied weights)
                part = part + factor.materialize(lo, hi)
            out[lo:hi] = part.reshape(hi - lo, *param.shape)
        param.grad_sample = out
