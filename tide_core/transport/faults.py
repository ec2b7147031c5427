"""Fault injection: typed protocol violations applied to a transport's recorded calls (for tests).

The CUDA transport records each call once (``tide_core.runtime.program``) and labels its protocol
operations with a ``Site``. A ``Fault`` edits the labelled recording of each call it strikes (a
signal, credit or wait dropped, ...) or the flag base the call is replayed with. The transport
compiles each distinct edit once and replays it like any recorded call, so the fault matrix runs
the record-once/replay path that production runs; calls a fault does not strike replay the
unedited program.

A new kind is a frozen dataclass deriving from ``Fault`` that overrides ``drops`` (remove
operations), ``edit`` (any change to the labelled operations) or ``base`` (the call's flag base);
a site it needs that is not labelled yet gets a ``Site`` member and a ``with dev.at(site):`` block
where the transport records it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"


class Site(enum.Enum):
    """Labelled operations of a recorded call: where faults strike."""

    AG_PUSH = "all-gather push to a node peer"
    AG_COMPLETION = "all-gather completion signal"  # "done e" and, multi-node, "scattered e" to node peers
    RS_CREDIT_WAIT = "reduce-scatter wait for a staging slot's credit"
    RS_PUSH = "reduce-scatter push into a staging slot"
    RS_SUM = "reduce-scatter sum kernel"
    RS_CREDIT = "reduce-scatter staging credit"
    RAIL_PUT = "rail put"
    RAIL_DATA = "rail data signal"
    RAIL_CREDIT_WAIT = "rail wait for a stage or inbox credit"
    RAIL_CREDIT = "rail credit, and the inbox read reports a credit waits for"


@dataclass(frozen=True)
class Call:
    """The call a fault is asked about."""

    collective: str  # ALL_GATHER or REDUCE_SCATTER
    number: int  # 1-based count of this collective's calls on the transport
    base: int  # the flag base it is replayed with: all-gather epoch (= number), reduce-scatter first chunk

    def value(self, op: tuple) -> int:
        """The flag value a ``write_flags`` / ``wait_flags`` operation carries in this call."""
        kind, _stream, _addresses, relative = op
        if kind not in ("write_flags", "wait_flags"):
            raise ValueError(f"a {kind} operation carries no flag value")
        return self.base + relative


@dataclass(frozen=True)
class Fault:
    """One protocol violation; the base class changes nothing."""

    def edit(self, labelled: list[tuple], call: Call) -> list[tuple]:
        """The call's (site, op) pairs with the fault applied; keep every ``record`` operation."""
        return [(site, op) for site, op in labelled if not self.drops(site, op, call)]

    def drops(self, site: Site | None, op: tuple, call: Call) -> bool:
        return False

    def base(self, call: Call) -> int:
        return call.base


@dataclass(frozen=True)
class SkipCompletion(Fault):
    """All-gather calls ``calls``: the completion signals to node peers are not written."""

    calls: frozenset[int]

    def drops(self, site, op, call) -> bool:
        return call.collective == ALL_GATHER and site is Site.AG_COMPLETION and call.number in self.calls


@dataclass(frozen=True)
class DropStagingCredits(Fault):
    """Reduce-scatter staging credits of chunk ``from_chunk`` and later are never returned. Credits
    are cumulative, so a single lost credit followed by a newer one is harmless by design."""

    from_chunk: int

    def drops(self, site, op, call) -> bool:
        return site is Site.RS_CREDIT and call.value(op) > self.from_chunk  # chunk q's credit carries q + 1


@dataclass(frozen=True)
class ReuseStagingEarly(Fault):
    """Reduce-scatter pushes into a staging slot do not wait for its credit (its sum may still read it)."""

    def drops(self, site, op, call) -> bool:
        return site is Site.RS_CREDIT_WAIT


@dataclass(frozen=True)
class SkipRailSignal(Fault):
    """Calls ``calls`` (of either collective): the rail data signals are not sent."""

    calls: frozenset[int]

    def drops(self, site, op, call) -> bool:
        return site is Site.RAIL_DATA and call.number in self.calls


@dataclass(frozen=True)
class DropRailCredits(Fault):
    """From call ``from_call`` on (either collective), rail credits (all-gather stage areas,
    reduce-scatter inbox blocks) are never returned."""

    from_call: int

    def drops(self, site, op, call) -> bool:
        return site is Site.RAIL_CREDIT and call.number >= self.from_call


@dataclass(frozen=True)
class ReuseRailEarly(Fault):
    """Rail puts do not wait for the receiver's credit (its stage or inbox block may still be read)."""

    def drops(self, site, op, call) -> bool:
        return site is Site.RAIL_CREDIT_WAIT


@dataclass(frozen=True)
class ReorderCalls(Fault):
    """All-gather calls ``call`` and ``call + 1`` carry each other's epoch: node peers see this rank's
    calls in the wrong order."""

    call: int

    def base(self, call: Call) -> int:
        if call.collective != ALL_GATHER:
            return call.base
        return call.base + {self.call: 1, self.call + 1: -1}.get(call.number, 0)


class Faults:
    """The faults injected into one transport; empty (false) in production."""

    def __init__(self, faults: Iterable[Fault] = ()):
        self.faults = tuple(faults)
        for fault in self.faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"faults must be tide_core.transport.faults.Fault objects, got {fault!r}")

    def __bool__(self) -> bool:
        return bool(self.faults)

    def __repr__(self) -> str:
        return f"Faults{self.faults!r}"

    def apply(self, labelled: list[tuple], call: Call) -> tuple[list[tuple] | None, int]:
        """(the call's edited (site, op) pairs, or None where no fault changes them; its flag base)."""
        for fault in self.faults:
            call = Call(call.collective, call.number, fault.base(call))
        edited = labelled
        for fault in self.faults:
            edited = fault.edit(edited, call)
        return (None if edited == labelled else edited), call.base
