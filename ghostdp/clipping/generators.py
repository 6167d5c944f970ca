"""The states of the random generators that a forward or a backward draws from: the global ones, and those a model's
modules hold themselves (peft's PVeRA with a generator_seed samples its noise from one of its own)."""
from __future__ import annotations

import torch


def random_states(*devices, generators=()) -> list:
    """(device, state) of the CPU generator (device None) and of each accelerator among ``devices`` that has a
    generator of its own (CPU devices among them add nothing); then (generator, state) of each of ``generators``
    (own_generators: a model's own)."""
    states = [(None, torch.default_generator.get_state())]
    states += [(g, g.get_state()) for g in generators]
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
        elif isinstance(device, torch.Generator):
            device.set_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)


def same_random_states(a: list, b: list) -> bool:
    """Whether two random_states of the same devices are equal (no generator drew in between)."""
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


_MODULE_STATE = frozenset(vars(torch.nn.Module()))  # torch's own attributes of a module: its parameters, hooks, ...


def own_generators(module) -> list:
    """The torch.Generators that ``module``'s submodules hold as attributes, alone or in a dict, list or tuple (peft's
    PVeRA: one per adapter, in a dict), each once."""
    found = {}
    for m in module.modules():
        for key, value in vars(m).items():
            if key in _MODULE_STATE:
                continue
            if isinstance(value, torch.Generator):
                found[id(value)] = value
            elif isinstance(value, (dict, list, tuple)):
                for g in value.values() if isinstance(value, dict) else value:
                    if isinstance(g, torch.Generator):
                        found[id(g)] = g
    return list(found.values())
