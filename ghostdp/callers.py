"""Where a warning that ghostdp raises inside a hook or a backward points: at the line of the caller's code that
led to it (a forward, loss.backward()), past the frames of torch, ghostdp and contextlib between."""
from __future__ import annotations

import contextlib
import os
import sys

import torch

_LIBRARY_FILES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller: the first frame outside torch,
    ghostdp and contextlib (1: the caller's own line, where every frame is theirs)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _in_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_FILES) or filename == contextlib.__file__
