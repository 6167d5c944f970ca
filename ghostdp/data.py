"""Poisson sampling of logical batches, their split into physical chunks, and the tracker that
tells the DP optimizer which chunk the training loop is on.

A logical batch is one draw of the sampled Gaussian mechanism: noise is added once per logical
batch. ``max_physical_batch_size`` only decides how many examples go through the model at a
time; the chunks of one logical batch accumulate into one clipped sum.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import default_collate

from .randomness import RandomSource
from .schedules import SamplingPlan


def poisson_rate_and_steps(batch_size: int, world_size: int, n: int) -> tuple[float, int]:
    """The sample rate q = batch_size * world_size / n (at most 1) and the steps of an epoch, ceil(n / that): each
    process's ``batch_size`` is its expected share of the logical batch, as in DDP. ``n``: the dataset's size."""
    if n == 0:
        raise ValueError("the training dataset is empty: there is nothing to sample batches from")
    logical = batch_size * world_size
    return min(1.0, logical / n), max(1, math.ceil(n / logical))


def distributed_rank_and_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def collective_device(device) -> torch.device:
    """Where a small tensor for a collective must live: the GPU with NCCL, the CPU otherwise (gloo)."""
    return torch.device(device) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def across_ranks(value: float, device, op: str = "max") -> float:
    """``value`` reduced over every process by ``op`` ("max" or "min"; one all-reduce, in float64, exact for
    counts), or ``value`` itself in one process. ``device``: where the caller's tensors live (collective_device
    picks the collective's)."""
    if distributed_rank_and_size()[1] == 1:
        return value
    sign = {"max": 1.0, "min": -1.0}[op]  # the minimum is the negated maximum of the negated values
    return sign * maxima_across_ranks([sign * value], device)[0]


def any_rank(flag: bool, device) -> bool:
    """``flag`` on any process (one all-reduce), or ``flag`` itself in one process."""
    return bool(across_ranks(float(flag), device))


def maxima_across_ranks(values, device) -> list[float]:
    """Each of ``values`` (numbers; a flag as 0 or 1) maximised over every process in one all-reduce (float64,
    exact for counts and lengths), or the values themselves in one process."""
    if distributed_rank_and_size()[1] == 1:
        return [float(v) for v in values]
    reduced = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device(device))
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
    return reduced.tolist()


class PoissonBatchSampler(Sampler):
    """Logical batches in which every example is present independently with probability ``sample_rate``.

    Batch sizes vary and may be 0. With several processes each rank draws from its own shard
    (indices rank, rank + world_size, ...), so the union over ranks is one Poisson sample of
    the whole dataset. An epoch is ``steps_per_epoch`` draws. Draws are keyed by
    (seed, rank, epoch, batch): the sampler resumes exactly from its ``state_dict``. A
    ``batch_size_schedule`` (schedules.py) gives each epoch its own rate and number of draws,
    starting from ``sample_rate``.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps_per_epoch: int, *, source: RandomSource,
                 rank: int | None = None, world_size: int | None = None, batch_size_schedule=None):
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"Poisson sampling needs a dataset with at least one example, got {num_samples!r}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
        default_rank, default_size = distributed_rank_and_size()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_size if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}")
        self.num_samples, self.sample_rate, self.steps_per_epoch = num_samples, sample_rate, steps_per_epoch
        self.plan = SamplingPlan(sample_rate, steps_per_epoch, num_samples, batch_size_schedule)
        self.source = source
        self.shard = np.arange(self.rank, num_samples, self.world_size)
        self.epoch, self.next_batch = 0, 0

    def __len__(self):
        return self.plan.at(self.epoch)[1]  # draws of the current epoch

    def rate_at(self, epoch: int) -> float:
        return self.plan.at(epoch)[0]

    def largest_batch(self) -> int:
        """A size no logical batch is expected to exceed: mean + 4 standard deviations of the draw
        (exceeded with probability below ~3e-5), or the whole dataset under a batch-size schedule."""
        if self.plan.schedule is not None:
            return self.num_samples
        mean = self.sample_rate * self.num_samples
        return int(min(self.num_samples, math.ceil(mean + 4 * math.sqrt(mean * (1 - self.sample_rate)) + 1)))

    def _kept(self, rank: int, epoch: int, batch: int) -> np.ndarray:
        """Which examples of ``rank``'s shard (indices rank, rank + world_size, ...) this draw keeps."""
        shard_size = len(range(rank, self.num_samples, self.world_size))
        return self.source.sampling_uniform(shard_size, (rank, epoch, batch)) < self.rate_at(epoch)

    def draw(self, epoch: int, batch: int) -> list[int]:
        return self.shard[self._kept(self.rank, epoch, batch)].tolist()

    def sizes_on_all_ranks(self, epoch: int, batch: int, own: int | None = None) -> list[int]:
        """The size of this draw on every rank: computed locally where the streams are shared by all ranks;
        in secure_mode (OS entropy, FSDP2 only) gathered from the ranks, each giving ``own``, the size of
        the draw it made (collective: every rank calls it for the same draw)."""
        if not self.source.secure:
            return [int(self._kept(rank, epoch, batch).sum()) for rank in range(self.world_size)]
        if own is None:
            raise ValueError("secure-mode draws cannot be recomputed: pass the size of this rank's draw")
        import torch.distributed as dist
        sizes = [None] * self.world_size
        dist.all_gather_object(sizes, int(own))
        return sizes

    def with_positions(self):
        """Yields ((epoch, batch), indices) from the current position to the end of the epoch."""
        epoch = self.epoch
        for batch in range(self.next_batch, self.plan.at(epoch)[1]):
            self.next_batch = batch + 1
            yield (epoch, batch), self.draw(epoch, batch)
        if self.epoch == epoch:
            self.epoch, self.next_batch = epoch + 1, 0

    def position_after(self, position) -> tuple:
        epoch, batch = position
        return (epoch + 1, 0) if batch + 1 >= self.plan.at(epoch)[1] else (epoch, batch + 1)

    def __iter__(self):
        for _, indices in self.with_positions():
            yield indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.next_batch = int(state["epoch"]), int(state["next_batch"])


@dataclass(frozen=True)
class Chunk:
    """What the optimizer needs to know about one physical batch."""
    logical_id: int     # running count of logical batches of this loader
    index: int          # chunk index within the logical batch
    count: int          # number of chunks of the logical batch
    logical_size: int   # examples in the whole logical batch
    position: tuple     # (epoch, batch) of the logical batch in its sampler, or None
    padding: bool = False  # a stand-in row (weight 0) that keeps the ranks' chunk counts equal
    sample_rate: float | None = None    # q of the draw (Poisson sampling), recorded by the accountant
    expected_size: float | None = None  # q * N over all ranks: the divisor of the noisy sum
    pass_index: int | None = None       # the loader's own batches: which pass over its sampler (an example is
                                        # in at most one batch of a pass); None with Poisson sampling
    size: int | None = None             # examples in this physical batch (1 for a padding chunk's stand-in row)

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


class BatchTracker:
    """Chunks generated by the sampler (``pending``, in order) and those handed to the loop (``yielded``)."""

    def __init__(self):
        self.pending = collections.deque()
        self.yielded: list[Chunk] = []
        self.logical_batches = 0  # drawn by the sampler so far (whichever loader iterates it)
        self.passes = 0           # passes begun over the loader's own batch sampler (poisson_sampling=False)
        self.iterated = False     # the DPDataLoader itself has handed a batch to the loop (not a loader re-made
                                  # over its batch sampler, as accelerate's prepare does)

    def take_yielded(self) -> list[Chunk]:
        chunks, self.yielded = self.yielded, []
        return chunks


class ChunkedBatchSampler(Sampler):
    """Splits each logical batch of ``logical`` into chunks of at most ``max_physical_batch_size``.

    An empty logical batch becomes one empty chunk, so the loop still runs a (noise-only) step.
    With several processes, every rank yields as many chunks as the rank with the largest draw,
    because DDP needs the same number of forward and backward calls everywhere: a rank whose own
    examples run out yields padding chunks of one stand-in row (example 0) whose loss the
    controller weighs by 0 (models need not accept empty batches). ``pad_ranks=False`` turns this
    off for a caller that equalises the ranks itself (DPTrainer).
    """

    def __init__(self, logical, max_physical_batch_size: int | None, tracker: BatchTracker, pad_ranks: bool = True):
        if max_physical_batch_size is not None and (not isinstance(max_physical_batch_size, int)
                                                    or max_physical_batch_size < 1):
            raise ValueError(f"max_physical_batch_size must be an integer >= 1, 'auto' or None, got "
                             f"{max_physical_batch_size!r}")
        self.logical, self.max_physical, self.tracker = logical, max_physical_batch_size, tracker
        self.pad_ranks = pad_ranks

    def __len__(self):
        return len(self.logical)  # the number of logical batches (= optimizer steps) per epoch

    def __iter__(self):
        poisson = isinstance(self.logical, PoissonBatchSampler)
        pass_index = None
        if poisson:
            batches = self.logical.with_positions()
        else:
            batches = ((None, indices) for indices in self.logical)
            pass_index, self.tracker.passes = self.tracker.passes, self.tracker.passes + 1
        for position, indices in batches:
            rate = self.logical.rate_at(position[0]) if poisson else None
            expected = rate * self.logical.num_samples if poisson else None
            indices = list(indices)
            distributed = self.pad_ranks and position is not None and self.logical.world_size > 1
            largest = max(self.logical.sizes_on_all_ranks(*position, len(indices))) if distributed else len(indices)
            size = self.max_physical or max(1, largest)
            count = max(1, math.ceil(largest / size))
            logical_id = self.tracker.logical_batches
            self.tracker.logical_batches += 1
            for index in range(count):
                rows = indices[index * size:(index + 1) * size]
                padding = distributed and not rows
                self.tracker.pending.append(Chunk(logical_id, index, count, len(indices), position, padding,
                                                  rate, expected, pass_index, 1 if padding else len(rows)))
                yield [0] if padding else rows


def empty_like_batch(batch):
    """The same structure with zero rows: tensors and arrays sliced to [:0], batched lists emptied."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({k: empty_like_batch(v) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = [empty_like_batch(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        if batch and all(isinstance(v, (torch.Tensor, np.ndarray, Mapping, tuple, list)) for v in batch):
            return [empty_like_batch(v) for v in batch]
        return []
    raise TypeError(f"cannot build an empty batch for an element of type {type(batch).__name__}; "
                    "give the data loader a collate_fn that accepts an empty list of examples")


class EmptyBatchCollate:
    """Wraps a collate_fn so that an empty list of examples gives an empty batch of the usual structure."""

    def __init__(self, collate_fn, dataset):
        self.collate_fn, self.dataset = collate_fn or default_collate, dataset

    def __call__(self, examples):
        if examples:
            return self.collate_fn(examples)
        try:
            return self.collate_fn(examples)
        except Exception:
            return empty_like_batch(self.collate_fn([self.dataset[0]]))


class DPDataLoader(DataLoader):
    """A DataLoader over physical chunks of logical batches, reporting each chunk to a BatchTracker.

    The chunk of every batch it yields is recorded as it reaches the training loop (not when
    the sampler made it, which runs ahead with worker prefetching), so the optimizer knows
    when a logical batch is complete.
    """

    def __init__(self, dataset, logical_batches, *, max_physical_batch_size=None, tracker=None,
                 collate_fn=None, controller=None, pad_ranks=True, **loader_kwargs):
        self.tracker = tracker or BatchTracker()
        self.controller = controller  # told which chunks are padding (set by make_private)
        self.logical_batches = logical_batches
        # Each iterator draws its workers' base seed from this generator, not from torch's global one,
        # so that starting an epoch does not shift the model's dropout masks: a run resumed from a
        # checkpoint then replays them exactly once the global RNG state is restored.
        if loader_kwargs.get("generator") is None:
            loader_kwargs["generator"] = torch.Generator().manual_seed(0)
        super().__init__(dataset, batch_sampler=ChunkedBatchSampler(logical_batches, max_physical_batch_size,
                                                                    self.tracker, pad_ranks),
                         collate_fn=EmptyBatchCollate(collate_fn, dataset), **loader_kwargs)
        # Where to resume: the logical batch after the last one the loop received in full.
        self.position = None
        if isinstance(logical_batches, PoissonBatchSampler):
            self.position = (logical_batches.epoch, logical_batches.next_batch)

    def __iter__(self):
        self.tracker.pending.clear()
        if self.position is not None:  # batches drawn ahead (prefetch) but never used are drawn again
            self.logical_batches.load_state_dict({"epoch": self.position[0], "next_batch": self.position[1]})
        for batch in super().__iter__():
            chunk = self.tracker.pending.popleft()
            self.tracker.yielded.append(chunk)
            self.tracker.iterated = True
            if self.controller is not None:
                self.controller.ledger.mark_next_loss(padding=chunk.padding)
                self.controller.ledger.mark_next_batch(chunk.size)
            if chunk.is_last and chunk.position is not None:
                self.position = self.logical_batches.position_after(chunk.position)
            yield batch

    @property
    def max_physical_batch_size(self):
        return self.batch_sampler.max_physical

    def set_max_physical_batch_size(self, size: int) -> None:
        """Change the physical batch (``max_physical_batch_size="auto"``); takes effect at the next iterator."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"max_physical_batch_size must be an integer >= 1, got {size!r}")
        self.batch_sampler.max_physical = size

    def state_dict(self) -> dict:
        if self.position is None:
            return {}
        return {"epoch": self.position[0], "next_batch": self.position[1]}

    def load_state_dict(self, state: dict) -> None:
        if state and self.position is not None:
            self.position = (int(state["epoch"]), int(state["next_batch"]))
            self.logical_batches.load_state_dict(state)
