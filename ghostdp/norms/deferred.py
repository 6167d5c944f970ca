"""Norms of layers reduced one at a time, taken for many layers at once (the norm queue's other half).

On a GPU at BERT-base sizes no layer's input and output grad fit a stack together, so the norm queue
(batched.NormQueue) reduces one layer at a time. What those reductions need is small next to the layers'
tensors: Grams (B, T, T), H/T times smaller, and explicit (B, n) gradients. ``DeferredGrams`` keeps them
until they fill half a stack budget, or the pass ends, and takes every kept layer's norm in a few ops.
The norm pass (clipping/records.NormPass) gives one to its queue.
"""
from __future__ import annotations

import math

import torch

from .batched import GramPart, Reduced, concatenated, gram_products, mass_rows, spaced_view, stack_budget, stacked


class DeferredGrams:
    """The Grams of layers reduced alone, kept until their products are taken for many layers at once.

    On a GPU at BERT-base sizes no layer's input and output grad fit a stack together, so the norm queue
    reduces one layer at a time, through the pass's Gram cache (InputGrams): each layer's own Grams, then
    a dot product, two traces, a product, and its bias's sum and trace, some 15 ops a layer. The Grams
    (B, T, T) are H/T times smaller than the tensors they come from, so they are kept here instead
    (``take``); once they fill half a stack budget (_deferred_budget), or the pass ends, the left Grams
    and the right Grams are stacked in the layers' order (two copies, no indexing after them; a bias reads
    its weight's left Gram) and every layer's norm and squared token mass come from the few reductions of
    ``gram_products``. A LayerNorm formed alone leaves its (B, d) gradients here too (``take_explicit``),
    for one dot product per flush instead of one per parameter, and so does a low-rank weight reduced alone
    (``take_product``: a LoRA factor, whose sides a GPU cannot stack). Per-layer stand-in (profiling.overhead
    --per-layer, ghost, frozen embeddings): ATen ops per step 4636 -> 3728.
    """

    def __init__(self):
        self.weights = []       # (clipping group, left Gram, right Gram)
        self.biases = []        # (clipping group, tokens' Gram)
        self.held = set()       # ids of the distinct Grams held
        # (1, B, n) explicit gradients of parameters formed alone (LayerNorms), whose squared norms wait too:
        # (shape, dtype, device, without mass, mass scale) -> [(clipping group, gradients, (1, B) mass or None)]
        self.explicit = {}
        self.elements = 0       # the elements of the Grams held
        self.explicit_elements = 0
        self.key = None         # (shape, dtype, device) of the Grams held
        self.device = None
        self.budget = None      # _deferred_budget(self.device), looked up when the device is set

    def holds(self) -> bool:
        return bool(self.weights or self.biases or self.explicit)

    def full(self) -> bool:
        """Whether the Grams held fill their budget (``reduce`` then takes their products)."""
        return self.key is not None and self.elements >= self.budget

    def _set_device(self, device) -> None:
        if device != self.device:
            self.device, self.budget = device, _deferred_budget(device)

    def take_explicit(self, group, grads, mass, mass_scale=1.0) -> None:
        """Keeps the (1, B, n) per-example gradients of a parameter formed alone (a LayerNorm's weight or bias:
        its vecdot otherwise costs a few ops of its own) and its (1, B) token mass or None, still to be
        multiplied by ``mass_scale`` (a LayerNorm's sqrt(positions): one op for all masses of one scale)."""
        key = (grads.shape, grads.dtype, grads.device, mass is None, mass_scale)
        self.explicit.setdefault(key, []).append((group, grads, mass))
        self.explicit_elements += grads.numel()
        self._set_device(grads.device)

    def take_product(self, factor, group) -> bool:
        """Keeps the explicit gradients of an OuterProduct reduced alone on the instantiation path (_product_key:
        a LoRA factor too large to stack, as on a GPU) where they fit half a stack budget, with its token mass;
        False otherwise."""
        B = factor.batch_size
        if B * math.prod(factor.param_shape) > _deferred_budget(factor.left.device):
            return False
        self.take_explicit(group, factor.materialize(0, B).reshape(1, B, -1), mass_rows(factor.token_mass()))
        return True

    def take(self, factor, grams, group) -> bool:
        """Keeps the Grams of ``factor`` (a weight or bias on the whole-Gram path with the pass's cache, whose
        Grams fit a stack); False where it takes another path (it is then reduced on its own)."""
        reads = factor.gram_reads(grams)
        if reads is None:
            return False
        tensor = reads[0][0]
        B, T = tensor.shape[0], tensor.shape[1]
        key = ((B, T, T), reads[0][1], tensor.device)
        if self.key is None:
            if 2 * B * T * T > _deferred_budget(tensor.device):
                return False  # two Grams exceed the budget
            self.key = key
            self._set_device(tensor.device)
        elif key != self.key:
            return False  # Grams of another shape, dtype or device are held
        held = [grams.whole(*args) for args in reads]
        for gram in held:
            if id(gram) not in self.held:
                self.held.add(id(gram))
                self.elements += gram.numel()
        if len(held) == 2:  # a weight's sides
            self.weights.append((group, held[0], held[1]))
        else:
            self.biases.append((group, held[0]))
        return True

    def reduce(self, first_row: int, final: bool) -> tuple[list[Reduced], list[int]]:
        """The norms of the layers whose Grams, and of the parameters whose explicit gradients, are held, as
        rows ``first_row`` onwards, and the clipping group of each row: the Grams once they fill half a
        stack budget, the gradients likewise, both with ``final``; those reduced are dropped."""
        out, groups = [], []
        if self.key is not None and (final or self.full()):
            out, groups = self._gram_rows(first_row)
            self.weights, self.biases, self.held, self.elements, self.key = [], [], set(), 0, None
        if self.explicit and (final or self.explicit_elements >= self.budget):
            done, explicit_groups = self._explicit_rows(first_row + len(groups))
            out, groups = out + done, groups + explicit_groups
            self.explicit, self.explicit_elements = {}, 0
        if not self.holds():
            self.device = self.budget = None
        return out, groups

    def _explicit_rows(self, first_row: int) -> tuple[list[Reduced], list[int]]:
        out, groups = [], []
        for (_, dtype, _, no_mass, scale), entries in self.explicit.items():
            grads = concatenated([e[1] for e in entries])
            rows = list(range(first_row + len(groups), first_row + len(groups) + len(entries)))
            mass = None if no_mass else concatenated([e[2] for e in entries])
            if mass is not None and scale != 1.0:
                mass = mass * scale
            out.append(Reduced(rows, torch.linalg.vecdot(grads, grads), mass, None if no_mass else dtype))
            groups += [e[0] for e in entries]
        return out, groups

    def _gram_rows(self, first_row: int) -> tuple[list[Reduced], list[int]]:
        (B, T, _), dt, _ = self.key
        parts, weights, biases = [], [], []
        k = len(self.weights)
        if k:
            parts += [GramPart(0, stacked([w[1] for w in self.weights])),
                      GramPart(k, stacked([w[2] for w in self.weights]))]
            weights = [(first_row + j, j, k + j) for j in range(k)]
        if self.biases:
            # A Linear's bias reads its weight's output grad: the same Gram as the weight's left side, picked
            # from that stack (a view where they lie at equal steps), else stacked on their own.
            as_left = {id(w[1]): j for j, w in enumerate(self.weights)}
            rows = [as_left.get(id(b[1])) for b in self.biases]
            if None in rows or spaced_view(parts[:1], tuple(rows), False) is None:
                parts.append(GramPart(2 * k, stacked([b[1] for b in self.biases])))
                rows = [2 * k + j for j in range(len(self.biases))]
            biases = [(first_row + k + j, row) for j, row in enumerate(rows)]
        groups = [w[0] for w in self.weights] + [b[0] for b in self.biases]
        return gram_products(parts, weights, biases, T, dt), groups


def _deferred_budget(device) -> int:
    """Elements of Grams DeferredGrams holds: half a stack budget, since its stacks copy about as many again
    (a GPU at BERT-base B=32: 2M elements, four Grams, 8 MB held and some 20 MB while they are reduced)."""
    return stack_budget(device) // 2
