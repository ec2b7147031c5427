"""Fail-stop for stalled or dead peers: every tracked completion event has a deadline.

GPU-side waits (stream memory operations) cannot time out by themselves and polling on SMs would
cost the SMs TIDE exists to free, so a host thread watches the completion events instead. When
one misses its deadline (``timeout_s``: a live peer is that late) the transport is marked failed
with PeerStallTimeout; when a peer monitor (``tide_core.runtime.liveness``) reports a peer dead
while an event is overdue, with PeerFailure, long before the deadline. Every later call and wait
raises the failure, and the local flags are released so the stuck streams drain rather than hang
the process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from tide_core.errors import PeerFailure, PeerStallTimeout, TIDEError

log = logging.getLogger("tide")


class Watchdog:
    def __init__(
        self,
        query: Callable[[object], bool],
        timeout_s: float,
        on_stall: Callable[[str], None],
        poll_s: float = 0.005,
        abort_after_s: float | None = None,
        monitor=None,
        group: str = "",
    ):
        """``monitor``: a ``PeerMonitor`` (None: stalls only); ``group`` names the transport's
        process group in PeerFailure."""
        self._query = query
        self._monitor = monitor
        self._group = group
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._poll_s = poll_s
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.failure: TIDEError | None = None
        # If nobody observes the failure (the main thread is stuck inside a CUDA call the flag
        # release could not unblock), end the process after this grace period: fail-stop.
        self.abort_after_s = abort_after_s
        self.observed = False

    def track(self, event, what: str) -> None:
        with self._lock:
            now = time.monotonic()
            self._pending.append((event, now, now + self.timeout_s, what))
        if self._thread is None:
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self),), name="tide-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        if self.failure is None and self._monitor is not None and self._monitor.failed_peer is not None:
            self._peer_failed(*self._monitor.failed_peer)
        if self.failure is not None:
            self.observed = True
            raise self.failure

    def _peer_failed(self, peer: int, kind: str, message: str) -> None:
        """A peer's transport failed: so does this one, with the same kind of error (a stall stalls
        the group; a dead peer is dead for everyone). Results since may come from the peer's
        released streams and are not to be trusted."""
        text = f"peer rank {peer} of group {self._group} failed first: {message}"
        if kind == "PeerStallTimeout":
            failure: TIDEError = PeerStallTimeout(text)
        else:
            failure = PeerFailure(text, collective="", group=self._group, peer=peer)
        self._fail("a peer's failure", failure)

    def wait_all(self, timeout_s: float | None = None) -> None:
        """Host-wait until every tracked event completed; raise PeerStallTimeout at the deadline."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            self.check()
            if self._poll_once(force_deadline=deadline):
                break
            time.sleep(self._poll_s)
        # A failed peer's released streams may have completed these waits: ask the store once.
        if self._monitor is not None and self._monitor.peer_failure() is not None:
            self.check()

    def _poll_once(self, force_deadline: float | None = None) -> bool:
        """Drop completed events; fail on an expired one. True when nothing is pending."""
        now = time.monotonic()
        with self._lock:
            while self._pending and self._query(self._pending[0][0]):
                self._pending.popleft()
            for event, start, deadline, what in self._pending:
                if self._query(event):
                    continue
                limit = deadline if force_deadline is None else min(deadline, force_deadline)
                if now > limit:
                    waited = self.timeout_s if limit == deadline else round(limit - start, 1)
                    self._fail(
                        what,
                        PeerStallTimeout(
                            f"{what} did not complete within {waited:g} s: a live peer is that late, "
                            "skipped a signal or issued a different call order (TIDE_TIMEOUT_S sets the limit)"
                        ),
                    )
                    break
            if self._monitor is not None and self.failure is None:
                self._check_peers(now)
            return not self._pending

    def _check_peers(self, now: float) -> None:
        """While the oldest pending event is overdue by a heartbeat or two, have the monitor sample
        the peers; a dead one fails the transport now rather than at the deadline."""
        monitor = self._monitor
        if monitor.failed_peer is not None:
            self._peer_failed(*monitor.failed_peer)
            return
        oldest = self._pending[0] if self._pending else None
        monitor.watching = oldest is not None and now - oldest[1] > 2 * monitor.interval_s
        if not monitor.watching:
            return
        dead = monitor.dead_peers()
        if dead:
            self._fail(
                oldest[3],
                PeerFailure(
                    f"{oldest[3]}: peer rank(s) {dead} of group {self._group} sent no heartbeat for "
                    f"{monitor.dead_after_s:g} s: the process died or froze (TIDE_PEER_DEAD_S sets the limit)",
                    collective=oldest[3],
                    group=self._group,
                    peer=dead[0],
                ),
            )

    def _fail(self, what: str, failure: TIDEError) -> None:
        if self.failure is None:
            self.failure = failure
            log.error("TIDE: %s", self.failure)
            if self._monitor is not None:  # before the release below lets the stuck streams signal peers
                self._monitor.announce(failure)
            try:
                self._on_stall(what)
            except Exception as exc:  # the release is best effort; the abort below still applies
                log.error("TIDE: releasing stalled waits failed: %s", exc)
            if self.abort_after_s is not None:
                timer = threading.Timer(self.abort_after_s, self._abort_if_unobserved)
                timer.daemon = True
                timer.start()

    def _abort_if_unobserved(self) -> None:
        if not self.observed:
            sys.stderr.write(
                f"TIDE fail-stop: {self.failure} (not observed by the training loop within "
                f"{self.abort_after_s:g} s; exiting)\n"
            )
            sys.stderr.flush()
            os._exit(70)

    def stop(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.stop()


def _run(ref: weakref.ref[Watchdog]) -> None:
    while True:
        dog = ref()
        if dog is None or dog._stop.is_set() or dog.failure is not None:
            return
        dog._poll_once()
        poll = dog._poll_s
        del dog
        time.sleep(poll)
