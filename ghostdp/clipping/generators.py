"""The states of the global random generators that a forward or a backward on a device draws from."""
from __future__ import annotations

import torch


def random_states(device) -> list:
    """The CPU generator's state and, for an accelerator, the device's."""
    states = [torch.default_generator.get_state()]
    if device.type != "cpu":
        try:
            read = torch.get_device_module(device.type).get_rng_state
        except (AttributeError, RuntimeError):  # a backend without a global generator of its own
            return states
        states.append(read(device))
    return states


def restore_random_states(device, states: list) -> None:
    """Sets the generators back to ``states`` (random_states on the same device)."""
    torch.default_generator.set_state(states[0])
    if len(states) > 1:
        torch.get_device_module(device.type).set_rng_state(states[1], device)
