"""What the controller records per step: one ModuleCall per hooked forward, one NormPass per backward."""
from __future__ import annotations

from collections import defaultdict

import torch

from ..norms.factors import InputGrams, SqrtProduct
from .modes import new_factor_store


class ModuleCall:
    """One call of one hooked module in a forward pass, alive as long as its graph.

    ``inputs`` and ``grads`` (the output grads G, one per tensor output) feed the norm rule;
    ``edges`` (the outputs' gradient edges) and ``input_nodes`` bound the call's region of the
    graph (the audit, the fallback); ``shapes`` and ``layouts`` say where its examples are
    (layout.py); ``fired`` is set when pass 1 reaches it, ``done`` when its norms are formed.
    """

    __slots__ = ("controller", "name", "module", "rule", "tokenwise", "params", "inputs", "input_nodes", "edges",
                 "batch_dims", "expanded", "shapes", "layouts", "projections", "grads", "fired", "eager", "done")

    def __init__(self, controller, name, module, entry, params):
        self.controller, self.name, self.module, self.params = controller, name, module, params
        self.rule = entry.rule if entry is not None else None
        self.tokenwise = entry is not None and entry.tokenwise
        self.inputs, self.edges, self.batch_dims, self.expanded, self.grads = (), [], [], [], []
        self.shapes, self.layouts, self.projections = [], None, None
        self.input_nodes = frozenset()
        self.fired = self.done = False
        self.eager = {}

    def __del__(self):
        # getattr: a copy made without __init__ (torch.compile's tracing) has no state to release.
        if not getattr(self, "fired", True):
            self.controller._forget(self)


def _device(groups):
    return next(p for parts in groups for p in parts).device


class NormPass:
    """One backward of the DP loss towards the probes: the norm pass, or the layout proof before it."""

    def __init__(self, batch_size, proving=False, groups=1):
        self.batch_size = batch_size
        self.proving = proving            # collect projections of G for the layout proof, compute nothing
        self.sq_parts = [[] for _ in range(groups)]  # per clipping group, per layer: (B,) squared norms
        self.masses = []                  # per layer, (B,) bounds of sum_t |G_t| |A_t| (precision.py)
        self.root_masses = []             # per layer, such bounds as SqrtProduct(a, b): sqrt(a b)
        self.mass_dtype = None
        self.pending = defaultdict(list)  # parameter -> factors of its several calls
        self.kept = new_factor_store()    # book-keeping: every factor, for the clipped sum
        self.exact = new_factor_store()   # two passes: the fallback's factors (precision.ExactSums)
        self.samples = None               # inside grad_samples(): parameter -> factors to materialise
        self.calls = []
        self.grams = InputGrams()         # the last input's Gram, shared by layers reading it (Q, K, V)

    def add(self, sq, group=0):
        self.sq_parts[group].append(sq)

    def total_sq(self):
        """(groups, B) float64 sums of the squared norms of each clipping group's layers, or None."""
        if not any(self.sq_parts):
            return None
        totals = []
        for parts in self.sq_parts:
            if not parts:
                totals.append(torch.zeros(self.batch_size, dtype=torch.float64, device=_device(self.sq_parts)))
                continue
            if len({p.dtype for p in parts}) > 1:
                parts = [p.double() for p in parts]
            totals.append(torch.stack(parts).sum(0).double())
        return torch.stack(totals)

    def add_mass(self, factor):
        mass = factor.token_mass(self.grams)
        if mass is None:
            return
        if isinstance(mass, SqrtProduct):
            self.root_masses.append(mass)
        else:
            self.masses.append(mass)
        dtype = factor.sum_dtype()
        if self.mass_dtype is None or torch.finfo(dtype).eps > torch.finfo(self.mass_dtype).eps:
            self.mass_dtype = dtype

    def total_mass(self):
        """(B,) sum over layers of the examples' token masses, or None if no layer has one."""
        masses = list(self.masses)
        # sqrt(a b) of every such layer in one expression per kind of b: (B,) tensors, or numbers.
        by_tensor = [m for m in self.root_masses if isinstance(m.b, torch.Tensor)]
        by_number = [m for m in self.root_masses if not isinstance(m.b, torch.Tensor)]
        if by_tensor:
            a = torch.stack([m.a for m in by_tensor]).double()
            b = torch.stack([m.b for m in by_tensor]).double()
            masses.append((a * b).clamp(min=0).sqrt().sum(0))
        if by_number:
            a = torch.stack([m.a for m in by_number]).double()
            b = torch.tensor([float(m.b) for m in by_number], dtype=torch.float64, device=a.device)[:, None]
            masses.append((a * b).clamp(min=0).sqrt().sum(0))
        if not masses:
            return None
        dtypes = {m.dtype for m in masses}
        masses = masses if len(dtypes) == 1 else [m.double() for m in masses]
        return torch.stack(masses).sum(0)
