"""The plan floor: book-keeping's arithmetic with every per-call decision made once, and nothing else.

The GPU-speed issue's stand-in (profiling.overhead) finds a private step host-bound: Python spread over
~85 calls per hooked layer, not ATen ops (in the batched stand-in book-keeping dispatches fewer ops than
plain). A per-call plan, which decides the layout of the norms and clipped sums once and replays it while
the calls repeat, is the proposed cure; this step measures how far such a plan could go at best. It:

- records (module, input, output) of every trained Linear and LayerNorm in a forward hook (a list append);
- takes every output grad G with one autograd.grad of the per-example losses;
- groups the layers by kind and shape on the first step (the plan), then per group: stacks A and G, forms
  the Grams A A^T and G G^T, the squared norms <A A^T, G G^T> (weight) and the Gram's sum (bias), the token
  masses tr(A A^T) tr(G G^T); a LayerNorm group forms xhat, G * xhat, its per-example sums and their masses;
- clips (c_i = min(1, C / |g_i|)), writes (c ⊙ G)^T A and the biases' and LayerNorms' clipped sums into
  p.grad, adds ghostdp's noise (RandomSource.add_gaussian_) and steps SGD.

It runs no audit, no capture, no layout proof, no precision guard, no finiteness or batch checks: it is not
a private training step, only a bound on what removing per-call Python could save. It covers models whose
trained modules are Linear and LayerNorm (the BERT stand-in with frozen embeddings); ``supports`` says so.
Its clipped sums equal ghostdp book-keeping's (tests/test_profiling.py, float64, without noise).

``capture="graph"`` ("graph floor"): the same step with no forward hook at all. The layers are found in the
loss's autograd graph, in one walk (the walk the step's graph audit makes anyway): a Linear as the addmm or mm
node whose weight edge leads through a transpose to a trained weight's accumulator, its input A the tensor
that node saved; a LayerNorm as the native_layer_norm node, its input the one it saved. G is taken at those
nodes' output edges. It measures what capturing from the graph instead of hooks could save (the hooks' ~40
us a call in ghostdp); its clipped sums equal book-keeping's too (a test).
"""
from __future__ import annotations

PLAN_FLOOR = "plan floor"
GRAPH_FLOOR = "graph floor"


def trained_modules(model) -> list:
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def supports(model) -> bool:
    """Whether every module with a trainable parameter is a Linear or a LayerNorm (the floor's two rules)."""
    import torch
    return all(isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)) for m in trained_modules(model))


def layers_in_graph(root, owners: dict) -> list:
    """(module, input, gradient edge of its output) of every trained Linear and LayerNorm call in the autograd
    graph below ``root`` (one walk; ``owners``: id(trained weight) -> its module), in the walk's order (the
    same for the same graph). A Linear's input is the (N, d) matrix its addmm or mm saved."""
    from torch.autograd.graph import GradientEdge
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        below = node.next_functions
        kind = type(node).__name__
        if kind in ("AddmmBackward0", "MmBackward0"):
            weight = below[-1][0]  # mat2: the weight's transpose
            if weight is not None and type(weight).__name__ == "TBackward0":
                module = owners.get(id(getattr(weight.next_functions[0][0], "variable", None)))
                if module is not None:
                    saved = node._saved_mat1 if kind == "AddmmBackward0" else node._saved_self
                    found.append((module, saved, GradientEdge(node, 0)))
        elif kind == "NativeLayerNormBackward0":
            module = owners.get(id(getattr(below[1][0], "variable", None)))
            if module is not None:
                found.append((module, node._saved_input, GradientEdge(node, 0)))
        stack.extend(n for n, _ in below if n is not None and n not in seen)
    return found


def make_plan_floor_step(model, batch, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0,
                         stacked: bool = True, capture: str = "hooks"):
    """A closure running one plan-floor step on ``batch`` (ids, labels) (see the module doc). ``stacked``
    False: no layer's A or G is stacked with another's (profiling.overhead --per-layer, the GPU's budgets at
    BERT-base): each layer forms its Grams (a shared input's once) and its clipped sum alone, and only the
    small results (Grams, LayerNorms' (B, d) gradients) are stacked across the layers of a group. ``capture``:
    "hooks" (forward hooks) or "graph" (found in the loss's graph: layers_in_graph)."""
    import torch
    import torch.nn.functional as F

    from ghostdp.randomness import RandomSource
    if not supports(model):
        raise ValueError("the plan floor covers models whose trained modules are Linear and LayerNorm only "
                         "(freeze the embeddings)")
    if capture not in ("hooks", "graph"):
        raise ValueError(f"capture must be 'hooks' or 'graph', got {capture!r}")
    if capture == "graph" and not all(m.weight.requires_grad for m in trained_modules(model)):
        raise ValueError("the graph floor finds a layer by its trained weight: train every trained layer's weight")
    ids, labels = batch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    noise = RandomSource(seed=0)
    recorded = []  # (module, input, output or its gradient edge) of this forward
    owners = {id(m.weight): m for m in trained_modules(model)}
    for module in trained_modules(model) if capture == "hooks" else ():
        module.register_forward_hook(lambda m, args, output: recorded.append((m, args[0], output)))
    plan = {}  # (kind, input shape, output shape) -> positions in ``recorded``, decided on the first step

    def tokens(x):  # (B, T, d): a 2-D input is one token
        return x.unsqueeze(1) if x.dim() == 2 else x

    def gram(x):
        return torch.bmm(x, x.transpose(1, 2))

    def layer_norm_norms(positions, grads):
        """Per-example gradients (k, B, d) of the weights and biases, squared norms and masses (k, B)."""
        first = recorded[positions[0]][0]
        if stacked:
            x = torch.stack([tokens(recorded[k][1]) for k in positions])
            G = torch.stack([tokens(grads[k]) for k in positions])
            terms = G * F.layer_norm(x, first.normalized_shape, eps=first.eps)
            weight, bias = terms.sum(2), G.sum(2)
            mass = torch.linalg.vector_norm(terms, dim=(2, 3)) + torch.linalg.vector_norm(G, dim=(2, 3))
        else:
            parts = []
            for k in positions:
                x, G = tokens(recorded[k][1]), tokens(grads[k])
                terms = G * F.layer_norm(x, first.normalized_shape, eps=first.eps)
                parts.append((terms.sum(1), G.sum(1),
                              torch.linalg.vector_norm(terms, dim=(1, 2)) + torch.linalg.vector_norm(G, dim=(1, 2))))
            weight, bias, mass = (torch.stack(column) for column in zip(*parts))
        sq = torch.linalg.vecdot(weight, weight) + torch.linalg.vecdot(bias, bias)
        return sq, mass, (weight, bias)

    def linear_norms(positions, grads, B):
        """|G_i^T A_i|^2 + |sum_t G_t|^2 from the Grams, and the masses tr(G G^T) tr(A A^T), (k, B) each."""
        A = [tokens(recorded[k][1]) for k in positions]
        G = [tokens(grads[k]) for k in positions]
        if stacked:
            n, T = len(A), A[0].shape[1]
            sides = torch.stack(G), torch.stack(A)
            left, right = (gram(x.view(n * B, T, -1)).view(n, B, T, T) for x in sides)
        else:
            inputs = {}  # a shared input's Gram (query, key, value) formed once
            left = torch.stack([gram(g) for g in G])
            right = torch.stack([inputs[id(a)] if id(a) in inputs else inputs.setdefault(id(a), gram(a)) for a in A])
            sides = G, A
        sq = (left * right).sum((2, 3)) + left.sum((2, 3))
        mass = torch.diagonal(left, 0, -2, -1).sum(-1) * torch.diagonal(right, 0, -2, -1).sum(-1)
        return sq, mass, sides

    def write(kind, positions, tensors, c, B):
        modules = [recorded[k][0] for k in positions]
        if kind == "layer_norm":
            weight, bias = (torch.matmul(c, t) for t in tensors)  # (k, d)
            for j, module in enumerate(modules):
                module.weight.grad, module.bias.grad = weight[j], bias[j]
            return
        G, A = tensors
        if stacked:
            n, _, T, d = A.shape
            scaled = G * c.view(1, B, 1, 1)
            weight = torch.bmm(scaled.view(n, B * T, -1).transpose(1, 2), A.view(n, B * T, d))  # (k, p, d)
            bias = scaled.sum((1, 2))
        else:
            scaled = [g * c.view(B, 1, 1) for g in G]
            weight = [torch.mm(s.flatten(0, 1).t(), a.flatten(0, 1)) for s, a in zip(scaled, A)]
            bias = [s.sum((0, 1)) for s in scaled]
        for j, module in enumerate(modules):
            module.weight.grad = weight[j]
            if module.bias is not None and module.bias.requires_grad:
                module.bias.grad = bias[j]

    def step():
        optimizer.zero_grad(set_to_none=True)
        recorded.clear()
        losses = F.cross_entropy(model(input_ids=ids).logits, labels, reduction="none")
        B = losses.shape[0]
        if capture == "graph":
            recorded.extend(layers_in_graph(losses.grad_fn, owners))
        grads = torch.autograd.grad(losses, [r[2] for r in recorded], torch.ones_like(losses))
        if capture == "graph":  # a Linear's (N, d) input and (N, p) output grad as (B, T, d), (B, T, p)
            for k, (module, x, edge) in enumerate(recorded):
                if x.dim() == 2 and x.shape[0] != B:
                    recorded[k] = (module, x.reshape(B, -1, x.shape[-1]), edge)
            grads = [g.reshape(B, -1, g.shape[-1]) if g.dim() == 2 and g.shape[0] != B else g for g in grads]
        if not plan:
            for k, (module, x, _) in enumerate(recorded):
                kind = "layer_norm" if isinstance(module, torch.nn.LayerNorm) else "linear"
                plan.setdefault((kind, tuple(x.shape[1:]), tuple(grads[k].shape[1:])), []).append(k)
        groups = [(kind, positions, *(layer_norm_norms(positions, grads) if kind == "layer_norm"
                                      else linear_norms(positions, grads, B)))
                  for (kind, *_), positions in plan.items()]
        norms = torch.cat([g[2] for g in groups]).sum(0).sqrt()
        torch.cat([g[3] for g in groups]).sum(0)  # the token masses, as the precision guard would read them
        c = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        for kind, positions, _, _, tensors in groups:
            write(kind, positions, tensors, c, B)
        recorded.clear()
        grads = [p.grad for p in params]
        if noise_multiplier > 0:
            noise.add_gaussian_(grads, noise_multiplier * max_grad_norm, float(B))
        else:
            torch._foreach_div_(grads, float(B))
        optimizer.step()
    return step
