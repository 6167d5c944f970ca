"""ghostdp's twins of transformers modules that cannot train privately as they are, which ``validate.fix`` swaps in.

Each twin module (``wavlm``, ``swinv2``, ``deberta``, ``mpnet``) names the transformers class it replaces
(``TRANSFORMERS_CLASS``), why that class cannot train (``WHY``), whether a module has the code the twin computes
again (``has_known_code``), and builds the twin from the module (``from_transformers``: the same children,
parameters and buffers, the same outputs).
"""
from __future__ import annotations

from torch import nn

from ..norms.registry import is_instance_of
from . import deberta, mpnet, swinv2, wavlm

TWINS = (wavlm, swinv2, deberta, mpnet)


def twin_of(module: nn.Module):
    """The twin module (one of TWINS) for a transformers module of the class it replaces, or None."""
    for twin in TWINS:
        if is_instance_of(module, twin.TRANSFORMERS_CLASS):
            return twin
    return None


REFUSED = (
    "ghostdp: these transformers modules cannot train privately as they are, and a step is refused: {names} "
    "({why}). Fix: ghostdp.validate.fix(model) before making it private swaps each for its ghostdp.layers twin "
    "(ghostdp.layers.twins: the same children, parameters, state_dict keys and outputs), which the norm rules cover.")


def why_refused(model: nn.Module, names: list) -> str:
    """Why each class of these modules of ``model`` (each of a class with a twin) cannot train as it is, for REFUSED."""
    twins = sorted({twin_of(model.get_submodule(n)) for n in names}, key=lambda t: t.__name__)
    return "; ".join(f"{t.TRANSFORMERS_CLASS.rsplit('.', 1)[1]} {t.WHY}" for t in twins)
