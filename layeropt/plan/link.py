"""The host link: how fast copies between host memory and the GPU go, and the step time they set.

A GPU copies to the device and back on two copy engines at once, but the two
directions share the link: an H200 (2026-12-04, pinned 1 GiB copies,
``docs/results/gpu-h200.md#host-link``) moved 54.9 GB/s to the device and
54.7 GB/s back, each alone, and 88.0 GB/s in all with both at once - not
2 x 55. A :class:`Link` holds the three rates; :meth:`Link.seconds` is the
least time a step's copies can take over it, whatever the order: each
direction at most at its own rate, the two together at most at the shared one.

Example:
    >>> round(H200.seconds(40.5e9, 40.5e9), 2)  # Llama-2-7B, 2 micro-batches (docs/plan.md)
    0.92
    >>> Link.parse("25")
    Link(to_device=25.0, to_host=25.0, both=50.0, measured='')
"""

from __future__ import annotations

import dataclasses
import math

from .workloads import PlanError

__all__ = ["Link", "H200"]


@dataclasses.dataclass(frozen=True)
class Link:
    """A host link's copy rates, in GB/s (10^9 bytes a second).

    Args:
        to_device: host to GPU, that direction alone.
        to_host: GPU to host, that direction alone.
        both: the two directions' total when both copy at once.
        measured: where and when the rates were measured; ``""`` for rates given.
    """

    to_device: float
    to_host: float
    both: float
    measured: str = ""

    def __post_init__(self) -> None:
        rates = (self.to_device, self.to_host, self.both)
        if not all(isinstance(r, (int, float)) and 0 < r < math.inf for r in rates):
            raise PlanError(f"a link's rates must be finite numbers > 0 (GB/s), got {rates!r}")
        if not max(self.to_device, self.to_host) <= self.both <= self.to_device + self.to_host:
            raise PlanError(
                f"both directions at once ({self.both:g} GB/s) must be at least either "
                f"direction alone and at most their sum ({self.to_device:g} + "
                f"{self.to_host:g} GB/s): TO_GPU,TO_HOST,BOTH"
            )

    def seconds(self, to_device_bytes: float, to_host_bytes: float) -> float:
        """The least time these copies take over this link: ``max(down / to_device,
        up / to_host, (down + up) / both)``. Arithmetic, not a measured step time."""
        return max(to_device_bytes / self.to_device, to_host_bytes / self.to_host,
                   (to_device_bytes + to_host_bytes) / self.both) / 1e9

    def describe(self) -> str:
        """The rates in words, with where they were measured."""
        if self.both == self.to_device + self.to_host:
            rates = (f"{self.to_device:g} GB/s each way" if self.to_device == self.to_host
                     else f"{self.to_device:g} GB/s to the GPU, {self.to_host:g} back")
            rates += ", both at once"
        else:
            rates = (f"{self.to_device:g} GB/s to the GPU, {self.to_host:g} back, "
                     f"{self.both:g} with both at once")
        return rates + (f", {self.measured}" if self.measured else "")

    @classmethod
    def parse(cls, text: str | float | Link) -> Link:
        """A :class:`Link` from ``--link-gbps``'s text.

        Args:
            text: a :class:`Link`; one rate (``25``: each direction, the two
                at once adding up, as two copy engines on a full-duplex link);
                or three, ``TO_GPU,TO_HOST,BOTH`` (``54.9,54.7,88``).

        Raises:
            PlanError: not one or three numbers > 0.
        """
        if isinstance(text, Link):
            return text
        if isinstance(text, bool):
            raise PlanError(f"--link-gbps takes one rate or three (GB/s), got {text!r}")
        try:
            rates = [float(x) for x in str(text).split(",")]
        except ValueError:
            rates = []
        if len(rates) == 1:
            rates = [rates[0], rates[0], 2 * rates[0]]
        if len(rates) != 3:
            raise PlanError(
                f"--link-gbps takes one rate (GB/s each way: 25) or three "
                f"(TO_GPU,TO_HOST,BOTH: 54.9,54.7,88), got {text!r}"
            )
        return cls(*rates)


#: One H200's link (torch 2.11, CUDA 13, 2026-12-04): the plan's default.
H200 = Link(54.9, 54.7, 88.0, "measured on an H200, pinned memory, 2026-12-04")
