"""Peak-memory readings, and ``max_physical_batch_size="auto"``: the largest physical batch that fits.

The search runs real private steps (forward and both passes, never the optimizer's step) on the
dataset's first examples: peak memory at two sizes gives a line, memory(b) = base + per_example * b,
whose crossing with the budget is checked by one more step; on CUDA an out-of-memory error also
marks a size as too large. The budget is ``memory_budget_mb`` above the memory in use before the
search, or on CUDA by default 90% of what is free. It changes neither the logical batch nor the
accounting, and leaves nothing behind: gradients are cleared, the controller's per-step state is
reset, torch's RNG is restored, and the accountant and the noise stream are never touched.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import math

import torch

from .data import across_ranks

log = logging.getLogger("ghostdp")

CUDA_FREE_SHARE = 0.9


# ------------------------------------------------------------------------------------ readings
def resident_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status (peak memory on CPU needs Linux)")


def _return_freed_memory() -> None:
    """glibc keeps freed heap memory in the process (and in its resident set) for reuse; hand it back,
    so that a peak read against the resident set counts what a step allocates, not what it reuses."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def reset_peak(device) -> float:
    """Starts a peak-memory reading: CUDA peak allocated, or the process's peak resident set (Linux:
    /proc/self/clear_refs resets it, after freed heap memory went back to the system); returns the
    base the peak is read against."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    _return_freed_memory()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM (peak RSS) to the current RSS
    return resident_mb("VmRSS")


def peak_mb_since(device, base) -> float:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    return resident_mb("VmHWM") - base


# ------------------------------------------------------------------------------------ the search
def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower() \
        or "can't allocate memory" in str(error)


class PhysicalBatchSearch:
    """Finds the largest physical batch whose private step fits.

    ``probe(b)`` runs one forward and DP backward on b examples; ``clean()`` drops what a probe left
    (gradients, the controller's per-step state). ``largest`` bounds the answer (the largest logical
    batch worth splitting).
    """

    def __init__(self, probe, clean, device, largest: int, memory_budget_mb: float | None = None):
        self.probe, self.clean, self.device, self.largest = probe, clean, torch.device(device), int(largest)
        if memory_budget_mb is not None and not memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be > 0, got {memory_budget_mb!r}")
        if memory_budget_mb is None and self.device.type != "cuda":
            raise ValueError("max_physical_batch_size='auto' on a CPU needs memory_budget_mb (the memory a step "
                             "may take above what is in use now), since the CPU has no allocator to ask")
        self.memory_budget_mb = memory_budget_mb
        self.readings = {}  # batch size -> peak MiB above the base, or math.inf for out of memory

    def budget_mb(self) -> float:
        if self.memory_budget_mb is not None:
            return float(self.memory_budget_mb)
        free, _ = torch.cuda.mem_get_info(self.device)
        return CUDA_FREE_SHARE * free / 2 ** 20

    def measure(self, b: int) -> float:
        if b in self.readings:
            return self.readings[b]
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        base = reset_peak(self.device)
        try:
            self.probe(b)
            peak = peak_mb_since(self.device, base)
        except Exception as error:
            if not _is_out_of_memory(error):
                raise
            peak = math.inf
        finally:
            self.clean()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        self.readings[b] = peak
        return peak

    def run(self, probes: int = 10) -> int:
        """The largest size measured within the budget. Sizes stay between the largest that fitted and
        the smallest that did not; the next one comes from the line through the readings at 1 and at
        the last size (95% of its crossing with the budget), or halfway after an out-of-memory error."""
        budget = self.budget = self.budget_mb()
        first = self.measure(1)
        if first > budget:
            raise MemoryError(f"max_physical_batch_size='auto': one example's private step takes "
                              f"{first:.0f} MiB, above the budget of {budget:.0f} MiB")
        best, too_large, size = 1, self.largest + 1, min(self.largest, 16)
        for _ in range(probes):
            if not best < size < too_large:
                break
            peak = self.measure(size)
            if peak <= budget:
                best = size
            else:
                too_large = size
            if math.isinf(peak):
                size = (best + too_large) // 2
                continue
            per_example = max((peak - first) / (size - 1), 1e-6)
            estimate = int(1 + 0.95 * (budget - first) / per_example)
            size = min(max(estimate, best + 1), too_large - 1)
            if size == best + 1 and estimate <= best:
                break  # the line says no larger size fits
        return best

def choose_physical_batch_size(search: PhysicalBatchSearch) -> int:
    """The search's choice, logged; with several processes the smallest over the ranks, since every rank
    must split its batches alike (DDP's forward and backward calls stay in step)."""
    chosen = search.run()
    readings = ", ".join(f"{b}: {mb:.0f} MiB" for b, mb in sorted(search.readings.items()))
    log.info("max_physical_batch_size='auto' chose %d (budget %.0f MiB; peak above the start by batch size: %s)",
             chosen, search.budget, readings)
    return int(across_ranks(chosen, search.device, "min"))
