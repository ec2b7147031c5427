"""Exceptions raised by TIDE. They live at the bottom of the layer stack so every layer can use them."""


class TIDEError(Exception):
    """Base class of every error TIDE raises on purpose."""


class PlanError(TIDEError, ValueError):
    """A plan cannot be built or is unsafe (bad shapes, topology, wave width, ...)."""


class RankMismatchError(TIDEError, RuntimeError):
    """Ranks disagree on something they must agree on (shapes, dtypes, topology, options).

    Raised on every rank; the message names the ranks and the first difference.
    """


class PeerStallTimeout(TIDEError, TimeoutError):
    """A live peer did not take part within ``timeout_s``: fail-stop instead of a silent hang."""


class PeerFailure(TIDEError, RuntimeError):
    """A peer died or its connection broke during a TIDE collective.

    ``collective``, ``group`` and ``peer`` (global rank, None when the backend does not say which)
    name where; the backend's own error is the ``__cause__``.
    """

    def __init__(self, message: str, *, collective: str, group: str, peer: int | None):
        super().__init__(message)
        self.collective = collective
        self.group = group
        self.peer = peer


class GroupUnusableError(TIDEError, RuntimeError):
    """TIDE posts nothing more on a process group where a failed call left sends or receives that
    never completed: their tensors are kept alive, and the group's queues are out of step."""


class TransportError(TIDEError, RuntimeError):
    """A transport cannot run the requested call (missing extension, bad buffers, CUDA error)."""
