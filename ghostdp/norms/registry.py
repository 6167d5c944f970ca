"""The one registry of norm rules, keyed by module class and found by ``isinstance``.

A rule is a function ``rule(module, inputs, output_grad, trainable) -> {name: PerExampleGrad}``:
``inputs`` are the positional tensors the module was called with (batch first),
``output_grad`` the (B, ...) gradient of the loss w.r.t. the module's output,
``trainable`` the names of the module's own parameters that require grad now.
Modules whose class has no rule and that own trainable parameters are handled
by the fallback (``ghostdp.norms.fallback``).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

Rule = Callable[..., Dict[str, "PerExampleGrad"]]

_RULES: dict[type, Rule] = {}
_RULE_PARAMETERS: dict[Rule, frozenset] = {}


def register_norm_rule(module_class: type, rule: Rule | None = None, params=("weight", "bias")):
    """Register ``rule`` for ``module_class`` and its subclasses; usable as a decorator.

    ``params`` names the parameters the rule covers. A module that owns any other
    parameter (a subclass that adds one, so its forward differs) goes to the fallback.
    """
    if not (isinstance(module_class, type) and issubclass(module_class, torch.nn.Module)):
        raise TypeError(f"register_norm_rule needs a torch.nn.Module subclass, got {module_class!r}")

    def add(fn):
        _RULES[module_class] = fn
        _RULE_PARAMETERS[fn] = frozenset(params)
        return fn

    return add(rule) if rule is not None else add


def find_norm_rule(module: torch.nn.Module) -> Rule | None:
    """The rule of the most specific registered class in the module's MRO, or None."""
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def rule_parameters(rule: Rule) -> frozenset:
    """Names of the parameters ``rule`` covers."""
    return _RULE_PARAMETERS[rule]
