"""ghostdp: differentially private training with ghost clipping."""
from . import accounting, layers, norms, schedules, validate
from .clipping import DPCriterion, GhostClipping, ImpreciseExampleError, NonFiniteLossError, per_example_loss
from .clipping.adaptive import AdaptiveClipNorm
from .engine import PrivacyEngine
from .norms import register_norm_rule
from .optim import DPOptimizer, PrivacyStepError

__version__ = "0.1.0"

__all__ = ["PrivacyEngine", "AdaptiveClipNorm", "schedules", "DPOptimizer", "PrivacyStepError", "GhostClipping", "DPCriterion",
           "NonFiniteLossError", "ImpreciseExampleError", "per_example_loss", "register_norm_rule", "accounting", "layers", "norms",
           "validate"]
