"""A mixture of experts' experts (transformers' Mixtral-style experts module), with each example's gradient.

transformers keeps a mixture of experts' experts as two 3-D parameters, ``gate_up_proj`` (E, 2f, d) and
``down_proj`` (E, d, f), in one module called on the batch's tokens flattened, (N = B * T, d), with each token's k
experts ``top_k_index`` (N, k) and routing weights ``top_k_weights`` (N, k). Expert e maps a token x routed to it by
weight w to w * W2[e] act(gate) * up, with [gate; up] = W1[e] x (``_apply_gate``). 55 classes share Mixtral's
eager forward (Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, Jamba, GLM-4-MoE, ...), which transformers' experts dispatcher
replaces by batched forms of the same products ("grouped_mm", its default on CPU, and "batched_mm").

Until 2026-12-02 the module took the exact fallback on its rows (fallback.py), which instantiates B x E x 3 f d
per-example gradients. The rule takes the layer's output grad G (N, d), as the layout proof found the examples' rows,
and forms for every (token, slot) row r routed to expert e: the down projection's output grad g_y = w G[token] and
input h = act(gate) * up, and the up projection's output grad g_z (the gate's VJP of g_y W2[e]) and input x, by
recomputing each expert's up projection (one extra matmul of the routed tokens per expert). Example i's gradient of
expert e is then sum over its rows routed to e of g_r a_r^T, and its squared norm over every expert is
sum_{r, s of example i, same expert} (g_r . g_s)(a_r . a_s): for each expert, the Grams of each example's rows routed
to it (RoutedOuterProduct), about (T k)^2 / E products per example in all. A row whose index is E (no expert: expert
parallelism's sentinel) adds nothing, as in the eager forward. Calls the rule does not know (another gate, biases,
transposed or interleaved weights, a post-expert norm, expert parallelism, a kernel of another library) keep the
fallback (``accepts``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .factors import PerExampleGrad, acc_dtype
from .registry import call_arguments, register_forward_rule

# The eager forward's body of transformers' MixtralExperts (registry.forward_body of the function that
# ``use_experts_implementation`` wraps, registry.dispatched_body) and of its default ``_apply_gate``;
# tests/norms/test_experts.py checks that transformers' Mixtral has them.
EAGER_BODY = (
    'final_hidden_states = torch.zeros_like(hidden_states) ; with torch.no_grad():\n    expert_mask = torch.nn.funct'
    'ional.one_hot(top_k_index, num_classes=self.num_experts + 1)\n    expert_mask = expert_mask.permute(2, 1, 0)\n  '
    '  expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero() ; for expert_idx in expert_hit:\n    e'
    'xpert_idx = expert_idx[0]\n    if expert_idx == self.num_experts:\n        continue\n    top_k_pos, token_idx = t'
    'orch.where(expert_mask[expert_idx])\n    current_state = hidden_states[token_idx]\n    gate, up = nn.functional.'
    'linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)\n    current_hidden_states = self.act_fn('
    'gate) * up\n    current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])\n'
    '    current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]\n    final_hidden_s'
    'tates.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype)) ; return final_hidden_state'
    's')
APPLY_GATE_BODY = 'gate, up = gate_up_out.chunk(2, dim=-1) ; return self.act_fn(gate) * up'

# transformers' experts implementations that compute what the eager forward does (the same products, batched).
SAME_PRODUCTS = (None, "eager", "grouped_mm", "batched_mm")


def accepts(module, args, kwargs) -> bool:
    """Whether the call is the computation the rule knows: gated, concatenated [gate; up] weights as (E, 2f, d)
    and (E, d, f), no biases, no post-expert norm, no expert parallelism, an implementation of the same products,
    and (N, d), (N, k), (N, k) arguments."""
    config = getattr(module, "config", None)
    if (not getattr(module, "has_gate", False) or getattr(module, "has_bias", True)
            or getattr(module, "is_transposed", True) or not getattr(module, "is_concatenated", False)
            or getattr(module, "has_post_expert_norm", True) or getattr(module, "_is_expert_parallel", True)
            or getattr(config, "_experts_implementation", "unknown") not in SAME_PRODUCTS):
        return False
    try:
        call = call_arguments(module, args, kwargs)
    except TypeError:
        return False
    x, index, weights = (call.get(n) for n in ("hidden_states", "top_k_index", "top_k_weights"))
    return (isinstance(x, torch.Tensor) and isinstance(index, torch.Tensor) and isinstance(weights, torch.Tensor)
            and x.dim() == 2 and index.dim() == 2 and weights.shape == index.shape and index.shape[0] == x.shape[0]
            and not index.is_floating_point())


def experts_rule(module, inputs, output_grad, trainable) -> dict:
    """Each example's gradients of ``gate_up_proj`` and ``down_proj`` as RoutedOuterProducts (module doc). The inputs
    and G come with the examples on dim 0 (the proven layout): (B, T, d), (B, T, k), (B, T, k) and (B, T, d); (B, d)
    and (B, k) where each example is one token."""
    x, index, weights = inputs[:3]
    G = output_grad
    if x.dim() == 2:  # one token per example
        x, index, weights, G = (t.unsqueeze(1) for t in (x, index, weights, G))
    B, T, d = x.shape
    k = index.shape[-1]
    experts = module.num_experts
    up_weights, down_weights = module.gate_up_proj, module.down_proj
    routing = Routing(index.reshape(B, T * k), experts)  # the expert of each (token, slot) row
    inputs_of_rows = x.unsqueeze(2).expand(B, T, k, d).reshape(B, T * k, d)
    down_grads = (G.unsqueeze(2) * weights.unsqueeze(-1).to(G.dtype)).reshape(B, T * k, d)  # g_y = w G
    gated = down_weights.new_zeros(B * T * k, down_weights.shape[-1], dtype=G.dtype)  # h per row
    up_grads = up_weights.new_zeros(B * T * k, up_weights.shape[1], dtype=G.dtype)  # g_z per row
    x_rows, g_rows = inputs_of_rows.reshape(-1, d), down_grads.reshape(-1, d)
    for e, chosen in routing.rows_of_experts():
        with torch.enable_grad():  # the gate's VJP, by autograd through the module's own _apply_gate
            z = F.linear(x_rows[chosen], up_weights[e]).detach().requires_grad_(True)
            h = module._apply_gate(z)
            g_z, = torch.autograd.grad(h, z, g_rows[chosen] @ down_weights[e].to(G.dtype))
        gated[chosen], up_grads[chosen] = h.detach().to(G.dtype), g_z
    factors = {}
    if "gate_up_proj" in trainable:
        factors["gate_up_proj"] = RoutedOuterProduct(up_grads.reshape(B, T * k, -1), inputs_of_rows, routing,
                                                     up_weights.shape)
    if "down_proj" in trainable:
        factors["down_proj"] = RoutedOuterProduct(down_grads, gated.reshape(B, T * k, -1), routing,
                                                  down_weights.shape)
    return factors


class Routing:
    """Each (token, slot) row's expert, ``experts`` (B, R) (E: none), and what the rule and its factors read of it,
    formed once per call with one host read: each example's rows in expert order (``by_example``), how many it
    routes to each expert (``per_example``, (B, E + 1)) and where each expert's start there (``starts``); the batch's
    rows in expert order (``by_expert``), and, as Python lists, the rows each expert takes (``totals``) and the most
    any example routes to it (``most``)."""

    def __init__(self, experts: torch.Tensor, num_experts: int):
        self.experts, self.num_experts = experts, num_experts
        routed = experts.clamp(max=num_experts)
        self.per_example = torch.zeros(experts.shape[0], num_experts + 1, dtype=torch.long, device=experts.device)
        self.per_example.scatter_add_(1, routed, torch.ones_like(routed))
        self.starts = self.per_example.cumsum(1) - self.per_example
        self.by_example = experts.argsort(dim=1, stable=True)
        self.by_expert = experts.reshape(-1).argsort(stable=True)
        known = self.per_example[:, :num_experts]
        sizes = torch.cat([known.sum(0), known.amax(0)]).tolist()  # the one host read
        self.totals, self.most = sizes[:num_experts], sizes[num_experts:]

    def rows_of_experts(self):
        """(expert, the indices of the batch's flattened rows routed to it) for each expert that takes rows."""
        start = 0
        for e, n in enumerate(self.totals):
            if n:
                yield e, self.by_expert[start:start + n]
            start += n


class RoutedOuterProduct(PerExampleGrad):
    """g_i[e] = sum over example i's rows r routed to expert e of left_r right_r^T: left (B, R, m), right (B, R, n),
    ``routing`` (Routing) each row's expert, of a parameter (E, m, n)."""

    def __init__(self, left, right, routing: Routing, param_shape):
        self.left, self.right, self.routing = left, right, routing
        self.batch_size = left.shape[0]
        self.param_shape = torch.Size(param_shape)

    def sum_dtype(self):
        return acc_dtype(self.left, self.right)

    def sq_norm(self, grams=None) -> torch.Tensor:
        """sum over experts e of ||sum_{r of example i routed to e} left_r right_r^T||^2 per example, from each
        expert's Grams of its rows by example, (B, n_e, n_e) with n_e the most rows an example routes to e (rows
        padded with zeros): sum over experts of B n_e^2 products, about (T k)^2 / E per example, not (T k)^2."""
        dt = self.sum_dtype()
        B, R = self.routing.experts.shape
        order, counts, starts = self.routing.by_example, self.routing.per_example, self.routing.starts
        left = self.left.gather(1, order.unsqueeze(-1).expand_as(self.left)).to(dt)  # each example's rows by expert
        right = self.right.gather(1, order.unsqueeze(-1).expand_as(self.right)).to(dt)
        total = torch.zeros(B, dtype=dt, device=left.device)
        for e, n in enumerate(self.routing.most):
            if not n:
                continue
            offsets = torch.arange(n, device=order.device)
            rows = (starts[:, e:e + 1] + offsets).clamp(max=R - 1)  # (B, n): example i's rows routed to e
            valid = (offsets < counts[:, e:e + 1]).unsqueeze(-1)
            a = torch.where(valid, left.gather(1, rows.unsqueeze(-1).expand(B, n, left.shape[-1])), 0)
            b = torch.where(valid, right.gather(1, rows.unsqueeze(-1).expand(B, n, right.shape[-1])), 0)
            total += torch.linalg.vecdot(torch.bmm(a, a.transpose(1, 2)).flatten(1),
                                         torch.bmm(b, b.transpose(1, 2)).flatten(1))
        return total

    def token_mass(self, grams=None):
        # sum_r |L_r| |R_r| <= |L|_F |R|_F (Cauchy-Schwarz), as for OuterProduct: a bound on the entrywise sum of the
        # terms, whichever experts they go to.
        if self.left.shape[1] <= 1:
            return None
        dt = self.sum_dtype()
        return (torch.linalg.vector_norm(self.left, dim=(1, 2), dtype=dt)
                * torch.linalg.vector_norm(self.right, dim=(1, 2), dtype=dt))

    def weighted_sum(self, weights):
        """sum_i w_i g_i, (E, m, n): for each expert, one product of the batch's rows routed to it, each row weighted by
        its example's w_i."""
        dt = self.sum_dtype()
        m, n = self.left.shape[-1], self.right.shape[-1]
        left = (self.left.to(dt) * weights.to(dt)[:, None, None]).reshape(-1, m)
        right = self.right.to(dt).reshape(-1, n)
        out = left.new_zeros(self.routing.num_experts, m, n)
        for e, chosen in self.routing.rows_of_experts():
            out[e] = left[chosen].t() @ right[chosen]
        return out

    def materialize(self, lo, hi):
        dt = self.sum_dtype()
        out = []
        for e in range(self.routing.num_experts):
            routed = (self.routing.experts[lo:hi] == e).unsqueeze(-1)
            out.append(torch.bmm(torch.where(routed, self.left[lo:hi].to(dt), 0).transpose(1, 2),
                                 self.right[lo:hi].to(dt)))
        return torch.stack(out, 1)

    def held_bytes(self):
        return sum(t.numel() * t.element_size() for t in (self.left, self.right, self.routing.experts))

    def note_kept(self, kept) -> None:
        kept.note(self.left, self.right, self.routing.experts)


register_forward_rule(EAGER_BODY, experts_rule, params=("gate_up_proj", "down_proj"), tokenwise=True,
                      methods={"_apply_gate": APPLY_GATE_BODY}, accepts=accepts)
