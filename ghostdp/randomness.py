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

import math
import os
import secrets
import zlib

import numpy as np
import torch

_NOISE_STREAM, _SAMPLING_STREAM = 1, 2


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
        self._generators = {}
        if noise_generator is not None:
            if not isinstance(noise_generator, torch.Generator):
                raise TypeError(f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}")
            self._generators[torch.device(noise_generator.device)] = noise_generator

    def _generator(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        if device not in self._generators:
            entropy = [self.seed, _NOISE_STREAM, zlib.crc32(str(device).encode())]
            seed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def gaussian_like(self, tensor: torch.Tensor, std: float) -> torch.Tensor:
        """N(0, std^2) noise of tensor's shape and device, in float32 or wider."""
        dtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
        if self.secure:
            values = torch.from_numpy(secure_normal(tensor.numel())).reshape(tensor.shape)
            return (values * std).to(device=tensor.device, dtype=dtype)
        return torch.normal(0.0, std, size=tensor.shape, generator=self._generator(tensor.device),
                            device=tensor.device, dtype=dtype)

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
        for device, gen_state in state["generators"].items():
            self._generator(torch.device(device)).set_state(gen_state)
