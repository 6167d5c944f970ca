"""Drop-in modules whose parameters the norm rules cover: recurrent layers and multi-head attention built from
Linear projections; twins of transformers modules that cannot train privately as they are (``twins``: WavLM's
attention, Swin v2's self-attention), which validate.fix swaps in."""
from torch import nn

from . import attention, recurrent, swinv2, twins, wavlm
from .attention import MultiheadAttention
from .recurrent import GRU, LSTM, RNN

__all__ = ["LSTM", "GRU", "RNN", "MultiheadAttention", "from_torch"]


def from_torch(module: nn.Module) -> nn.Module:
    """The ghostdp twin of a torch.nn LSTM, GRU, RNN or MultiheadAttention: same settings, weights, frozen
    parameters, device, dtype and mode."""
    if isinstance(module, nn.MultiheadAttention):
        return attention.from_torch(module)
    if isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)):
        return recurrent.from_torch(module)
    raise TypeError(f"from_torch takes a torch.nn LSTM, GRU, RNN or MultiheadAttention, got {type(module).__name__}")
