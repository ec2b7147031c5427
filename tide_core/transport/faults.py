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
from collections.abc import Iterable
from dataclasses import dataclass

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"


class Site(enum.Enum):
    """Labelled operations of a recorded call: where faults strike."""

    AG_READY = "all-gather readiness signal to node peers, and the waits for it"
    AG_PUSH = "all-gather push to a node peer"
    AG_COMPLETION = "all-gather completion signal"  # "done e" and, multi-node, "scattered e" to node peers
    RS_CREDIT_WAIT = "reduce-scatter wait for a staging slot's credit"
    RS_PUSH = "reduce-scatter push into a staging slot"
    RS_ARRIVAL = "reduce-scatter arrival signal of a staged piece, and the owner's wait for it"
    RS_SUM = "reduce-scatter Level-1 sum kernel"
    RS_CREDIT = "reduce-scatter staging credit"
    RS_INBOX = "reduce-scatter inbox-arrival relay to a node peer, and its wait"
    RS_LANDING = "reduce-scatter Level-2 landing sum"
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


@dataclass(frozen=True)
class DropCopy(Fault):
    """The ``occurrence``-th copy operation labelled ``site`` (AG_PUSH, RS_PUSH or RAIL_PUT) is not
    issued in every call: its contributions never land (invariant I1)."""

    site: Site
    occurrence: int = 0

    def edit(self, labelled, call):
        hits = [i for i, (site, _) in enumerate(labelled) if site is self.site]
        drop = hits[self.occurrence] if self.occurrence < len(hits) else None
        return [pair for i, pair in enumerate(labelled) if i != drop]


@dataclass(frozen=True)
class CountTwice(Fault):
    """Reduce-scatter Level-1 sums add their first staged peer twice: a contributor lands twice (I1)."""

    def edit(self, labelled, call):
        out = []
        for site, op in labelled:
            if site is Site.RS_SUM and op[3]:
                kind, stream, dst, staged, *rest = op
                op = (kind, stream, dst, [staged[0], *staged], *rest)
            out.append((site, op))
        return out


@dataclass(frozen=True)
class ReleaseInputsEarly(Fault):
    """A call's completion no longer covers this rank's reads of its inputs (I2): the reduce-scatter's
    "pushed" event is recorded before its pushes, the all-gather's done event stops waiting for the
    push lanes. The caller may then refill or free gradients and shards the copy engines still read."""

    def edit(self, labelled, call):
        ops = [op for _, op in labelled]
        if call.collective == REDUCE_SCATTER:  # outputs: [record(push stream), record(sum stream)]
            pushed = len(ops) - 2
            stream = ops[pushed][1]
            first = next(i for i, op in enumerate(ops) if op[1] is stream)
            order = list(range(first + 1)) + [pushed] + [i for i in range(first + 1, len(ops)) if i != pushed]
            return [labelled[i] for i in order]
        # all-gather: the event recorded right after the completion signal marks the lanes' pushes done
        signal = min(i for i, (site, _) in enumerate(labelled) if site is Site.AG_COMPLETION)
        pushed = ops[signal + 1][2]
        return [(site, op) for site, op in labelled if not (op[0] == "wait_event" and op[2] == pushed)]


@dataclass(frozen=True)
class PushBeforeReady(Fault):
    """All-gather lanes push without waiting for the peers' readiness: a landing is rewritten while
    its previous consumer may still read it (I3)."""

    def edit(self, labelled, call):
        ready_waits = {
            i - 1
            for i, (site, op) in enumerate(labelled)
            if site is Site.AG_PUSH
            and i
            and labelled[i - 1][0] is Site.AG_READY
            and labelled[i - 1][1][0] == "wait_flags"
            and labelled[i - 1][1][1] is op[1]
        }
        return [pair for i, pair in enumerate(labelled) if i not in ready_waits]


@dataclass(frozen=True)
class PushesBeforeSums(Fault):
    """The reduce-scatter enqueues all of a call's pushes (and their credit waits) before any sum:
    the order the transport had before waits were made to target earlier-enqueued producers (I4).
    Each stream's own order is kept, so with a hardware queue per stream it still completes; with
    one shared queue a credit wait blocks the sums its peers wait for, and every rank deadlocks."""

    def edit(self, labelled, call):
        pushes = {id(op[1]) for site, op in labelled if site is Site.RS_PUSH}
        if not pushes:
            return labelled
        start = next(i for i, (_, op) in enumerate(labelled) if op[0] == "record")
        moved = [pair for pair in labelled[start + 1 :] if id(pair[1][1]) in pushes]
        rest = [pair for pair in labelled[start + 1 :] if id(pair[1][1]) not in pushes]
        return labelled[: start + 1] + moved + rest


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
