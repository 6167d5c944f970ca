"""ghostdp: differentially private training with ghost clipping."""
from . import norms, validate
from .clipping import DPCriterion, GhostClipping, NonFiniteLossError, per_example_loss
from .norms import register_norm_rule

__version__ = "0.1.0"

__all__ = ["GhostClipping", "DPCriterion", "NonFiniteLossError", "per_example_loss", "register_norm_rule",
           "norms", "validate"]
