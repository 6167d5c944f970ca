"""The two-pass ghost-clipping controller and the DP loss."""
from .controller import GhostClipping, NonFiniteLossError, check_max_grad_norm
from .loss import DPCriterion, per_example_loss

__all__ = ["check_max_grad_norm", "GhostClipping", "NonFiniteLossError", "DPCriterion", "per_example_loss"]
