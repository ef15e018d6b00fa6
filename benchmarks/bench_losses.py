"""Peak bytes of plain vs memory-lean losses (CPU): the table in docs/losses.md.

Each row measures one loss twice with ``layeropt.memory.PeakMemory`` (exact
byte counts from the profiler's allocation events): the plain form and the
``layeropt.losses`` form (``sum_product``, ``recompute``,
``linear_cross_entropy``); see ``layeropt.losses.memory_table``.

Usage:
    python benchmarks/bench_losses.py          # the table in docs/losses.md
    python benchmarks/bench_losses.py --tiny   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import sys

from layeropt.losses import format_table, memory_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, a few seconds")
    args = parser.parse_args(argv)
    print(format_table(memory_table(tiny=args.tiny)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
