"""ghostdp's twins of transformers modules that cannot train privately as they are, which ``validate.fix`` swaps in.

Each twin module (``wavlm``, ``swinv2``) names the transformers class it replaces (``TRANSFORMERS_CLASS``), why that
class cannot train (``WHY``), whether a module has the code the twin computes again (``has_known_code``), and builds
the twin from the module (``from_transformers``: the same children, parameters and buffers, the same outputs).
"""
from __future__ import annotations

from torch import nn

from ..norms.registry import is_instance_of
from . import swinv2, wavlm

TWINS = (wavlm, swinv2)


def twin_of(module: nn.Module):
    """The twin module (``wavlm``, ``swinv2``) for a transformers module of the class it replaces, or None."""
    for twin in TWINS:
        if is_instance_of(module, twin.TRANSFORMERS_CLASS):
            return twin
    return None
