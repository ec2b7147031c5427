"""Tell a slow peer from a dead one: host heartbeats through the process group's store.

A peer that is late (rank-0-only evaluation, a long checkpoint save) keeps beating; a peer whose
process died or froze stops. Each rank's monitor thread adds 1 to its own counter every
``interval_s``; while a wait of this rank is overdue it also samples its peers' counters, and a
peer whose counter has not moved for ``dead_after_s`` is dead. Sampling only while a wait is
overdue keeps the store (a single server) quiet in the steady state: one small write per rank
per interval.

The GPU path needs this: a dead peer never writes the flags this rank's streams wait on, and
nothing else would notice before ``timeout_s``, which defaults to the process group's (long)
timeout so that slow peers are not killed.

A rank whose transport fails also announces it here before it releases its stuck streams: those
streams then run the rest of their calls, whose signals can complete a peer's wait on data that
never came. The peers learn of the failure from the store (each heartbeat, and at every host
synchronization) and fail too, instead of going on with such results.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch.distributed as dist

KEY = "tide/heartbeat/"
FAILED = "tide/failed/"
FAILURES = "tide/failures"


class PeerMonitor:
    def __init__(self, group: dist.ProcessGroup, peers: list[int], interval_s: float, dead_after_s: float):
        """``peers``: ranks inside ``group`` this rank waits on."""
        self.store = group.get_group_store()
        self.rank = dist.get_rank(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.peers = list(peers)
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.watching = False
        self.store_error: Exception | None = None  # the store is gone (its host died): no verdicts
        self.failed_peer: tuple[int, str, str] | None = None  # (global rank, error type, message) once announced
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last changed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(
            target=_run, args=(weakref.ref(self), self._stop), name="tide-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        self.store.add(KEY + str(self.rank), 1)

    def _sample(self) -> None:
        now = time.monotonic()
        for peer in self.peers:
            value = self.store.add(KEY + str(peer), 0)  # add 0: an atomic read that never blocks
            with self._lock:
                last = self._seen.get(peer)
                if last is None or last[0] != value:
                    self._seen[peer] = (value, now)

    def announce(self, failure: Exception) -> None:
        """Tell the peers this rank's transport failed (best effort: the store may be gone)."""
        try:
            self.store.set(FAILED + str(self.rank), f"{type(failure).__name__}:{failure}")
            self.store.add(FAILURES, 1)
        except Exception as exc:
            self.store_error = exc

    def peer_failure(self) -> tuple[int, str, str] | None:
        """(global rank, error type name, message) of a peer that announced a failure; one store read
        while none did."""
        if self.failed_peer is None and self.store_error is None:
            try:
                if self.store.add(FAILURES, 0):
                    for peer in self.peers:
                        if self.store.check([FAILED + str(peer)]):
                            kind, _, message = self.store.get(FAILED + str(peer)).decode().partition(":")
                            self.failed_peer = (self.global_ranks[peer], kind, message)
                            break
            except Exception as exc:
                self.store_error = exc
        return self.failed_peer

    def _tick(self) -> None:
        self.peer_failure()
        try:
            self._beat()
            if self.watching:
                self._sample()
            else:
                with self._lock:
                    self._seen.clear()  # silence is only measured while a wait is overdue
        except Exception as exc:  # the store's host is gone: no more verdicts; the deadline still holds
            self.store_error = exc
            self._stop.set()

    def dead_peers(self) -> list[int]:
        """Global ranks of peers silent for ``dead_after_s`` while watched."""
        now = time.monotonic()
        with self._lock:
            return [self.global_ranks[p] for p, (_, since) in self._seen.items() if now - since > self.dead_after_s]

    def stop(self) -> None:
        self._stop.set()


def _run(ref: weakref.ref[PeerMonitor], stop: threading.Event) -> None:
    while not stop.is_set():
        monitor = ref()
        if monitor is None:
            return
        monitor._tick()
        interval = monitor.interval_s
        del monitor
        stop.wait(interval)
