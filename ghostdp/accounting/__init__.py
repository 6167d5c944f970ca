"""Privacy accounting for DP-SGD: RDP (loose, fast) and PRV (tight numerical composition)."""
from .base import Accountant, check_noise_multiplier, check_positive
from .calibration import get_noise_multiplier, make_accountant
from .prv import PRVAccountant
from .rdp import RDPAccountant

__all__ = ["Accountant", "check_noise_multiplier", "check_positive", "RDPAccountant", "PRVAccountant", "get_noise_multiplier", "make_accountant"]
