"""What ghostdp's twins of transformers modules share (layers/twins.py): a module's state taken over as it is, and
its class's code checked before a twin computes it again."""
from __future__ import annotations

from torch import nn

from ..norms.registry import is_instance_of


class TakenOver(nn.Module):
    """The twin of a transformers module: its public attributes, parameters, children and buffers, taken over as they
    are (in their order, so that state_dict's keys keep theirs; frozen flags, device, dtype and any optimizer's
    references stay). ``forward`` runs the module's class's own forward on the twin, which overrides the methods it
    computes again; a twin that computes the whole forward again overrides ``forward`` too."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._code = type(module)  # transformers' class
        for name, value in vars(module).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, p in module._parameters.items():
            setattr(self, name, p)
        for name, child in module._modules.items():
            setattr(self, name, child)
        for name, buffer in module._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        self.train(module.training)

    def forward(self, *args, **kwargs):
        return self._code.forward(self, *args, **kwargs)


def twin(twin_class: type, module: nn.Module, transformers_class: str, has_known_code, label: str) -> nn.Module:
    """``twin_class(module)``, for a module of ``transformers_class`` (a qualified name; ``label``, as errors name it)
    whose code ``has_known_code``; else TypeError or ValueError."""
    if not is_instance_of(module, transformers_class):
        raise TypeError(f"from_transformers takes transformers' {label}, got {type(module).__name__}")
    if not has_known_code(module):
        raise ValueError(
            f"{type(module).__name__}'s code is not the {label} code {twin_class.__module__} computes again (a "
            "subclass with methods of its own, another transformers version): it keeps its own forward")
    return twin_class(module)
