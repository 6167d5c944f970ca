"""The two-pass ghost-clipping controller and the DP loss."""
from .controller import GhostClipping, NonFiniteLossError
from .loss import DPCriterion, per_example_loss

__all__ = ["GhostClipping", "NonFiniteLossError", "DPCriterion", "per_example_loss"]
