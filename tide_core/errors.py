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
    """A peer did not signal within the configured timeout: fail-stop instead of a silent hang."""


class TransportError(TIDEError, RuntimeError):
    """A transport cannot run the requested call (missing extension, bad buffers, CUDA error)."""
