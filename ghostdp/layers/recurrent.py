"""LSTM, GRU and RNN with torch.nn's constructor, state_dict keys and outputs, whose weights the Linear norm
rule covers.

A recurrent weight is used at every step, so example i's gradient is Σ_t g_t h_{t-1}ᵀ: the Linear rule over
time, once the step gradients g_t and the previous states are seen by one Linear call. Each layer and
direction therefore runs as
1. ``ih``: one Linear call over all steps, X = x W_ihᵀ + b_ih;
2. the recurrence without autograd (``cells``), which gives h_{t-1} for every step;
3. ``hh``: one Linear call over those states, R = H_prev W_hhᵀ + b_hh (what step 2 computed step by step);
4. ``_Recurrence``, an autograd Function whose outputs are step 2's states and whose backward runs
   back-propagation through time by hand, returning dL/dX and dL/dR.
The weights reach the loss only through X and R, so autograd and every norm rule see the exact
gradient, and a private step costs two Linear layers over T tokens per layer and direction.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .cells import ElmanCell, GRUCell, LSTMCell, previous_states

_TORCH_NAME = re.compile(r"(weight|bias)_(ih|hh)_l(\d+)(_reverse)?")


class _StepOrder:
    """Maps batch-first (B, T, ·) tensors in the caller's example order to time-major steps (T, B, ·):
    sorted by decreasing length when lengths are given (as a PackedSequence is), and reversed within each
    sequence for the reverse direction; and back."""

    def __init__(self, batch_size: int, steps: int, reverse: bool, packed: PackedSequence | None = None,
                 lengths: torch.Tensor | None = None):
        self.reverse = reverse
        self.sizes = self.index = self.sorted_indices = None
        if packed is None:
            return
        device = packed.data.device
        sorted_indices = (packed.sorted_indices if packed.sorted_indices is not None
                          else torch.arange(batch_size, device=device))
        sorted_lengths = lengths.to(device)[sorted_indices]
        t = torch.arange(steps, device=device).unsqueeze(1)
        times = torch.where(t < sorted_lengths, sorted_lengths - 1 - t, t) if reverse else t.expand(steps, batch_size)
        self.index = (sorted_indices.expand(steps, batch_size), times)
        self.sizes = packed.batch_sizes.tolist()
        self.sorted_indices = sorted_indices
        self.unsorted_indices = torch.argsort(sorted_indices)
        self.last_step = sorted_lengths - 1

    def to_steps(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            return x[self.index]
        return (x.flip(1) if self.reverse else x).transpose(0, 1).contiguous()

    def from_steps(self, z: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            out = z.new_empty(z.shape[1], z.shape[0], *z.shape[2:])
            out[self.index] = z
            return out
        out = z.transpose(0, 1)
        return out.flip(1) if self.reverse else out.contiguous()

    def sort(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.sorted_indices is None else h[self.sorted_indices]

    def unsort(self, h: torch.Tensor | None) -> torch.Tensor | None:
        return h if h is None or self.sorted_indices is None else h[self.unsorted_indices]

    def final(self, z: torch.Tensor) -> torch.Tensor:
        """Each sequence's state after its last step, (B, ·) in the caller's order."""
        if self.sizes is None:
            return z[-1].clone()
        return self.unsort(z[self.last_step, torch.arange(z.shape[1], device=z.device)])


class _Run:
    """One layer and direction's forward recurrence, kept for its backward."""

    def __init__(self, cell, order: _StepOrder, w_hh, b_hh, h0, c0, x_proj):
        self.cell, self.order, self.w_hh = cell, order, w_hh
        self.h0, self.c0 = order.sort(h0), None if c0 is None else order.sort(c0)
        with torch.no_grad():
            self.trace = cell.forward(order.to_steps(x_proj), w_hh, b_hh, self.h0, self.c0, order.sizes)
            self.previous = order.from_steps(previous_states(self.trace.y, self.h0))

    def outputs(self):
        order, trace = self.order, self.trace
        y, h_n = order.from_steps(trace.y), order.final(trace.y)
        return (y, h_n, order.final(trace.saved["c"])) if self.cell.has_cell_state else (y, h_n)

    def backward(self, dy, dh_n, dc_n=None):
        order = self.order
        dc_n = None if dc_n is None else order.sort(dc_n)
        grad_x, grad_r, dh0, dc0 = self.cell.backward(self.trace, self.w_hh, self.h0, self.c0, order.sizes,
                                                      order.to_steps(dy), order.sort(dh_n), dc_n)
        grad_x_out = order.from_steps(grad_x)
        grad_r_out = grad_x_out if grad_r is grad_x else order.from_steps(grad_r)
        return grad_x_out, grad_r_out, order.unsort(dh0), order.unsort(dc0)


class _Recurrence(torch.autograd.Function):
    """Outputs: the states of a finished ``_Run``; backward: its back-propagation through time, into the
    input projection X, the recurrent projection R and the initial states."""

    @staticmethod
    def forward(ctx, x_proj, h_proj, h0, c0, run):
        ctx.run = run
        return run.outputs()

    @staticmethod
    def backward(ctx, *grads):
        return (*ctx.run.backward(*grads), None)


class _Direction(nn.Module):
    """One layer in one direction: its input and recurrent projections are Linear layers."""

    def __init__(self, input_size, hidden_size, gates, bias, device, dtype):
        super().__init__()
        factory = dict(bias=bias, device=torch.get_default_device() if device is None else device, dtype=dtype)
        self.ih = nn.utils.skip_init(nn.Linear, input_size, gates * hidden_size, **factory)
        self.hh = nn.utils.skip_init(nn.Linear, hidden_size, gates * hidden_size, **factory)

    def forward(self, x, h0, c0, cell, order: _StepOrder):
        x_proj = self.ih(x)
        bias = None if self.hh.bias is None else self.hh.bias.detach()
        run = _Run(cell, order, self.hh.weight.detach(), bias, h0.detach(),
                   None if c0 is None else c0.detach(), x_proj.detach())
        h_proj = self.hh(run.previous)
        return _Recurrence.apply(x_proj, h_proj, h0, c0, run)


class _RecurrentBase(nn.Module):
    """The torch.nn.RNNBase interface over ``_Direction`` parts named ``l{layer}`` and ``l{layer}_reverse``."""

    def __init__(self, cell, mode, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__()
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{mode}: {name} must be a positive integer, got {value!r}")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1) or isinstance(dropout, bool):
            raise ValueError(f"{mode}: dropout must be a number in [0, 1], got {dropout!r}")
        self.mode, self.cell = mode, cell
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional = bidirectional
        self.suffixes = ("", "_reverse") if bidirectional else ("",)
        for layer in range(num_layers):
            size = input_size if layer == 0 else hidden_size * len(self.suffixes)
            for suffix in self.suffixes:
                self.add_module(f"l{layer}{suffix}", _Direction(size, hidden_size, cell.gates, bias, device, dtype))
        self.register_state_dict_post_hook(_save_with_torch_names)
        self.register_load_state_dict_pre_hook(_load_torch_names)
        self.reset_parameters()

    def _torch_names(self):
        """(torch.nn's name, our parameter) in torch.nn's order."""
        for layer in range(self.num_layers):
            for suffix in self.suffixes:
                part = getattr(self, f"l{layer}{suffix}")
                kinds = ("weight", "bias") if self.bias else ("weight",)
                for kind in kinds:
                    for proj in ("ih", "hh"):
                        yield f"{kind}_{proj}_l{layer}{suffix}", f"l{layer}{suffix}.{proj}.{kind}", \
                            getattr(getattr(part, proj), kind)

    def reset_parameters(self):
        """torch.nn.RNNBase's initialisation, U(-1/√H, 1/√H), drawn in its order: the same seed gives the same
        weights as the torch.nn module."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for weights in self.all_weights:
            for p in weights:
                nn.init.uniform_(p, -bound, bound)

    def __getattr__(self, name):
        match = _TORCH_NAME.fullmatch(name)
        if match is not None:
            kind, proj, layer, suffix = match.groups()
            part = self._modules.get(f"l{layer}{suffix or ''}")
            value = None if part is None else getattr(getattr(part, proj), kind)
            if value is not None:
                return value
        return super().__getattr__(name)

    @property
    def all_weights(self):
        """[[w_ih, w_hh, b_ih, b_hh] per layer and direction], as torch.nn.RNNBase.all_weights."""
        names = {name: p for name, _, p in self._torch_names()}
        return [[names[f"{k}_l{layer}{s}"] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
                 if f"{k}_l{layer}{s}" in names] for layer in range(self.num_layers) for s in self.suffixes]

    def flatten_parameters(self):
        """No-op: there is no cuDNN weight buffer to compact (kept so code written for torch.nn runs)."""

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s

    def _initial_state(self, hx, batch_size, reference, what):
        shape = (self.num_layers * len(self.suffixes), batch_size, self.hidden_size)
        if hx is None:
            return reference.new_zeros(shape)
        if tuple(hx.shape) != shape:
            raise ValueError(f"{self.mode}: {what} has shape {tuple(hx.shape)}, expected {shape} "
                             "(num_layers * num_directions, batch, hidden_size)")
        return hx

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        unbatched = not packed and input.dim() == 2
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"{self.mode}: expected a 2-D (unbatched) or 3-D input, got {input.dim()}-D")
            x = input.unsqueeze(0) if unbatched else (input if self.batch_first else input.transpose(0, 1))
            lengths = None
        if x.shape[-1] != self.input_size:
            raise ValueError(f"{self.mode}: input has {x.shape[-1]} features, the module was built for "
                             f"input_size={self.input_size}")
        B, T = x.shape[0], x.shape[1]
        h0, c0 = self._unpack_state(hx, unbatched, B, x)
        orders = [_StepOrder(B, T, reverse=bool(s), packed=input if packed else None, lengths=lengths)
                  for s in self.suffixes]
        finals_h, finals_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for d, (suffix, order) in enumerate(zip(self.suffixes, orders)):
                k = layer * len(self.suffixes) + d
                result = getattr(self, f"l{layer}{suffix}")(x, h0[k], None if c0 is None else c0[k], self.cell, order)
                outputs.append(result[0])
                finals_h.append(result[1])
                if c0 is not None:
                    finals_c.append(result[2])
            x = torch.cat(outputs, -1) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        h_n = torch.stack(finals_h)
        c_n = torch.stack(finals_c) if c0 is not None else None
        if packed:
            output = _pack_like(x, input, orders[0])
        elif unbatched:
            output, h_n = x.squeeze(0), h_n.squeeze(1)
            c_n = None if c_n is None else c_n.squeeze(1)
        else:
            output = x if self.batch_first else x.transpose(0, 1)
        return output, ((h_n, c_n) if c0 is not None else h_n)

    def _unpack_state(self, hx, unbatched, batch_size, x):
        if self.cell.has_cell_state:
            if hx is not None and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
                raise ValueError(f"{self.mode}: hx must be a tuple (h_0, c_0)")
            h, c = (None, None) if hx is None else hx
        else:
            if isinstance(hx, (tuple, list)):
                raise ValueError(f"{self.mode}: hx must be one tensor h_0, not a tuple")
            h, c = hx, None
        if unbatched:
            h = None if h is None else h.unsqueeze(1)
            c = None if c is None else c.unsqueeze(1)
        h0 = self._initial_state(h, batch_size, x, "h_0")
        c0 = self._initial_state(c, batch_size, x, "c_0") if self.cell.has_cell_state else None
        return h0, c0


def _pack_like(padded: torch.Tensor, like: PackedSequence, order: _StepOrder) -> PackedSequence:
    """The batch-first padded output as a PackedSequence with the input's batch sizes and order (``order``:
    the forward direction's, which holds both)."""
    rows = torch.cat([order.sorted_indices[:n] for n in order.sizes])
    times = torch.cat([torch.full((n,), t, device=padded.device) for t, n in enumerate(order.sizes)])
    return PackedSequence(padded[rows, times], like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def _save_with_torch_names(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: our parameters' keys become torch.nn's (weight_ih_l0, ...), in its order."""
    values = [(prefix + torch_name, state_dict.pop(prefix + ours)) for torch_name, ours, _ in module._torch_names()
              if prefix + ours in state_dict]
    state_dict.update(values)


def _load_torch_names(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: torch.nn's keys (weight_ih_l0, ...) load into our parameters."""
    for torch_name, ours, _ in module._torch_names():
        if prefix + torch_name in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + torch_name)


class LSTM(_RecurrentBase):
    """torch.nn.LSTM (same arguments, state_dict keys and outputs) whose weights the Linear norm rule covers.
    ``proj_size`` is not supported."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None):
        if proj_size:
            raise NotImplementedError(
                "ghostdp.layers.LSTM does not support proj_size > 0. Fix: use proj_size=0, or keep torch.nn.LSTM "
                "(ghostdp then clips it exactly through its per-example fallback, at O(batch) memory and time)")
        super().__init__(LSTMCell(), "LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype)
        self.proj_size = 0


class GRU(_RecurrentBase):
    """torch.nn.GRU (same arguments, state_dict keys and outputs) whose weights the Linear norm rule covers."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, device=None, dtype=None):
        super().__init__(GRUCell(), "GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype)


class RNN(_RecurrentBase):
    """torch.nn.RNN (same arguments, state_dict keys and outputs) whose weights the Linear norm rule covers."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__(ElmanCell(nonlinearity), "RNN", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device, dtype)
        self.nonlinearity = nonlinearity


def from_torch(module: nn.RNNBase) -> _RecurrentBase:
    """The ghostdp module equal to a torch.nn LSTM, GRU or RNN: same settings, weights, device, dtype and mode."""
    if not isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)):
        raise TypeError(f"from_torch takes a torch.nn LSTM, GRU or RNN, got {type(module).__name__}")
    common = dict(num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
                  dropout=module.dropout, bidirectional=module.bidirectional)
    weight = module.weight_ih_l0
    factory = dict(device=weight.device, dtype=weight.dtype)
    if isinstance(module, nn.LSTM):
        new = LSTM(module.input_size, module.hidden_size, proj_size=module.proj_size, **common, **factory)
    elif isinstance(module, nn.GRU):
        new = GRU(module.input_size, module.hidden_size, **common, **factory)
    else:
        new = RNN(module.input_size, module.hidden_size, nonlinearity=module.nonlinearity, **common, **factory)
    new.load_state_dict(module.state_dict())
    for torch_name, _, p in new._torch_names():
        p.requires_grad_(getattr(module, torch_name).requires_grad)
    new.train(module.training)
    return new
