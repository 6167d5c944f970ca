"""Drop-in modules whose parameters the norm rules cover: recurrent layers built from Linear projections."""
from .recurrent import GRU, LSTM, RNN, from_torch

__all__ = ["LSTM", "GRU", "RNN", "from_torch"]
