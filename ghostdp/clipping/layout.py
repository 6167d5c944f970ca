"""Which dimension of a layer's output holds the examples: proven from gradients, never guessed from sizes.

A norm rule needs example i's rows of a layer's output grad G. Sizes alone cannot say where they
are: a sequence-first (T, B, d) output with T == B looks batch-first, and a (B*T, d) output (OPT's
decoder flattens its tokens) has no dim of size B at all. So the layout is proven.

Proof. Backpropagate the per-example losses once with cotangent v (a (B,) vector) instead of ones.
Backward is linear in its cotangent, so G_v = sum_j v_j G^(j), where G^(j) is loss j's output grad.
If a candidate layout is right, each example e's rows hold its gradient only, so
G_v[rows of e] = v_e G_1[rows of e]. If a row also holds example j's gradient, the difference
(v_j - v_e) G^(j)[r] is not zero. Each v_e is a power of two with a random sign, spread over
2^-SPREAD .. 2^SPREAD: scaling by a power of two is exact in floating point (bf16, TF32 and float16
as well), so a layer that keeps examples apart gives the same bits in both passes, up to the order
of non-deterministic GPU reductions; and a leak from j into e shows amplified by |v_j / v_e| (up to
2^(2 SPREAD)), so the allowance for reduction order (TOLERANCE) can be generous. Both sides are
compared per example (l2 over its rows) after projecting the feature dim onto a random vector w.
The proof runs when a layer's shape signature (which dims equal B) is new, and its result is kept
for that signature; every layer is proven again when the step's graph signature (audit.py) is new, and at
norm passes 1, 2, 4, ... (REPROOF_EVERY): a proof also depends on the values it ran on.
"""
from __future__ import annotations

import contextlib

import torch

from ..norms.factors import acc_dtype
from ..norms.registry import ROWS
from .repeated import repeated_by_its_caller

# Per example, |G_v - v_e G_1| <= TOLERANCE * |v_e G_1| (l2 over the example's rows). With power-of-two
# cotangents only the order of non-deterministic GPU reductions (atomics in attention backward, split-K)
# separates the two passes: measured up to 0.22 of an example's norm in bf16 (BERT-base, T=512, H100),
# 0 on CPU and at T=128. A wrong layout mixes every example into each row: the example of smallest |v|
# (2^-SPREAD) then shows a ratio of the order of 2^(2 SPREAD), and a leak of a fraction l from the example
# of largest |v| shows as l * 2^(2 SPREAD): refused from l of about 2.4e-4 in 16/32-bit, 2.4e-8 in float64.
# A float32 grad may come from bf16 ops upstream (autocast), so float32 gets the 16-bit allowance.
TOLERANCE = {torch.float64: 1e-4}  # float64 models may compute parts in float32 (Llama RMSNorm)
TOLERANCE_OTHER = 1.0
SPREAD = 6

PROVEN_GRAPHS = 16  # graph forms whose layouts a LayoutProver keeps (select)
# A proof covers the values it ran on as well as the graph: an in-batch term weighted 0 on the proof's step (a
# warm-up schedule), or silenced by a mask or a ReLU there, mixes examples later with the same graph signature.
# So every layout is proven again at norm passes 1, 2, 4, ..., REPROOF_EVERY and every REPROOF_EVERY-th after
# (LayoutProver.proof_due): one more backward on those steps, under 1% of the time after the first few hundred.
REPROOF_EVERY = 256

BATCH_FIRST = ("dim", 0)
ROWS_LAYOUT = ("rows",)  # each example's rows together on dim 0: a batch flattened into it, (B * T, ...)
# Views of the batch stacked on dim 0, row r of example r mod B: a model's torch.cat([x, x_2]) or x.repeat(2, ...) (two
# dropout masks or two augmentations of each example in one call, as R-Drop takes), or a sequence-first batch
# flattened, (T * B, ...). Only for a call with a rule: a module without one is split by example on a dim or in rows
# (norms/fallback.py).
TILED_LAYOUT = ("tiled",)
_ONE_BATCH_FIRST = (BATCH_FIRST,)
_ON_DIM_0 = (BATCH_FIRST, ROWS_LAYOUT, TILED_LAYOUT)


def signature(shapes, batch_size: int) -> tuple:
    """Which dims of each output equal the batch size, and whether the first is a multiple of it."""
    return tuple((tuple(n == batch_size for n in s), len(s) > 0 and s[0] > batch_size and s[0] % batch_size == 0)
                 for s in shapes)


def flattened_batch(shape, batch_size: int) -> bool:
    """Whether dim 0 of a tensor of ``shape`` could hold the rows of a batch flattened into it, (B * T, ...), T > 1."""
    return len(shape) > 1 and shape[0] > batch_size and shape[0] % batch_size == 0


def candidates(shape, batch_size: int, tokenwise, declared_dim: int, fallback: bool = False):
    """Layouts to try, most usual first. ``tokenwise`` layers (Linear, Embedding, LayerNorm) act on each
    leading position alone, so any leading dim or a flattened batch may hold the examples; ``tokenwise`` ROWS (an
    elementwise use whose parameter differs along later dims but not along dim 0: Swin v2's logit scale per head)
    dim 0 or a batch flattened into dim 0 (a window batch), which leave the parameter's dims where they are; other
    layers only their declared batch dim. A module without a rule (``fallback``) declared batch-first (tokenwise ROWS)
    may also hold them on any later dim but the last (its features, which the proof projects away): the fallback
    splits each output grad by example on the proven dim (norms/fallback.py), so a sequence-first call, (T, B, d),
    is exact (until 2026-12-02 refused: peft's DoRA on a Linear of a (T, B, d) input). A call with a rule may also
    hold views of the batch stacked on dim 0 (TILED_LAYOUT: until 2026-12-07 refused, a model's torch.cat([x, x]))."""
    stacked = flattened_batch(shape, batch_size)
    if tokenwise == ROWS:
        out = [BATCH_FIRST] if shape and shape[0] == batch_size else []
        out += [ROWS_LAYOUT] + ([] if fallback else [TILED_LAYOUT]) if stacked else []
        return out + ([("dim", d) for d in range(1, len(shape) - 1) if shape[d] == batch_size] if fallback else [])
    if not tokenwise:
        return [("dim", declared_dim)] if len(shape) > declared_dim and shape[declared_dim] == batch_size else []
    out = [("dim", d) for d in range(len(shape) - 1) if shape[d] == batch_size]
    if stacked:
        at = 1 if out[:1] == [BATCH_FIRST] else 0
        out[at:at] = [ROWS_LAYOUT] if fallback else [ROWS_LAYOUT, TILED_LAYOUT]
    return out


def projection_vector(n: int, dtype, device, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def project(grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """G's feature dim (the last) projected onto w, in w's dtype: a tensor of shape G.shape[:-1]. A G of one
    dim or none has no feature dim (a (B,) output: one number per example): it is scaled by w[0] as it is."""
    if grad.dim() <= 1:
        return grad.reshape(-1).to(w.dtype) * w[0]
    return torch.matmul(grad.to(w.dtype), w)


def per_example(layout, projected: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A projected output (shape G.shape[:-1]) as (B, rows of each example), per the layout."""
    if layout[0] == "rows":
        return projected.reshape(batch_size, -1)
    if layout[0] == "tiled":
        return _untiled(projected, batch_size).reshape(batch_size, -1)
    return projected.movedim(layout[1], 0).reshape(batch_size, -1)


def _untiled(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A tensor of TILED_LAYOUT, (k * B, ...), as (B, k, ...): example e's rows e, e + B, ... together (a view)."""
    return tensor.reshape(tensor.shape[0] // batch_size, batch_size, *tensor.shape[1:]).transpose(0, 1)


def holds(layout, projected_v: torch.Tensor, projected_1: torch.Tensor, v: torch.Tensor, dtype) -> bool:
    got = per_example(layout, projected_v, v.shape[0])
    expected = v[:, None] * per_example(layout, projected_1, v.shape[0])
    finite = torch.isfinite(expected) & torch.isfinite(got)  # NaN/inf examples are refused later
    got, expected = torch.where(finite, got, 0), torch.where(finite, expected, 0)
    residual = (got - expected).norm(dim=1)
    signal = expected.norm(dim=1)
    # For an example whose rows are zero in one pass and a reordered cancellation in the other: a floor
    # of 1e-3 of the largest example's unscaled norm, scaled by the example's own |v_e|.
    floor = 1e-3 * (signal / v.abs()).max() * v.abs()
    return bool((residual <= TOLERANCE.get(dtype, TOLERANCE_OTHER) * signal + floor).all())


def to_batch_first(layout, tensor: torch.Tensor, output_shape, batch_size: int) -> torch.Tensor:
    """A tensor laid out like the output (an input of a tokenwise layer, or its output grad), made (B, ...)."""
    if layout == BATCH_FIRST:
        return tensor
    if layout[0] in ("rows", "tiled"):
        if tensor.dim() == 0 or tensor.shape[0] != output_shape[0]:
            return tensor
        if layout[0] == "tiled":
            return _untiled(tensor, batch_size)
        return tensor.reshape(batch_size, tensor.shape[0] // batch_size, *tensor.shape[1:])
    d = layout[1]
    if tensor.dim() <= d or tuple(tensor.shape[:d + 1]) != tuple(output_shape[:d + 1]):
        return tensor
    return tensor.movedim(d, 0)


class GraphLayouts:
    """The layouts proven on one form of the step's graph (a graph signature: audit.py). A layer's layout is
    a fact about the graph it was proven on: one module with the same shapes may hold its examples on another
    dim in another form (an input transposed on some steps, with T == B)."""

    __slots__ = ("proven", "by_shapes", "regions", "complete")

    def __init__(self):
        self.proven = {}        # (module id, shape signature) -> layout of each output
        self.by_shapes = {}     # (module id, exact shapes, B) -> the same, found without a signature
        self.regions = {}       # a reentrant region's graph signature -> the GraphLayouts of its calls in this form
        self.complete = False   # a pass on this form ended with every call's layout proven

    def region(self, graph: tuple) -> "GraphLayouts":
        """The layouts of a reentrant region's calls whose recomputed graph has the signature ``graph``, new and
        empty for a form of the region not seen before (the last PROVEN_GRAPHS are kept)."""
        return _most_recent(self.regions, graph)


def _most_recent(forms: dict, graph: tuple) -> GraphLayouts:
    """``forms[graph]``, made if missing, moved to the end; the oldest dropped beyond PROVEN_GRAPHS."""
    known = forms.pop(graph, None)
    forms[graph] = known = GraphLayouts() if known is None else known
    if len(forms) > PROVEN_GRAPHS:
        del forms[next(iter(forms))]
    return known


def proof_scheduled(n: int, every: int = REPROOF_EVERY) -> bool:
    """Whether norm pass n (from 0) proves every layout again: n = 1, 2, 4, ..., ``every``, then every ``every``-th
    (never with ``every`` 0)."""
    return every > 0 and n > 0 and (n & (n - 1) == 0 and n <= every or n % every == 0)


class LayoutProver:
    """The proven layouts of a controller's module calls, and the proof of new ones.

    Per step: ``select`` picks the layouts proven on the step's graph form (GraphLayouts), ``assign`` gives
    every recorded call its layouts from those, and returns the calls whose shape signature is new. For those, the controller runs one backward with the
    cotangent ``cotangent(losses)``, during which ``project`` keeps each output grad's projection;
    pass 1 then calls ``resolve`` with the ordinary output grads.
    """

    def __init__(self):
        self.graphs = {}      # graph signature (audit.py) -> its GraphLayouts, the most recent last
        self.current = GraphLayouts()  # those of the graph of the running pass (select)
        self.generator = torch.Generator().manual_seed(0x6a05)  # never the global RNG (dropout)
        self.v = None
        self.passes = 0       # norm passes begun (proof_due)
        self.reproof_every = REPROOF_EVERY  # 0: only new graph forms and shapes are proven (tests of that logic)

    @contextlib.contextmanager
    def proving_every_pass(self):
        """Inside, every norm pass proves the layouts: the physical batch search's probes measure the memory of a
        step with a proof, which a schedule (REPROOF_EVERY) runs during training too."""
        every, self.reproof_every = self.reproof_every, 1
        try:
            yield
        finally:
            self.reproof_every = every

    def proof_due(self) -> bool:
        """Counts a norm pass; whether it proves every layout again, its graph form proven or not (REPROOF_EVERY).
        Before 2026-11-25 a proof held for its graph form for good: a contrastive term weighted 0 at the first
        step and 1 from the second mixed examples unchecked."""
        n, self.passes = self.passes, self.passes + 1
        return proof_scheduled(n, self.reproof_every)

    def assign(self, calls, batch_size: int, everything: bool = False, within: GraphLayouts | None = None) -> list:
        """Each call's proven layouts, where its shapes have some; the calls left to prove (all of them
        with ``everything``: the proof must run again, the loss above the calls having changed). ``within``:
        the layouts the calls are proven in (a reentrant region's form), else the current graph form's."""
        unproven = []
        known = self.current if within is None else within
        for call in calls:
            call.layouts, call.proven_in = None, known
            if not everything:
                shapes_key = (id(call.module), tuple(call.shapes), batch_size)
                call.layouts = known.by_shapes.get(shapes_key)
                if call.layouts is None:
                    call.layouts = known.proven.get((id(call.module), signature(call.shapes, batch_size)))
                    if call.layouts is not None:
                        known.by_shapes[shapes_key] = call.layouts
            if call.layouts is None:
                call.projections = [None] * len(call.shapes)
                unproven.append(call)
        return unproven

    def select(self, graph: tuple) -> GraphLayouts:
        """Makes the layouts proven on ``graph`` (a signature: audit.py) the current ones, new and empty for a form
        not seen before. A proof covers the graph it ran on: a form that mixes examples on some steps only (a
        batch mean, a mixup, a contrastive loss) has another signature, so its calls are proven again. The last
        PROVEN_GRAPHS forms are kept: a model whose graph takes a few (a layer dropped on some steps) proves
        each once."""
        self.current = _most_recent(self.graphs, graph)
        return self.current

    def cotangent(self, losses: torch.Tensor) -> torch.Tensor:
        """±2^k per example, the exponents spread evenly over [-SPREAD, SPREAD] in a random order."""
        n = losses.shape[0]
        exponents = torch.linspace(-SPREAD, SPREAD, n, dtype=torch.float64).round()
        exponents = exponents[torch.randperm(n, generator=self.generator)]
        signs = torch.randint(0, 2, (n,), generator=self.generator, dtype=torch.float64) * 2 - 1
        self.v = signs * torch.pow(2.0, exponents)
        return self.v.to(losses)

    def project(self, grad: torch.Tensor):
        w = projection_vector(grad.shape[-1] if grad.dim() > 1 else 1, acc_dtype(grad), grad.device, self.generator)
        return w, project(grad, w)

    def first_holding(self, options, projected, g: torch.Tensor):
        """The first of the layouts ``options`` that keeps the examples apart: ``projected`` = (w, G_v projected
        onto w) from the proof's backward (``project``), ``g`` = G_1 from the ordinary one; None if none does."""
        w, projected_v = projected
        v = self.v.to(device=w.device, dtype=w.dtype)
        projected_1 = project(g, w)
        return next((c for c in options if holds(c, projected_v, projected_1, v, g.dtype)), None)

    def resolve(self, call, batch_size: int) -> None:
        """call.grads hold G_1: keep the first candidate layout per output that the proof confirms."""
        found = []
        for slot, (g, projected) in enumerate(zip(call.grads, call.projections)):
            if g is None or projected is None:
                found.append(("dim", call.batch_dims[slot]))
                continue
            options = candidates(tuple(g.shape), batch_size, call.tokenwise, call.batch_dims[slot],
                                 fallback=call.rule is None)
            broadcast = call.expanded[slot]  # size 1 on dim 0, broadcast to the batch there (recording.py)
            if broadcast:  # to dim 0 of the model's first tensor argument: the batch, or views of it stacked
                options = [c for c in options if c in _ON_DIM_0]
            chosen = self.first_holding(options, projected, g)
            if chosen is None:
                refuse(call, g, batch_size, options, broadcast, call.batch_dims[slot])
            found.append(chosen)
        call.layouts, call.projections = tuple(found), None
        call.proven_in.proven[(id(call.module), signature(call.shapes, batch_size))] = call.layouts

    @staticmethod
    def batch_first(call, batch_size: int) -> None:
        """The call's inputs and output grads with the examples on dim 0, per its proven layout."""
        if call.layouts is None:
            raise RuntimeError(f"internal error: the call of module '{call.name}' was not audited this step")
        if call.layouts == _ONE_BATCH_FIRST and call.rule is not None:  # the common case, in one check
            g = call.grads[0]
            if g is not None and g.dim() > 0 and g.shape[0] == batch_size:
                return
        for slot, (g, d) in enumerate(zip(call.grads, call.batch_dims)):
            if g is not None and call.layouts[slot] == ("dim", d) and (g.dim() <= d or g.shape[d] != batch_size):
                raise RuntimeError(
                    f"module '{call.name}' ({type(call.module).__name__}) produced an output of shape "
                    f"{tuple(g.shape)} whose batch dimension {d} does not match the {batch_size} per-example "
                    "losses. Fix: call the model itself (not a submodule) so ghostdp sees the batch size, or "
                    "register a norm rule for this module.")
        if call.rule is None or call.layouts[0] == BATCH_FIRST:
            return
        shape = tuple(call.grads[0].shape)
        call.inputs = tuple(to_batch_first(call.layouts[0], x, shape, batch_size) for x in call.inputs)
        call.grads = [to_batch_first(call.layouts[0], call.grads[0], shape, batch_size)]


def refuse(call, g, batch_size, options, broadcast=False, declared=0):
    if broadcast and repeated_by_its_caller(call):  # captured at the model's repeat (repeated.py)
        raise RuntimeError(
            f"module '{call.name}' ({type(call.module).__name__}, the prompt of peft's prompt tuning or p-tuning) "
            "produced an "
            f"output of shape (1, {', '.join(map(str, g.shape[1:]))}) shared by the batch, which the model repeated "
            f"to the batch of {batch_size} examples, and the rows of that repeat do not each hold one example's "
            "gradient: the model mixes the examples after it (a mean or another statistic over the batch), so no "
            "example's gradient of the prompt is its own. Fix: keep each example's computation apart after the "
            "prompt (statistics per example, not over the batch).")
    if broadcast:
        raise RuntimeError(
            f"module '{call.name}' ({type(call.module).__name__}) produced an output of shape (1, "
            f"{', '.join(map(str, g.shape[1:]))}) in a batch of {batch_size} examples. ghostdp takes such an output "
            "for one shared by the whole batch (a position embedding looked up once) and broadcasts it to the batch "
            "on dim 0, but the examples do not lie there: the layer runs sequence-first on a sequence of length 1 "
            "(or its dim 0 is otherwise not shared by the examples), and the broadcast changes what the model "
            "computes (a sum over that dim counts each example's value once per example). The batch size it "
            "broadcast to is dim 0 of the model's first tensor argument: in a sequence-first model given one "
            "example, the sequence length (a Poisson-sampled batch can hold one example). Fix: run the layer "
            "batch-first (batch_first=True, or transpose its input to (batch, sequence, ...)).")
    elsewhere = [d for d in range(g.dim()) if d != declared and g.shape[d] == batch_size]
    if not options and call.rule is None and call.tokenwise == ROWS and elsewhere:
        # Any dim but the last may hold a batch-first fallback's examples (candidates): here only the last does.
        problem = (f"has the batch's size only on its last dim ({elsewhere[-1]}), which ghostdp takes for the "
                   "output's features (the layout proof projects it away); put the examples on an earlier dim "
                   "(transpose its output to (..., batch, ..., features) and back after it)")
    elif not options and call.tokenwise is not True and elsewhere:
        # An RNN's or an attention's fallback, or a rule not tokenwise, is split by example on its declared dim only.
        problem = (f"has the batch's size on dim {elsewhere[0]}, not on dim {declared}, the one where ghostdp splits a "
                   f"{'module without a norm rule' if call.rule is None else 'call of this rule'} by example (an "
                   "RNN's and an attention's batch dim by batch_first, a rule's by the layer it is for); run it "
                   "batch-first (transpose its input to (batch, ...) and its output back)")
    elif not options:
        problem = f"has no dimension of size {batch_size} that could hold the examples"
    else:
        problem = "mixes several examples in each of its candidate batch dimensions"
    raise RuntimeError(
        f"module '{call.name}' ({type(call.module).__name__}) produced an output of shape {tuple(g.shape)} whose "
        f"gradient {problem} (there are {batch_size} per-example losses), so ghostdp cannot bound each example's "
        "gradient. ghostdp proves from gradients which dim holds the examples, instead of guessing from sizes. "
        "Fixes: use batch-first layers (nn.TransformerEncoderLayer(..., batch_first=True), "
        "nn.MultiheadAttention(..., batch_first=True)); call the model itself (not a submodule) so that "
        "the batch is known; freeze parameters shared by the whole batch (requires_grad_(False): a table looked up "
        "once for all examples, as MPNet's relative_attention_bias is, which ghostdp.validate.fix(model) looks up per "
        "example instead; the rest of such a model then trains exactly); or register a norm rule for this module."
        + (BAGS_PER_EXAMPLE if isinstance(call.module, torch.nn.EmbeddingBag) else ""))


BAGS_PER_EXAMPLE = (" For nn.EmbeddingBag, whose output has a row per bag: give each example one bag (a 2-D input, "
                    "one row an example, or offsets that start one bag per example), or freeze the table.")
