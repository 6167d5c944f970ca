"""Many layers' squared norms and token masses in a few ops: the norm pass queues its factors here.

A step on a GPU is host-bound (../shared/measurements): per layer, each small op of a norm costs a
kernel launch and its Python. So the norm pass does not reduce each layer's factors as they arrive;
it queues them (``NormQueue``) and reduces them in groups:

- the weights of Linear-type layers (``OuterProduct``) on the whole-Gram path, with their biases
  (``SummedTokens``): every distinct tensor among their sides gets its Gram X_i X_i^T in one batched
  matmul per width (inputs shared by query, key and value count once), and then
  |g_i|^2 = <L_i L_i^T, R_i R_i^T> for all weights, |sum_t G_t|^2 = sum of G_i G_i^T for all biases,
  and the token masses sqrt(tr(L L^T) tr(R R^T)) and sqrt(T tr(G G^T)) (precision.py) come from a
  handful of reductions over strided views of the stacked Grams (indexed copies only where the layers'
  Grams do not lie at equal steps);
- weights of one token (a Linear on (B, d) rows: MLPs, heads, poolers), with their biases: g_i = G_i A_i^T has
  rank one, so |g_i|^2 = |G_i|^2 |A_i|^2 and a bias's |G_i|^2; each distinct side's squared norms by one stacked
  reduction per width, for all such layers (until 2026-12-07 each was reduced alone, about ten ops a layer);
- weights whose norm is that of their explicit gradients (rank r << T: LoRA factors), of one shape: their
  sides stacked, one batched matmul L_i^T R_i, one dot product per example;
- LayerNorms of one shape (``AffineGrad``): their per-example gradients formed in one stacked
  expression (normalization.form_layer_norms), then one dot product per parameter name;
- explicit per-example gradients (``Instantiated``: biases of 2-D inputs, the fallback's) of equal
  shape: one stacked dot product;
- anything else alone, as ``sq_norm`` and ``token_mass`` give it; a weight or bias on the whole-Gram
  path reduced alone (too large to stack, as every BERT-base layer on a GPU) leaves its Grams in
  ``deferred.DeferredGrams``, which takes the products of several such layers at once (and the dot products of
  LayerNorms and low-rank weights reduced alone).

Book-keeping's clipped sums are batched the same way (batched_sums.py). Stacks hold at most
STACK_ELEMENTS elements: larger tensors are reduced one by one, without a copy. The index tensors
that pick each weight's Grams are built once per pattern of layers (the same every step) and reused,
so no step copies indices to the device. The queue holds the factors (and so the output grads G that
ghost mode would otherwise free at once) until QUEUE_ELEMENTS are waiting or one factor is too large
to stack; it is then reduced, and again at the end of the pass.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .factors import (ELEMENT_BUDGET, Instantiated, OuterProduct, SqrtProduct, SummedTokens, acc_dtype, gram,
                      gram_tile, gram_trace, prefers_gram, wide_matmul)
from .normalization import AffineGrad, form_layer_norms

# Elements of activations and output grads the queue may hold before it reduces them (16 MB in float32):
# what ghost mode holds beyond the unbatched rules, which freed each G at once.
QUEUE_ELEMENTS = 1 << 22

# The calls waiting for their norms (pass 1's arrivals, PassOne.arrive) or for their clipped sums (pass 2's
# factors, pass_two.PassTwo.write) hold at most 1/WAITING_PART of what the queue may hold (1 MB in float32): every
# peak measured then stays that of receiving each call at once (CPU tensor bytes, BERT L=2 H=256 T=128 B=8, ghost:
# 43.5 MB; waiting up to the queue's whole bound: 47.5 MB; a quarter of it still raised the Llama-shaped LoRA
# model's by 1 MB at B=4).
WAITING_PART = 16


def waiting_elements() -> int:
    """The elements that waiting calls may hold (WAITING_PART), read at each call: the queue's bound may be set."""
    return QUEUE_ELEMENTS // WAITING_PART

# Most elements one batch copies into a stack. Batching saves per-op host work (some 10 us an op) and
# costs a copy of its tensors (about 1 ns an element on a CPU, a few ps on an H100): on a CPU it pays
# for tensors of up to some ten thousand elements, on a GPU up to millions. Larger tensors are reduced
# one by one, without a copy, as the rules did before batching (measured with profiling.bench).
STACK_ELEMENTS = {"cpu": 1 << 16}
ACCELERATOR_STACK_ELEMENTS = 1 << 22


def stack_budget(device) -> int:
    return STACK_ELEMENTS.get(device.type, ACCELERATOR_STACK_ELEMENTS)


def _smallest_budget() -> int:
    return min(*STACK_ELEMENTS.values(), ACCELERATOR_STACK_ELEMENTS)


_INDEX_PATTERNS = 256  # index tensors kept per device, for this many patterns of layers


def device_of(factor):
    """The device of a factor that _held_elements counts (or that weighted_sums batches)."""
    if isinstance(factor, AffineGrad):
        return factor.call.device
    if isinstance(factor, SummedTokens):
        return factor.tokens.device
    if isinstance(factor, OuterProduct):
        return factor.left.device
    return factor.grads.device


def within_budget(items, sizes, budget):
    """``items`` in consecutive runs of at most ``budget`` elements (at least one item each)."""
    run, held = [], 0
    for position, size in zip(items, sizes):
        if run and held + size > budget:
            yield run
            run, held = [], 0
        run.append(position)
        held += size
    if run:
        yield run


class Reduced:
    """What a reduction gives for some queued factors: (k, B) squared norms and token masses (None:
    nothing in those examples can cancel), and the queue positions of their k rows. ``rooted`` False:
    ``mass`` holds the masses' squares, or, for one row, a SqrtProduct of (B,) tensors (or a tensor and a
    number) whose product they are, and the pass forms those products and roots for all such rows at once (a
    few ops a step instead of one to three per reduction: a GPU step is host-bound)."""

    __slots__ = ("rows", "sq", "mass", "mass_dtype", "rooted")

    def __init__(self, rows, sq, mass, mass_dtype, rooted=True):
        self.rows, self.sq, self.mass, self.mass_dtype, self.rooted = rows, sq, mass, mass_dtype, rooted

    def masses(self):
        """The (k, B) token masses, rooted, or None."""
        if self.rooted or self.mass is None:
            return self.mass
        if isinstance(self.mass, SqrtProduct):  # one row
            return mass_roots(self.mass.a * self.mass.b).unsqueeze(0)
        return mass_roots(self.mass)


def mass_roots(squares: torch.Tensor) -> torch.Tensor:
    """Token masses from their squares (products of traces: rounding may leave them a hair below zero)."""
    return squares.clamp(min=0).sqrt()


class NormQueue:
    """Factors waiting for their norms, with the clipping group of each."""

    def __init__(self, grams, deferred=None):
        self.grams = grams        # the pass's InputGrams, for the factors reduced alone
        self.deferred = deferred  # a deferred.DeferredGrams: what layers reduced alone leave, or None
        self.factors = []
        self.groups = []
        self.elements = 0
        self.large = False  # a factor too large to stack is queued
        self.smallest_budget = _smallest_budget()  # read once a pass: push runs for every parameter

    def push(self, factor, group: int) -> None:
        held = _held_elements(factor)
        # The device's budget is looked up only for a factor that could exceed it (per-call host work).
        if held > self.smallest_budget and held > stack_budget(device_of(factor)):
            self.large = True  # nothing to batch it with: holding it longer would only cost memory
        else:
            self.elements += held  # what a batched reduction would stack (a large factor is reduced alone)
        self.factors.append(factor)
        self.groups.append(group)

    def full(self, held: bool = False) -> bool:
        """Whether the queue holds QUEUE_ELEMENTS of factors to stack, or a factor too large to stack: reduce
        it (after the last factor of a layer call, so that a bias is reduced with its weight). ``held``: the
        factors' tensors stay alive anyway (the output grads a backward returned at once, PassOne._receive_named),
        so a factor too large to stack waits for the others (it is reduced alone, its Grams kept in bounds by
        DeferredGrams)."""
        return (self.large and not held) or self.elements >= QUEUE_ELEMENTS

    def reduce(self, final: bool = False) -> tuple[list[Reduced], list[int]]:
        """The reductions of the queued factors and the clipping group of each of their rows; empties the
        queue. Layers reduced alone leave their Grams in ``deferred``, whose products are taken whenever they
        fill half a stack budget, and with ``final`` (the end of the pass); their rows follow the queue's."""
        factors, groups = self.factors, self.groups
        self.factors, self.groups, self.elements, self.large = [], [], 0, False
        deferred_groups = []  # the clipping groups of the rows the deferred products add, after the queue's

        def flush(final_flush: bool) -> list[Reduced]:
            done, flushed = self.deferred.reduce(first_row=len(groups) + len(deferred_groups), final=final_flush)
            deferred_groups.extend(flushed)
            return done

        out = reduce_factors(factors, self.grams, self.deferred, groups, flush if self.deferred is not None else None)
        if self.deferred is not None and self.deferred.holds():
            out.extend(flush(final))
        return out, groups + deferred_groups

    def pending(self) -> bool:
        """Whether factors or deferred Grams wait for their norms."""
        return bool(self.factors) or (self.deferred is not None and self.deferred.holds())


def _held_elements(factor) -> int:
    if type(factor) is AffineGrad:  # its x and G until formed (then only (B, d) gradients)
        call = factor.call
        return call.x.numel() + call.G.numel() if call.stacked is None else 0
    if isinstance(factor, OuterProduct):
        return factor.left.numel() + factor.right.numel()
    if isinstance(factor, SummedTokens):
        return 0  # its tokens are its weight's output grad, counted there
    if isinstance(factor, Instantiated):
        return factor.grads.numel()
    return 0


def reduce_factors(factors, grams=None, deferred=None, groups=None, flush=None) -> list[Reduced]:
    """The squared norms and token masses of ``factors``, in batches where their kinds allow. With
    ``deferred`` (a deferred.DeferredGrams) and ``groups`` (the clipping group of each factor), a layer reduced
    alone through the pass's Gram cache leaves its Grams there instead (their rows are not in the result), and
    ``flush(False)`` gives the reductions of the Grams held whenever they fill its budget."""
    # One layer's factors, as the queue holds them where every layer is reduced alone (a GPU at BERT-base sizes):
    # what the partition below would do with them, directly.
    if grams is not None and _one_whole_gram_layer(factors):
        return _reduce_alone(factors, range(len(factors)), grams, deferred, groups, flush)
    if _one_layer_norm_call(factors):
        return _layer_norm_batch(factors, list(range(len(factors))), deferred, groups)
    by_gram, by_product, by_shape, by_layer_norm, by_rank_one, alone = _partition(factors)
    out = []
    for (_, _, dt, device), rows in by_rank_one.items():
        out.extend(_rank_one_batch([factors[r] for r in rows], rows, dt, device))
    for rows in by_layer_norm.values():
        out.extend(_layer_norm_batch([factors[r] for r in rows], rows, deferred, groups))
    for rows in by_gram.values():
        if grams is not None and _reduced_alone([factors[r] for r in rows]):
            # One layer, or layers too large to stack (on a GPU at BERT-base sizes, every layer): alone, each with
            # its bias, through the pass's Gram cache, which a shared input's next layers read too.
            alone.extend(rows)
            continue
        out.extend(_gram_batch([factors[r] for r in rows], rows))
    for rows in by_product.values():
        if len(rows) == 1 and deferred is not None and deferred.take_product(factors[rows[0]], groups[rows[0]]):
            continue
        out.extend(_product_batch([factors[r] for r in rows], rows))
    for rows in by_shape.values():  # stacks of at most a stack budget: a larger gradient is reduced alone, uncopied
        budget = stack_budget(factors[rows[0]].grads.device)
        for run in within_budget(rows, [factors[r].grads.numel() for r in rows], budget):
            out.append(_instantiated_batch([factors[r] for r in run], run))
    alone.sort()  # queue order: a weight forms its output grad's Gram before its bias reads it
    out.extend(_reduce_alone(factors, alone, grams, deferred, groups, flush))
    return out


def _reduced_alone(gram_batch) -> bool:
    """Whether the weights (and biases) of a Gram batch are reduced one layer at a time: one weight, or a weight
    whose sides exceed a stack budget (stacked with the others, all their Grams would be held at once)."""
    weights = [f for f in gram_batch if type(f) is OuterProduct]
    return len(weights) == 1 or any(_held_elements(f) > stack_budget(f.left.device) for f in weights)


def _one_whole_gram_layer(factors) -> bool:
    """Whether ``factors`` are one weight on the whole-Gram path, alone or with a bias after it (SummedTokens),
    which the partition sends, bias included, to _reduce_alone in that order."""
    return (0 < len(factors) <= 2 and type(factors[0]) is OuterProduct and _gram_key(factors[0]) is not None
            and (len(factors) == 1 or type(factors[1]) is SummedTokens))


def _one_layer_norm_call(factors) -> bool:
    """Whether ``factors`` are the parameters of one LayerNorm call not yet formed (the partition's by_layer_norm)."""
    first = factors[0] if factors else None
    return (type(first) is AffineGrad and first.call.stacked is None
            and all(type(f) is AffineGrad and f.call is first.call for f in factors))


def _reduce_alone(factors, rows, grams, deferred, groups, flush=None) -> list[Reduced]:
    """The factors at ``rows`` reduced one at a time, in that order: their Grams left to ``deferred`` where it
    takes them (``flush`` called before a weight where they fill its budget), else from the pass's Gram cache,
    else as sq_norm and token_mass give them."""
    out = []
    for r in rows:
        f = factors[r]
        if flush is not None and type(f) is OuterProduct and deferred.full():  # between layers: a bias's Gram
            out.extend(flush(False))                                       # stays with its weight's
        if deferred is not None and deferred.take(f, grams, groups[r]):
            continue
        both = f.cached_norms(grams)
        if both is not None:  # from the pass's cached Grams, one lookup per tensor; its mass multiplied and rooted
            out.append(Reduced([r], both[0].unsqueeze(0), both[1], f.sum_dtype(), rooted=False))  # with the others
            continue
        mass, rooted = reduced_mass(f.token_mass(grams))  # before sq_norm: both may share the pass's cached Grams
        sq = f.sq_norm(grams)
        out.append(Reduced([r], sq.unsqueeze(0), mass, f.sum_dtype() if mass is not None else None, rooted=rooted))
    return out


def reduced_mass(mass) -> tuple:
    """One layer's token mass as Reduced holds it, and whether it is rooted: a SqrtProduct as it is, multiplied and
    rooted with the pass's others (records.NormPass.total_mass); a (B,) tensor as a (1, B) row; None."""
    if isinstance(mass, SqrtProduct):
        return mass, False
    return mass_rows(mass), True


def mass_rows(mass):
    """A (B,) token mass as a (1, B) tensor, or None."""
    return None if mass is None else mass.unsqueeze(0)


def concatenated(tensors):
    """torch.cat of ``tensors``, without an op for one."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _gram_key(f: OuterProduct):
    """The batch of an OuterProduct that takes the one-tile Gram path, or None."""
    if not f.takes_whole_gram():
        return None
    B, T, _ = f.left.shape
    return ("gram", B, T, f.left.device, acc_dtype(f.left, f.right))


def _partition(factors):
    by_gram, by_product, by_shape, by_layer_norm, by_rank_one, alone = {}, {}, {}, {}, {}, []
    tokens_of = {}  # id(output grad) -> the gram batch of a weight that has it as a side
    rank_one_of = {}  # id(output grad) -> the rank-one batch of a one-token weight that has it as a side
    rest = []
    for r, f in enumerate(factors):
        kind = type(f)
        if kind is OuterProduct:
            key = _gram_key(f)
            if key is not None:
                by_gram.setdefault(key, []).append(r)
                tokens_of[id(f.left)] = tokens_of[id(f.right)] = key
                continue
            key = _rank_one_key(f)
            if key is not None:
                by_rank_one.setdefault(key, []).append(r)
                rank_one_of[id(f.left)] = key
                continue
            key = _product_key(f)
            if key is None:
                alone.append(r)
            else:
                by_product.setdefault(key, []).append(r)
        else:
            rest.append(r)
    for r in rest:
        f = factors[r]
        kind = type(f)
        if kind is SummedTokens:
            key = tokens_of.get(id(f.tokens))
            one = rank_one_of.get(id(f.tokens))
            if key is not None and f.tokens.shape[1] > 1 and acc_dtype(f.tokens) == key[4]:
                by_gram[key].append(r)
            elif one is not None and acc_dtype(f.tokens) == one[2]:  # its weight's G, one token: that G's norm
                by_rank_one[one].append(r)
            else:
                alone.append(r)
        elif kind is AffineGrad and f.call.stacked is None:
            by_layer_norm.setdefault(f.call.batch_key, []).append(r)
        elif kind is Instantiated:
            by_shape.setdefault(("grads", f.grads.shape, f.grads.dtype, f.grads.device, f.mass is None), []).append(r)
        else:
            alone.append(r)
    return by_gram, by_product, by_shape, by_layer_norm, by_rank_one, alone


def _rank_one_key(f: OuterProduct):
    """The batch of a one-token OuterProduct (a Linear on (B, d) rows), or None (more tokens, or sides cast)."""
    B, T, _ = f.left.shape
    if T != 1 or f.operand_dtype is not None:
        return None
    return ("rank one", B, acc_dtype(f.left, f.right), f.left.device)


def _rank_one_batch(factors, rows, dt, device) -> list[Reduced]:
    """One-token weights (OuterProduct) and their biases (SummedTokens of the weight's G): |g_i|^2 = |G_i|^2 |A_i|^2
    (a rank-one gradient) and |G_i|^2, from each distinct side's squared norms, one stacked reduction per width
    (within a stack budget). No token mass: one token, nothing cancels (precision.py)."""
    column, widths = {}, {}  # id(side) -> its column; width -> [(column, side)]

    def col(x):
        if id(x) not in column:
            column[id(x)] = len(column)
            widths.setdefault(x.shape[-1], []).append((column[id(x)], x))
        return column[id(x)]

    weights = [(r, col(f.left), col(f.right)) for r, f in zip(rows, factors) if type(f) is OuterProduct]
    biases = [(r, column[id(f.tokens)]) for r, f in zip(rows, factors) if type(f) is SummedTokens]
    norms = [None] * len(column)  # per column: (B,) squared norms
    budget = stack_budget(device)
    for members in widths.values():
        for run in within_budget(members, [x.numel() for _, x in members], budget):
            x = stacked([side for _, side in run]).to(dt)  # (k, B, 1, width)
            squares = (x * x).sum((2, 3))  # (k, B)
            for k, (c, _) in enumerate(run):
                norms[c] = squares[k]
    out = []
    if weights:
        left = torch.stack([norms[w[1]] for w in weights])
        right = torch.stack([norms[w[2]] for w in weights])
        out.append(Reduced([w[0] for w in weights], left * right, None, None))
    if biases:
        out.append(Reduced([b[0] for b in biases], torch.stack([norms[b[1]] for b in biases]), None, None))
    return out


def _product_key(f: OuterProduct):
    """The batch of an OuterProduct whose norm is its explicit gradients' (the instantiation path: a LoRA
    factor, rank r << T), or None (one token, a tiled Gram, or sides cast to another dtype: reduced alone)."""
    B, T, m = f.left.shape
    n = f.right.shape[-1]
    if T <= 1 or f.operand_dtype is not None or prefers_gram(T, m, n, gram_tile(B, T, f.left.device.type)):
        return None
    return ("product", f.left.shape, f.right.shape, f.left.dtype, f.right.dtype, f.left.device)


class _Indices:
    """Device index tensors by pattern, built once (a host-to-device copy syncs a GPU stream)."""

    def __init__(self):
        self._cache = OrderedDict()

    def get(self, pattern: tuple, device) -> torch.Tensor:
        key = (pattern, device)
        found = self._cache.get(key)
        if found is None:
            found = torch.tensor(pattern, dtype=torch.long).to(device)
            self._cache[key] = found
            if len(self._cache) > _INDEX_PATTERNS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return found


_INDICES = _Indices()


def _gram_batch(factors, rows) -> list[Reduced]:
    """Weights (OuterProduct) and biases (SummedTokens) of one (B, T, device, dtype): see the module doc."""
    first = next(f for f in factors if isinstance(f, OuterProduct))
    B, T, _ = first.left.shape
    dt = acc_dtype(first.left, first.right)
    # Distinct tensors (as the Gram reads them), grouped by width and operand dtype for stacking.
    position = {}
    widths = {}
    read_as = {}  # id(tensor) -> the key of its Gram, for the biases that read a weight's output grad

    def slot(x, cast):
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, cast)
        if key not in position:
            operand = x if cast is None else x.to(cast)
            members = widths.setdefault((operand.shape[-1], operand.dtype), [])
            position[key] = (operand.shape[-1], operand.dtype), len(members)
            members.append(operand)
        read_as[id(x)] = key
        return key

    # All left sides first, then all right sides: k layers' sides then lie at equal steps (views in pick).
    outer = [(r, f) for r, f in zip(rows, factors) if isinstance(f, OuterProduct)]
    lefts = [slot(f.left, f.operand_dtype) for _, f in outer]
    weights = [(r, left, slot(f.right, f.operand_dtype)) for (r, f), left in zip(outer, lefts)]
    biases = []
    for r, f in zip(rows, factors):
        if isinstance(f, SummedTokens):
            biases.append((r, read_as[id(f.tokens)]))  # its weight's output grad (_partition), as the weight cast it
    # One Gram per distinct tensor, one batched matmul per width and stack: parts of (U, B, T, T) in group order.
    offsets, parts, start = {}, [], 0
    budget = stack_budget(first.left.device)
    for group, members in widths.items():
        offsets[group] = start
        for run in within_budget(members, [m.numel() for m in members], budget):
            x = run[0].unsqueeze(0) if len(run) == 1 else torch.stack(run)
            x = x.reshape(len(run) * B, T, group[0])
            parts.append(GramPart(start, gram(x, dt).view(len(run), B, T, T)))
            start += len(run)
    index = {key: offsets[group] + k for key, (group, k) in position.items()}
    return gram_products(parts, [(r, index[left], index[right]) for r, left, right in weights],
                          [(r, index[key]) for r, key in biases], T, dt)


def gram_products(parts, weights, biases, T: int, dt) -> list[Reduced]:
    """The norms and squared token masses of ``weights`` [(row, left Gram, right Gram)] and ``biases``
    [(row, tokens' Gram)], the Grams given as indices into the rows of ``parts`` (GramPart, in order):
    |g|^2 = <L L^T, R R^T> and tr(L L^T) tr(R R^T) for a weight, the Gram's sum and T tr(G G^T) for a bias,
    each a few reductions for all."""
    whole = {}  # the parts concatenated, only for a pattern that no view of one part gives

    def pick(pattern, traces: bool):
        """The Grams (U', B, T, T) or their traces |X_i|_F^2 (U', B) at ``pattern``, in its order: a view of
        one part where they are evenly spaced in it (no kernel), else indexed from all parts."""
        pattern = tuple(pattern)
        view = spaced_view(parts, pattern, traces)
        if view is not None:
            return view
        if traces not in whole:
            whole[traces] = torch.cat([p.trace() if traces else p.gram for p in parts])
        return whole[traces].index_select(0, _INDICES.get(pattern, parts[0].gram.device))

    out = []
    if weights:
        left, right = [w[1] for w in weights], [w[2] for w in weights]
        sq = (pick(left, False) * pick(right, False)).sum((2, 3))  # vecdot over (T, T), without two flattening views
        squared_mass = pick(left, True) * pick(right, True)  # tr(L L^T) tr(R R^T)
        out.append(Reduced([w[0] for w in weights], sq, squared_mass, dt, rooted=False))
    if biases:
        tokens = [b[1] for b in biases]
        sq = pick(tokens, False).sum((2, 3))
        out.append(Reduced([b[0] for b in biases], sq, pick(tokens, True) * float(T), dt, rooted=False))  # T tr(G G^T)
    return out


def stacked(tensors):
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


class GramPart:
    """The Grams of one batched matmul, (n, B, T, T), rows ``start`` to ``start + n`` of the batch's Grams."""

    def __init__(self, start: int, gram: torch.Tensor):
        self.start, self.gram, self._traces = start, gram, None

    def trace(self) -> torch.Tensor:  # (n, B): tr(X_i X_i^T) = |X_i|_F^2, formed once
        if self._traces is None:
            self._traces = gram_trace(self.gram)
        return self._traces


def spaced_view(parts, pattern: tuple, traces: bool):
    """Rows ``pattern`` of the Grams (or traces) as a view of one part, if they lie in one part at equal
    steps forward (strided) or are one row repeated (expanded: an input shared by several layers); else None."""
    first, k = pattern[0], len(pattern)
    step = pattern[1] - first if k > 1 else 1
    if step < 0 or pattern != (tuple(range(first, first + step * k, step)) if step else (first,) * k):
        return None
    for part in parts:
        if part.start <= first and pattern[-1] < part.start + part.gram.shape[0]:
            rows = part.trace() if traces else part.gram
            lo = first - part.start
            if step == 0:
                return rows[lo:lo + 1].expand(k, *rows.shape[1:])
            return rows if (lo, step, k) == (0, 1, rows.shape[0]) else rows[lo:lo + step * (k - 1) + 1:step]
    return None


def _layer_norm_batch(factors, rows, deferred=None, groups=None) -> list[Reduced]:
    """LayerNorm weights and biases of calls of one batch key: their gradients formed in stacked expressions
    (normalization.form_layer_norms) of at most one stack budget of calls each, then k dot products per
    example per parameter name; a call formed alone leaves its gradients to ``deferred`` (a DeferredGrams),
    with ``groups`` (the clipping group of each row), where given."""
    calls = list({id(f.call): f.call for f in factors}.values())
    budget = stack_budget(calls[0].device)
    out = []
    for run in within_budget(calls, [c.x.numel() + c.G.numel() for c in calls], budget):
        slot = {id(c): k for k, c in enumerate(run)}
        alone = deferred is not None and len(run) == 1  # its masses are scaled with the others DeferredGrams holds
        for name, (grads, mass) in form_layer_norms(run, scale_masses=not alone).items():
            named = [(r, slot[id(f.call)]) for r, f in zip(rows, factors) if f.name == name and id(f.call) in slot]
            if not named:
                continue
            g = grads if grads.dim() == 3 else grads.reshape(len(run), grads.shape[1], -1)
            if alone:  # (1, B, n) gradients and (1, B) masses: one row each
                deferred.take_explicit(groups[named[0][0]], g, mass, run[0].mass_scale)
                continue
            sq = torch.linalg.vecdot(g, g)
            picked = [k for _, k in named]
            if picked != list(range(len(run))):  # not every call's factor of this name is queued here
                sq, mass = sq[picked], None if mass is None else mass[picked]
            out.append(Reduced([r for r, _ in named], sq, mass, grads.dtype if mass is not None else None))
    return out


def _product_batch(factors, rows) -> list[Reduced]:
    """Weights of one shape on the instantiation path (_product_key): their sides stacked in runs of at most a
    stack budget (and of ELEMENT_BUDGET explicit gradients), one batched matmul L_i^T R_i per run, then k dot
    products per example; token masses |L_i|_F |R_i|_F (OuterProduct.token_mass) from the same stacks."""
    first = factors[0]
    B, T, m = first.left.shape
    n = first.right.shape[-1]
    dt = acc_dtype(first.left, first.right)
    budget = min(stack_budget(first.left.device), ELEMENT_BUDGET)
    sizes = [max(f.left.numel() + f.right.numel(), B * m * n) for f in factors]
    out = []
    for run in within_budget(range(len(factors)), sizes, budget):
        k = len(run)
        left = stacked([factors[j].left for j in run])    # (k, B, T, m)
        right = stacked([factors[j].right for j in run])  # (k, B, T, n)
        grads = wide_matmul(left.reshape(k * B, T, m).transpose(1, 2), right.reshape(k * B, T, n), dt)
        grads = grads.view(k, B, m * n)
        mass = (torch.linalg.vector_norm(left, dim=(2, 3), dtype=dt)
                * torch.linalg.vector_norm(right, dim=(2, 3), dtype=dt))
        out.append(Reduced([rows[j] for j in run], torch.linalg.vecdot(grads, grads), mass, dt))
    return out


def _instantiated_batch(factors, rows) -> Reduced:
    """Explicit per-example gradients of one shape: (k, B, n) stacked, k dot products per example."""
    grads = stacked([f.grads for f in factors])
    dt = acc_dtype(grads)
    g = grads.reshape(len(factors), grads.shape[1], -1).to(dt)
    sq = torch.linalg.vecdot(g, g)
    if factors[0].mass is None:
        return Reduced(rows, sq, None, None)
    return Reduced(rows, sq, stacked([f.mass for f in factors]), dt)
