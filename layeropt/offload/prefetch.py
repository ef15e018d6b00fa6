"""Prefetch in landing order: ``offload_state(opt, prefetch=True)`` (CUDA only, off by default).

Without it a bucket's offloaded state is fetched when its gradients land, on
the critical path. The order in which buckets are stepped repeats from one
backward to the next, so :class:`LandingOrder` records it and, as each
bucket steps, names the buckets expected next; ``StateOffload`` copies their
state (and held gradient sums) to the device on a side stream while the
backward goes on, at most ``max_buckets`` ahead. Each copy is used only if
the host tensor it came from is still the same object at the same version:
a bucket that lands out of the recorded order, a skipped one, one unfrozen
late or a step that wrote its state meanwhile is fetched on demand. A wasted
prefetch costs copies, never a different number.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["LandingOrder"]


class LandingOrder:
    """The order of the step calls of the latest backward, to predict the next ones.

    Keys are whatever identifies a step call (``StateOffload`` uses the ids of
    its parameters). ``landed(key, serial)`` records a call of the backward
    ``serial``; a new serial makes the order recorded so far the one predicted
    from.

    Example:
        >>> order = LandingOrder()
        >>> for key in "abcd":
        ...     order.landed(key, serial=1)
        >>> order.landed("a", serial=2)
        >>> order.upcoming(2)
        ['b', 'c']
    """

    def __init__(self) -> None:
        self.previous: list[Hashable] = []  # the latest complete backward's order
        self._position: dict[Hashable, int] = {}
        self.current: list[Hashable] = []  # the backward in progress
        self._landed: set[Hashable] = set()
        self._serial: object = None

    def landed(self, key: Hashable, serial: object) -> None:
        """A step call ``key`` ran in backward ``serial``."""
        if serial != self._serial:
            self._rotate()
            self._serial = serial
        self.current.append(key)
        self._landed.add(key)

    def _rotate(self) -> None:
        if self.current:
            self.previous = self.current
            self._position = {k: i for i, k in enumerate(self.previous)}
        self.current, self._landed = [], set()

    def upcoming(self, n: int) -> list[Hashable]:
        """Up to ``n`` keys expected next: those after the latest landed one in the
        recorded order (from its start before anything landed), not landed yet. A key
        the recorded order does not know (a new bucket) predicts nothing."""
        if not self.current:
            start = 0
        else:
            where = self._position.get(self.current[-1])
            if where is None:
                return []
            start = where + 1
        out = []
        for key in self.previous[start:]:
            if key not in self._landed:
                out.append(key)
                if len(out) == n:
                    break
        return out
