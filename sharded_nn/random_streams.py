"""Random draws on sharded tensors that follow the single-device law.

A random tensor in a domain-parallel model is one of two kinds, and each needs its own stream:

- a *replicated* value (a drop-path decision per sample, a channel-dropout mask, dropout on
  pooled features): every domain rank holds the whole tensor, so every rank must draw the same
  numbers, or the ranks compute different models (a sample dropped on one slab and kept on the
  next);
- a *slab* (element-wise dropout of activations): its elements are independent in the
  single-device model, so the ranks' draws must be independent too. Ranks seeded alike by the
  user (the usual data-parallel practice) would otherwise draw the same mask on every slab.

``RandomStreams`` keeps one generator per *key*: the ranks' coordinates on the domain axes that
shard the random tensor (-1 for the axes it is replicated over). Ranks that hold the same part
of the tensor share a key and so draw the same numbers, in the same order (every rank makes the
same calls: SPMD); ranks holding different parts draw independently. ``run_seeded`` runs a torch
random call (dropout and friends take no ``generator``) with the device's default generator
seeded from the stream, and restores the user's generator state afterwards, so the law and the
kernel are torch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["RandomStreams", "run_seeded"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK62 = (1 << 62) - 1


class RandomStreams:
    """Generators for random tensors of one forward, keyed by the coordinates they vary along.

    Args:
        seed: the common seed, identical on every domain rank (e.g. domain rank 0's draw).
        coords: this rank's coordinate on each domain axis.
    """

    def __init__(self, seed: int, coords: Sequence[int]) -> None:
        self.seed = int(seed) & _MASK62
        self.coords = tuple(int(c) for c in coords)
        self._gens: dict[tuple[int, ...], torch.Generator] = {}

    def key(self, sharded_axes: Sequence[bool]) -> tuple[int, ...]:
        """The key of a tensor sharded by the axes flagged True (replicated over the others)."""
        return tuple(c if s else -1 for c, s in zip(self.coords, sharded_axes))

    def next_seed(self, key: tuple[int, ...]) -> int:
        """A fresh seed from the stream of ``key`` (the same on every rank holding that key)."""
        gen = self._gens.get(key)
        if gen is None:
            mixed = self.seed
            for k in key:
                mixed = ((mixed ^ (k + 2)) * _GOLDEN + 0x632BE59BD9B4E019) & _MASK62
            gen = self._gens[key] = torch.Generator().manual_seed(mixed)
        return int(torch.randint(0, _MASK62, (1,), generator=gen).item())

    def snapshot(self) -> RandomStreams:
        """A copy whose streams continue from where this one's are now (for a recomputation)."""
        copy = RandomStreams(self.seed, self.coords)
        for key, gen in self._gens.items():
            copy._gens[key] = torch.Generator().set_state(gen.get_state())
        return copy


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    mod = getattr(torch, device.type, None)
    gens = getattr(mod, "default_generators", None)
    if gens:
        return gens[device.index or 0]
    raise NotImplementedError(f"random draws on sharded tensors: no default generator known for device {device}.")


def run_seeded(func: Callable, args, kwargs, seed: int, device: torch.device):
    """``func(*args, **kwargs)`` with ``device``'s default generator seeded by ``seed``; the
    generator's previous state is restored afterwards (the caller's stream is not consumed)."""
    gen = _default_generator(device)
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        return func(*args, **kwargs)
    finally:
        gen.set_state(state)
