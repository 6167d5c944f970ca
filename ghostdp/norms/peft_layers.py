"""What peft's tuner layers have in common, for the rules of peft_lora.py, peft_lycoris.py, peft_rotations.py and
peft_tokens.py: the names of their adapters' parameters, and the plain call their rules know."""
from __future__ import annotations


def adapter_parameters(module) -> frozenset:
    """The names of every adapter's parameters in the layer's containers (``adapter_layer_names``), as the module
    owns them (norms/fallback.owned_parameters): "hada_w1_a.default", ...; in a container of containers (TinyLoRA's
    ModuleDict of ParameterDicts) "tinylora_v.default.0", ..."""
    return frozenset(f"{kind}.{name}" for kind in module.adapter_layer_names
                     for name, _ in getattr(module, kind).named_parameters())


def adapter_names(module, adapter: str, trainable) -> list:
    """The names among ``trainable`` of adapter ``adapter``'s parameters in the layer's containers, in their order."""
    return [f"{kind}.{name}" for kind in module.adapter_layer_names
            for name, _ in getattr(module, kind).named_parameters()
            if (name == adapter or name.startswith(adapter + ".")) and f"{kind}.{name}" in trainable]


def plain_adapted_call(module, args, kwargs) -> bool:
    """Whether this call passes the layer one positional argument and nothing else, its adapters enabled and not
    merged: the forward its rule knows (a call otherwise takes the exact fallback)."""
    return len(args) == 1 and not kwargs and not module.disable_adapters and not module.merged
