"""The states of the global random generators that a forward or a backward draws from."""
from __future__ import annotations

import torch


def random_states(*devices) -> list:
    """(device, state) of the CPU generator (device None) and of each accelerator among ``devices`` that has a
    generator of its own (CPU devices among them add nothing)."""
    states = [(None, torch.default_generator.get_state())]
    for device in dict.fromkeys(d for d in devices if d.type != "cpu"):
        try:
            read = torch.get_device_module(device.type).get_rng_state
        except (AttributeError, RuntimeError):  # a backend without a global generator of its own
            continue
        states.append((device, read(device)))
    return states


def restore_random_states(states: list) -> None:
    """Sets the generators back to ``states`` (random_states)."""
    for device, state in states:
        if device is None:
            torch.default_generator.set_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)


def same_random_states(a: list, b: list) -> bool:
    """Whether two random_states of the same devices are equal (no generator drew in between)."""
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))
