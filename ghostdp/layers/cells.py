"""The step arithmetic of LSTM, GRU and Elman RNN cells: a forward recurrence without autograd, and
back-propagation through time by hand.

Shapes are time-major and sorted as in a PackedSequence: step t updates the first ``sizes[t]`` rows
(the sequences still running), the others keep their state. ``x`` holds the input projections
x_t W_ihᵀ + b_ih of every step, (T, B, G·H); the recurrent projection of step t is
r_t = h_{t-1} W_hhᵀ + b_hh. ``backward`` returns dL/dx_t and dL/dr_t for every step: the output grads
of the two Linear layers that carry the weights, from which their norm rules build example i's
Σ_t g_t x_tᵀ and Σ_t g_t h_{t-1}ᵀ. Gate order and formulas are torch.nn's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """What a forward recurrence keeps for its backward, all (T, B, ·) in step order."""
    y: torch.Tensor                                  # h_t, zero after a sequence ends
    saved: dict = field(default_factory=dict)        # cell-specific activations


def _rows(sizes, t, B):
    return B if sizes is None else sizes[t]


def previous_states(y: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """h_{t-1} for every step t: (T, B, H). Rows past a sequence's end hold zeros; their gradient is zero."""
    return torch.cat([h0.unsqueeze(0), y[:-1]])


class LSTMCell:
    gates = 4
    has_cell_state = True

    def forward(self, x, w_hh, b_hh, h0, c0, sizes) -> Trace:
        T, B, _ = x.shape
        H = h0.shape[1]
        xb = x + b_hh if b_hh is not None else x.clone()
        act = xb                                     # overwritten step by step with i, f, g, o
        c = x.new_zeros(T, B, H)
        y = x.new_zeros(T, B, H)
        wt = w_hh.t()
        for t in range(T):
            n = _rows(sizes, t, B)
            h_prev = h0[:n] if t == 0 else y[t - 1, :n]
            c_prev = c0[:n] if t == 0 else c[t - 1, :n]
            a = act[t, :n]
            pre = torch.addmm(a, h_prev, wt)
            torch.sigmoid(pre, out=a)
            torch.tanh(pre[:, 2 * H:3 * H], out=a[:, 2 * H:3 * H])
            i, f, g, o = a.chunk(4, 1)
            torch.mul(f, c_prev, out=c[t, :n]).addcmul_(i, g)
            torch.tanh(c[t, :n], out=y[t, :n]).mul_(o)
        return Trace(y, {"act": act, "c": c})

    def backward(self, trace, w_hh, h0, c0, sizes, dy, dh_n, dc_n):
        act, c = trace.saved["act"], trace.saved["c"]
        T, B, G = act.shape
        H = G // 4
        i, f, g, o = act.chunk(4, 2)
        tanh_c = torch.tanh(c)
        c_prev = torch.cat([c0.unsqueeze(0), c[:-1]])
        # dL/dc_t gains dh_t o_t (1 - tanh² c_t); the gate pre-activations' grads are
        # dc_t·g σ'(i), dc_t·c_{t-1} σ'(f), dc_t·i (1 - g²), dh_t·tanh c_t σ'(o).
        through_c = o * (1 - tanh_c * tanh_c)
        to_ifg = torch.stack([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g)], 2)
        to_o = tanh_c * o * (1 - o)
        grad = torch.zeros_like(act)
        dh, dc = dh_n.clone(), dc_n.clone()
        for t in reversed(range(T)):
            n = _rows(sizes, t, B)
            dh_t = dh[:n] + dy[t, :n]
            dc_t = torch.addcmul(dc[:n], dh_t, through_c[t, :n])
            d = grad[t, :n]
            torch.mul(to_ifg[t, :n], dc_t.unsqueeze(1), out=d[:, :3 * H].view(n, 3, H))
            torch.mul(dh_t, to_o[t, :n], out=d[:, 3 * H:])
            torch.mul(dc_t, f[t, :n], out=dc[:n])
            torch.mm(d, w_hh, out=dh[:n])
        return grad, grad, dh, dc


class GRUCell:
    gates = 3
    has_cell_state = False

    def forward(self, x, w_hh, b_hh, h0, c0, sizes) -> Trace:
        T, B, G = x.shape
        H = G // 3
        act = torch.empty_like(x)                    # r, z, n
        hidden_n = x.new_empty(T, B, H)              # W_hn h_{t-1} + b_hn, which r gates
        y = x.new_zeros(T, B, H)
        wt = w_hh.t()
        for t in range(T):
            n = _rows(sizes, t, B)
            h_prev = h0[:n] if t == 0 else y[t - 1, :n]
            r_t = torch.addmm(b_hh, h_prev, wt) if b_hh is not None else torch.mm(h_prev, wt)
            a = act[t, :n]
            torch.add(x[t, :n, :2 * H], r_t[:, :2 * H], out=a[:, :2 * H]).sigmoid_()
            hidden_n[t, :n] = r_t[:, 2 * H:]
            torch.addcmul(x[t, :n, 2 * H:], a[:, :H], r_t[:, 2 * H:], out=a[:, 2 * H:]).tanh_()
            new = a[:, 2 * H:]
            torch.sub(h_prev, new, out=y[t, :n]).mul_(a[:, H:2 * H]).add_(new)  # h = n + z (h_prev - n)
        return Trace(y, {"act": act, "hidden_n": hidden_n})

    def backward(self, trace, w_hh, h0, c0, sizes, dy, dh_n, dc_n):
        act, hidden_n = trace.saved["act"], trace.saved["hidden_n"]
        T, B, G = act.shape
        H = G // 3
        r, z, new = act.chunk(3, 2)
        h_prev = previous_states(trace.y, h0)
        # dL/dn_pre = dh (1-z)(1-n²); dL/dr_pre = dn_pre·hn σ'(r); dL/dz_pre = dh (h_prev - n) σ'(z);
        # the recurrent projection's n part gets dn_pre·r, and h_{t-1} also gets dh·z directly.
        to_n = (1 - z) * (1 - new * new)
        to_r = hidden_n * r * (1 - r)
        to_z = (h_prev - new) * z * (1 - z)
        grad_x = torch.zeros_like(act)
        grad_r = torch.zeros_like(act)
        dh = dh_n.clone()
        for t in reversed(range(T)):
            n = _rows(sizes, t, B)
            dh_t = dh[:n] + dy[t, :n]
            dx, dr = grad_x[t, :n], grad_r[t, :n]
            dn = torch.mul(dh_t, to_n[t, :n], out=dx[:, 2 * H:])
            torch.mul(dn, to_r[t, :n], out=dx[:, :H])
            torch.mul(dh_t, to_z[t, :n], out=dx[:, H:2 * H])
            dr[:, :2 * H] = dx[:, :2 * H]
            torch.mul(dn, r[t, :n], out=dr[:, 2 * H:])
            torch.addmm(dh_t * z[t, :n], dr, w_hh, out=dh[:n])
        return grad_x, grad_r, dh, None


class ElmanCell:
    gates = 1
    has_cell_state = False

    def __init__(self, nonlinearity: str):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"unknown nonlinearity {nonlinearity!r}: use 'tanh' or 'relu' (as torch.nn.RNN)")
        self.nonlinearity = nonlinearity

    def forward(self, x, w_hh, b_hh, h0, c0, sizes) -> Trace:
        T, B, H = x.shape
        xb = x + b_hh if b_hh is not None else x
        y = x.new_zeros(T, B, H)
        wt = w_hh.t()
        activation = torch.tanh if self.nonlinearity == "tanh" else torch.relu
        for t in range(T):
            n = _rows(sizes, t, B)
            h_prev = h0[:n] if t == 0 else y[t - 1, :n]
            y[t, :n] = activation(torch.addmm(xb[t, :n], h_prev, wt))
        return Trace(y)

    def backward(self, trace, w_hh, h0, c0, sizes, dy, dh_n, dc_n):
        y = trace.y
        T, B, H = y.shape
        slope = 1 - y * y if self.nonlinearity == "tanh" else (y > 0).to(y.dtype)
        grad = torch.zeros_like(y)
        dh = dh_n.clone()
        for t in reversed(range(T)):
            n = _rows(sizes, t, B)
            torch.mul(dh[:n] + dy[t, :n], slope[t, :n], out=grad[t, :n])
            torch.mm(grad[t, :n], w_hh, out=dh[:n])
        return grad, grad, dh, None
