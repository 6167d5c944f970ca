"""The states of the random generators that a forward or a backward draws from: torch's global ones, NumPy's and
Python's global ones (transformers' wav2vec2 family draws its LayerDrop and SpecAugment masks from NumPy's in
training, BigBird its random attention blocks), and those a model's modules hold themselves (peft's PVeRA with a
generator_seed samples its noise from one of its own)."""
from __future__ import annotations

import random

import numpy as np
import torch

NUMPY, PYTHON = "numpy", "python"  # the keys of NumPy's and Python's global generators in random_states


def random_states(*devices, generators=()) -> list:
    """(key, state) of torch's CPU generator (key None), of NumPy's and Python's global generators (NUMPY, PYTHON),
    of each of ``generators`` (own_generators: a model's own; the generator itself the key), and of each accelerator
    among ``devices`` that has a generator of its own (the device the key; CPU devices among them add nothing)."""
    states = [(None, torch.default_generator.get_state()), (NUMPY, np.random.get_state()), (PYTHON, random.getstate())]
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
    for key, state in states:
        if key is None:
            torch.default_generator.set_state(state)
        elif key is NUMPY:
            np.random.set_state(state)
        elif key is PYTHON:
            random.setstate(state)
        elif isinstance(key, torch.Generator):
            key.set_state(state)
        else:
            torch.get_device_module(key.type).set_rng_state(state, key)


def same_random_states(a: list, b: list) -> bool:
    """Whether two random_states of the same generators are equal (no generator drew in between)."""
    return len(a) == len(b) and all(x[0] == y[0] and _same_state(x[0], x[1], y[1]) for x, y in zip(a, b))


def _same_state(key, a, b) -> bool:
    if key is NUMPY:  # ('MT19937', keys, position, has_gauss, cached_gaussian)
        return np.array_equal(a[1], b[1]) and a[:1] + a[2:] == b[:1] + b[2:]
    if key is PYTHON:
        return a == b
    return torch.equal(a, b)


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
