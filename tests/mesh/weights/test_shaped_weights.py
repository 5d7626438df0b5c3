"""The weight plane publishes `ShapedWeights` (weights that tell their shapes without being read, and are read
one tensor at a time, as a sharded trainer's are gathered) without ever holding two of them at once: it lays
out its slots from `shapes()` and copies each tensor as it is read. In process, over shared memory."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import ShapedWeights, WeightPublisher, WeightSubscriber


class OneAtATime(Mapping[str, torch.Tensor]):
    """Each read makes a fresh copy (as a gather would); counts how many copies are alive at once."""

    def __init__(self, source: dict[str, torch.Tensor]) -> None:
        self.source, self.reads, self.alive, self.peak = source, 0, 0, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        out = self.source[name].clone()
        self.reads += 1
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(out, self._freed)
        return out

    def _freed(self) -> None:
        self.alive -= 1

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.source.items()}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


async def test_shaped_weights_are_laid_out_unread_and_copied_one_at_a_time() -> None:
    g = torch.Generator().manual_seed(0)
    source = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).double(),
              "c": torch.arange(12, dtype=torch.int64).reshape(3, 4)}
    weights = OneAtATime(source)
    assert isinstance(weights, ShapedWeights)
    publisher = WeightPublisher(weights, WeightPlaneConfig(transport="shm"))
    assert weights.reads == 0  # the layout came from shapes() alone
    manifest = publisher.publish(weights)
    assert weights.reads == len(source) and weights.peak == 1  # each read once, never two alive at once
    subscriber = WeightSubscriber(WeightPlaneConfig(transport="shm"), expected=source)
    await subscriber.pull(manifest)
    got = {name: torch.zeros_like(t) for name, t in source.items()}
    assert subscriber.apply_to(got) == 1
    assert all(torch.equal(got[n], source[n]) for n in source)
    subscriber.close()
    publisher.close()
