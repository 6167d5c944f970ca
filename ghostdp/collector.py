"""Python's cyclic garbage collector, paused while ghostdp's part of a step runs.

A private step allocates about 1600 objects in its forward and as many in the DP loss's backward that the
collector tracks (module calls, their hooks, the Python objects of tensors and autograd nodes); nearly all of
them die by reference count when the backward is done. Counted as they are allocated, they cross the
collector's first threshold (700) about three times a step, and each collection in mid-step promotes the live
ones to an older generation; the promotions add up to a collection of the whole process (every object torch and
transformers keep: ~376k, ~170 ms on the CPU stand-in) every ~200-300 steps. Plain training allocates few and
collects almost never. Paused in the DP loss's backward and the optimizer step, the collector runs 1.8 times a
step instead of 2.75, and the whole process every ~600 steps: ``python -m profiling.collector --modes plain
ghost bookkeeping --steps 600 --repeats 2`` (collector time per step, two runs): ghost 1.14 and 1.11 ms -> 0.52
and 0.49 ms, book-keeping 0.83 and 0.87 ms -> 0.51 and 0.55 ms, plain 0.001 ms. Paused through the training
forward as well (recording.ForwardRecorder's root hooks, 2026-11-26), it runs 0.94 times a step: ``--steps 400``,
collector time per step ghost 0.87 -> 0.81 ms, book-keeping 0.82 -> 0.69 ms (one run each; the collections of the
whole process, every ~400 steps, are most of what is left).

The forward check's reruns (clipping/independence.py) run paused too.

``paused()`` turns the collector off for its block and back on after, only where it was on (a caller that
turned it off keeps it off), also when the block raises. Reference counting frees objects as before; only
reference cycles made inside the block wait for the next collection after it. ``PAUSE`` = False switches it off.
"""
from __future__ import annotations

import contextlib
import gc

PAUSE = True


def pause() -> bool:
    """Turns the collector off where ``PAUSE`` is on and it was on; whether it did (``resume``'s argument)."""
    if not PAUSE or not gc.isenabled():
        return False
    gc.disable()
    return True


def resume(was_paused: bool) -> None:
    if was_paused:
        gc.enable()


@contextlib.contextmanager
def paused():
    was_paused = pause()
    try:
        yield
    finally:
        resume(was_paused)
