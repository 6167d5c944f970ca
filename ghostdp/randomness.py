"""Where DP randomness comes from: seeded generators (reproducible) or OS entropy (secure_mode).

Default mode: noise from a ``torch.Generator`` per device and Poisson sampling from numpy
generators keyed by (seed, rank, epoch, batch), so every draw is reproducible from the seed
and the position, and a resumed run draws exactly what an uninterrupted one would.

secure_mode: both come from ``os.urandom``. Gaussians use Box-Muller in float64, and each noise
value is (n1 + n2 + n3 + n4) / 2 of four such normals, which is again N(0, 1) but hides the
low-order bits that floating-point attacks on a single sample exploit (the mitigation Opacus
uses). This is much slower than the default, and its draws cannot be replayed.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

_NOISE_STREAM, _SAMPLING_STREAM = 1, 2
NOISE_BLOCK = 1 << 18     # CPU: noise values drawn per call, into a reused scratch buffer (1 MB in float32)
ACCELERATOR_NOISE_BLOCK = 1 << 22  # GPU: larger blocks, fewer kernel launches (a 16 MB float32 scratch)
CPU_NOISE_STREAMS = 4     # a large CPU tensor's blocks come from this many sub-streams, in parallel
MAX_NOISE_LAYOUTS = 16    # (scratch buffer, gradient shapes) pairs whose views a RandomSource keeps
SHARD_STREAMS = 1 << 16   # stream numbers of the noise of rank r's gradient shards start at SHARD_STREAMS * (r + 1)


_NOISE_THREADS = None


def _noise_threads() -> ThreadPoolExecutor:
    global _NOISE_THREADS
    if _NOISE_THREADS is None:
        _NOISE_THREADS = ThreadPoolExecutor(max_workers=min(CPU_NOISE_STREAMS, max(1, torch.get_num_threads())),
                                            thread_name_prefix="ghostdp-noise")
    return _NOISE_THREADS


def secure_uniform(n: int) -> np.ndarray:
    """n uniforms in (0, 1) with 53 random bits each, from the OS entropy source."""
    bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) * 2.0 ** -53


def secure_normal(n: int) -> np.ndarray:
    def box_muller(k):
        u1, u2 = secure_uniform(k), secure_uniform(k)
        return np.sqrt(-2 * np.log(u1)) * np.cos(2 * math.pi * u2)
    return box_muller(4 * n).reshape(4, n).sum(0) / 2


class RandomSource:
    """The engine's randomness: Gaussian noise for gradients and uniforms for Poisson sampling."""

    def __init__(self, secure: bool = False, seed: int | None = None, noise_generator=None):
        if secure and (seed is not None or noise_generator is not None):
            raise ValueError("secure_mode draws from OS entropy and cannot be seeded; drop seed / "
                             "noise_generator, or use secure_mode=False for reproducible runs")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.secure = secure
        self.seed = None if secure else (seed if seed is not None else secrets.randbits(63))
        # Noise streams by key: the device ("cuda:1"), or only its type ("cuda") once the streams are
        # shared across ranks, where each rank's copy of a parameter lives on its own device.
        self.shared_across_ranks = False
        self._scratch = {}
        self._pieces = {}  # (id(scratch), layout) -> the scratch's views per block (_scratch_pieces)
        self._generators = {}
        if noise_generator is not None:
            if not isinstance(noise_generator, torch.Generator):
                raise TypeError(f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}")
            self._generators[str(torch.device(noise_generator.device))] = noise_generator
        self._user_generator = noise_generator is not None

    def _stream_key(self, device: torch.device) -> str:
        return device.type if self.shared_across_ranks else str(device)

    def _generator(self, device: torch.device, stream: int = 0) -> torch.Generator:
        device = torch.device(device)
        key = self._stream_key(device) + (f"#{stream}" if stream else "")
        if key not in self._generators:
            entropy = [self.seed, _NOISE_STREAM, zlib.crc32(self._stream_key(device).encode())] + (
                [stream] if stream else [])
            seed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))
            self._generators[key] = torch.Generator(device=device).manual_seed(seed)
        generator = self._generators[key]
        if torch.device(generator.device) != device:
            # Two devices of one type on a rank would share one stream: identical noise twice.
            raise RuntimeError(
                f"parameters on {generator.device} and {device} would draw noise from one stream, which "
                "makes their noise identical. With several processes, keep each process's trainable "
                "parameters on one device of each type (one GPU per process).")
        return generator

    def agree_across_ranks(self, seed_given: bool, sharded_only: bool = False) -> None:
        """Make every process draw the same noise and sampling streams (collective; call on every rank).

        DDP averages the ranks' clipped sums, so each rank adds the same noise draw: the noise is
        then added once. The seed is rank 0's; a seed given by the user must be the same everywhere.
        ``sharded_only``: every trained parameter is sharded (FSDP2), so each rank adds the noise of the
        shards it owns from its own stream (``add_gaussian_(..., shard_of_rank=r)``) and secure_mode works.
        """
        import torch.distributed as dist
        if self.secure and sharded_only:
            return  # each rank draws its own shards' noise from OS entropy: nothing to share
        if self.secure:
            raise NotImplementedError(
                "secure_mode with several processes is not supported: OS entropy differs on every rank, so "
                "the ranks cannot add one shared noise draw. Use secure_mode=False (seeded streams), or train "
                "in one process.")
        seeds = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, (self.seed, bool(seed_given)))
        given = {seed for seed, was_given in seeds if was_given}
        if given and (len(given) > 1 or not all(was_given for _, was_given in seeds)):
            raise ValueError(
                f"the processes were given different seeds ({sorted(str(s) for s, _ in seeds)}); every rank "
                "must add the same noise draw, so pass the same seed on every rank (or none: rank 0's is used).")
        self.seed = seeds[0][0]
        self.shared_across_ranks = True
        self._generators = {key.split(":")[0]: g for key, g in self._generators.items()}

    def gaussian_like(self, tensor: torch.Tensor, std: float) -> torch.Tensor:
        """N(0, std^2) noise of tensor's shape and device, in float32 or wider."""
        dtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
        if self.secure:
            values = torch.from_numpy(secure_normal(tensor.numel())).reshape(tensor.shape)
            return (values * std).to(device=tensor.device, dtype=dtype)
        return torch.normal(0.0, std, size=tensor.shape, generator=self._generator(tensor.device),
                            device=tensor.device, dtype=dtype)

    @torch.no_grad()
    def add_gaussian_(self, tensors, std: float, divisor: float = 1.0, shard_of_rank: int | None = None) -> None:
        """Each tensor <- (tensor + N(0, std^2) noise) / divisor, the noise drawn in float32 or wider.

        ``shard_of_rank``: the tensors are rank r's shards of sharded gradients (FSDP2), which no other
        rank holds: their noise comes from streams of rank r's own, so that no two shards get the same
        draw (the shared stream would give every rank's shard identical noise).

        ``tensors``: one tensor or a sequence (a model's gradients). Tensors that share a device and
        a noise dtype draw their noise as one stream over their concatenation, in order, and take it
        with one foreach add per block: a few kernel launches per step instead of several per tensor.
        The draws go block by block through reused scratch buffers (a fresh model-sized noise tensor
        each step costs as much again in page faults on CPU): NOISE_BLOCK elements on CPU,
        ACCELERATOR_NOISE_BLOCK elsewhere. A concatenation of at most one block gets exactly the
        values of ``gaussian_like`` of its size. On CPU, without a user-supplied generator, the blocks
        of a larger one are drawn by CPU_NOISE_STREAMS threads, block j from sub-stream j mod
        CPU_NOISE_STREAMS: one CPU generator is serial, and the fixed assignment keeps the draws
        independent of the number of threads. secure_mode draws the concatenation from OS entropy.
        """
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        groups = {}
        for t in tensors:
            if not t.is_contiguous():  # rare (p.grad is contiguous): its own draw, then copied back
                flat = t.contiguous()
                self.add_gaussian_([flat], std, divisor, shard_of_rank)
                t.copy_(flat)
                continue
            dtype = t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32
            groups.setdefault((t.device, dtype), []).append(t)
        first_stream = 0 if shard_of_rank is None else SHARD_STREAMS * (shard_of_rank + 1)
        for (device, dtype), targets in groups.items():
            self._add_to_concatenation(targets, device, dtype, std, divisor, first_stream)

    def _add_to_concatenation(self, tensors, device, dtype, std, divisor, first_stream=0):
        shapes = tuple([t.shape for t in tensors])
        cpu = device.type == "cpu"
        # On CPU a 0-dim tensor divisor takes the foreach division's vectorised path, where a Python number
        # divides tensor by tensor (2.4x slower over a BERT's 200 gradients); the quotients are the same.
        divide_by = None if divisor == 1.0 else torch.tensor(divisor, dtype=dtype) if cpu else divisor

        def add_block(block, sources):
            """Adds one block of noise (``sources``: its pieces, one per tensor it covers) to those tensors."""
            targets = [tensors[k] if shape is not None else tensors[k].view(-1)[start:stop]
                       for k, start, stop, shape, _, _ in block.pieces]
            torch._foreach_add_(targets, sources)
            if divide_by is not None:  # while the block is in cache: one pass over the tensors, not two
                torch._foreach_div_(targets, divide_by)

        if self.secure:
            for block in noise_blocks(shapes, ACCELERATOR_NOISE_BLOCK):
                noise = torch.from_numpy(secure_normal(block.size) * std).to(device=device, dtype=dtype)
                add_block(block, block.sources(noise))
            return
        block_size = NOISE_BLOCK if cpu else ACCELERATOR_NOISE_BLOCK
        blocks = noise_blocks(shapes, block_size)
        total = sum(block.size for block in blocks)
        parallel = cpu and total > block_size and not self._user_generator
        streams = CPU_NOISE_STREAMS if parallel else 1
        generators = [self._generator(device, first_stream + k) for k in range(streams)]

        def fill(stream):
            scratch = self._scratch_buffer(device, dtype, stream, min(total, block_size))
            pieces = self._scratch_pieces(scratch, shapes, block_size)
            for j in range(stream, len(blocks), streams):
                scratch[:blocks[j].size].normal_(0.0, std, generator=generators[stream])
                add_block(blocks[j], pieces[j])

        if streams == 1 or torch.get_num_threads() == 1:  # the same draws, without handing work to a thread
            for stream in range(streams):
                fill(stream)
            return
        list(_noise_threads().map(fill, range(streams)))

    def _scratch_pieces(self, scratch, shapes, block_size):
        """For each noise block of a concatenation of tensors of ``shapes``, the views of ``scratch`` that its
        tensors take: built once per scratch buffer and layout (about 200 views a step for a BERT)."""
        key = (id(scratch), shapes, block_size)  # a buffer's entries go when it is replaced (_scratch_buffer)
        pieces = self._pieces.get(key)
        if pieces is None:
            if len(self._pieces) >= MAX_NOISE_LAYOUTS:
                self._pieces.clear()
            pieces = self._pieces[key] = [b.sources(scratch) for b in noise_blocks(shapes, block_size)]
        return pieces

    def _scratch_buffer(self, device, dtype, stream, size):
        scratch = self._scratch.get((device, dtype, stream))
        if scratch is None or scratch.numel() < size:
            if scratch is not None:  # its views would keep the replaced buffer alive
                self._pieces = {key: views for key, views in self._pieces.items() if key[0] != id(scratch)}
            scratch = torch.empty(size, device=device, dtype=dtype)
            self._scratch[(device, dtype, stream)] = scratch
        return scratch

    def sampling_uniform(self, n: int, key) -> np.ndarray:
        """n uniforms for the Poisson draw of batch ``key`` = (rank, epoch, batch)."""
        if self.secure:
            return secure_uniform(n)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, _SAMPLING_STREAM, *key])))
        return rng.random(n)

    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {"secure": False, "seed": self.seed,
                "generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["secure"] != self.secure:
            raise ValueError("this state was saved with secure_mode="
                             f"{state['secure']}, but the engine has secure_mode={self.secure}")
        if self.secure:
            return
        self.seed = state["seed"]
        for key, gen_state in state["generators"].items():
            base, _, stream = key.partition("#")
            if self.shared_across_ranks:
                base = base.split(":")[0]
                key = base + (f"#{stream}" if stream else "")
            if key not in self._generators:
                device = torch.device(base)
                if device.type != "cpu" and device.index is None:
                    device = torch.device(device.type, torch.get_device_module(device.type).current_device())
                self._generator(device, int(stream or 0))
            self._generators[key].set_state(gen_state)


class NoiseBlock(NamedTuple):
    """One block of a concatenation's noise: its ``size`` and its ``pieces``, (tensor k, start, stop in
    tensor k flattened, tensor k's shape where the block covers all of it (else None), start, stop in the
    block) for each tensor it covers."""
    size: int
    pieces: tuple

    def sources(self, noise: torch.Tensor) -> list:
        """The block's values ``noise`` split into its pieces, each shaped as the part of its tensor it covers
        (a whole tensor is added to as it is, without a flat view of it)."""
        return [noise[a:b] if shape is None else noise[a:b].view(shape) for _, _, _, shape, a, b in self.pieces]


@functools.lru_cache(maxsize=64)
def noise_blocks(shapes: tuple, block_size: int) -> tuple:
    """The blocks of block_size values (the last one shorter) that cover the concatenation of tensors of
    ``shapes``, in order."""
    sizes = [shape.numel() for shape in shapes]
    total = sum(sizes)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    blocks = []
    for lo in range(0, total, block_size):
        hi = min(lo + block_size, total)
        pieces = []
        for k in range(bisect.bisect_right(starts, lo) - 1, len(sizes)):
            start, n = starts[k], sizes[k]
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                pieces.append((k, a - start, b - start, shapes[k] if b - a == n else None, a - lo, b - lo))
        blocks.append(NoiseBlock(hi - lo, tuple(pieces)))
    return tuple(blocks)
