"""Weight-plane errors (a module of their own so every transport module can raise them)."""

from __future__ import annotations

from composer_mesh.errors import UserInputError


class WeightPlaneError(RuntimeError):
    """Base class of weight-plane failures."""


class ManifestMismatchError(WeightPlaneError, ValueError):
    """The published tensors do not match what this side expects (names, shapes or dtypes)."""


class StaleVersionError(WeightPlaneError):
    """The requested version was overwritten before it could be read and `allow_newer` is off."""


class TornReadError(WeightPlaneError):
    """Every retry overlapped a publish; no consistent version could be read."""


class WeightTransferError(WeightPlaneError):
    """A read (RDMA, shared memory, CUDA IPC or endpoint) failed or timed out."""


class TransportUnavailableError(WeightPlaneError):
    """A forced transport (`shm`, `cuda_ipc`, ...) cannot work between this publisher and subscriber;
    the message says why (other host, private /dev/shm, weights on the wrong device, ...)."""


class TransportRequiredError(TransportUnavailableError, UserInputError):
    """The transport a subscriber would use is not one `weights.require` allows: the run's setting, so the
    command line prints it as its one line (subscriber, transport, why it was chosen, what is required)."""
