"""The two-pass ghost-clipping controller and the DP loss."""
from .controller import GhostClipping, NonFiniteLossError, check_max_grad_norm
from .loss import DPCriterion, per_example_loss
from .precision import ImpreciseExampleError

__all__ = ["check_max_grad_norm", "GhostClipping", "NonFiniteLossError", "ImpreciseExampleError", "DPCriterion",
           "per_example_loss"]
