"""peft's p-tuning: the prompt encoder (``peft.tuners.p_tuning.model.PromptEncoder``), an embedding of the virtual
tokens followed by an MLP (or a bidirectional LSTM and an MLP), whose (1, n, d) output peft repeats to the batch
itself. Registered by qualified name, so ``import ghostdp`` imports no peft module.

The encoder owns its children's parameters (fallback.ABSORBED_CHILDREN: its embedding, LSTM and MLP are not hooked)
and its call is captured at peft's repeat (clipping/repeated.py), so its output grad is the repeated prompt's,
(B, n, d), one row per example. The prompt depends on the encoder's parameters alone, so example i's gradient of
every parameter is the VJP of the prompt with G_i: the encoder's forward is run again from its ids (exact: no
random draw in it, the LSTM's dropout declined) and the B VJPs are batched (batched_vjp.pulled_back), B times the
encoder's own small backward. Declined (the fallback): ids of a batch above 1 (peft looks the prompt up once), other
arguments, and in training an LSTM with dropout between its layers.
"""
from __future__ import annotations

import torch

from .batched_vjp import batched_vjp, pulled_back
from .factors import Instantiated
from .fallback import ABSORBED_CHILDREN
from .registry import register_norm_rule

PROMPT_ENCODER = "peft.tuners.p_tuning.model.PromptEncoder"
ABSORBED_CHILDREN[PROMPT_ENCODER] = ("embedding", "lstm_head", "mlp_head")


def _encoder_parameters(module) -> frozenset:
    return frozenset(name for name, _ in module.named_parameters())


def _encodes_one_lookup(module, args, kwargs) -> bool:
    """Whether this call encodes one lookup of the virtual tokens with no random draw, as the rule assumes."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2 or len(args[0]) != 1:
        return False
    lstm = getattr(module, "lstm_head", None)
    return not (module.training and lstm is not None and lstm.num_layers > 1 and lstm.dropout > 0)


@register_norm_rule(PROMPT_ENCODER, params=_encoder_parameters, accepts=_encodes_one_lookup)
def prompt_encoder_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                        trainable: set[str]) -> dict:
    names = sorted(trainable)
    if not names:
        return {}
    with torch.enable_grad():
        prompt = module.forward(inputs[0][:1])  # (1, n, d) from the parameters alone; the children are not hooked
    params = [module.get_parameter(n) for n in names]
    grads = pulled_back(Instantiated(output_grad), prompt.numel(),
                        lambda rows: batched_vjp([prompt], params, [rows.to(prompt.dtype).unsqueeze(1)]))
    return dict(zip(names, grads))
