"""Privacy accounting for DP-SGD: RDP (loose, fast) and PRV (tight numerical composition)."""
from .base import Accountant
from .calibration import get_noise_multiplier, make_accountant
from .prv import PRVAccountant
from .rdp import RDPAccountant

__all__ = ["Accountant", "RDPAccountant", "PRVAccountant", "get_noise_multiplier", "make_accountant"]
