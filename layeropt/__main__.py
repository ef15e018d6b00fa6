"""Command line: ``python -m layeropt demo`` / ``plan`` (also installed as ``layeropt``)."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .demo import DEMO_MODELS, run_demo
from .plan import cli as plan_cli
from .report import PlotDependencyError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layeropt",
        description="Update each layer during backward and free its gradient at once.",
    )
    parser.add_argument("--version", action="version", version=f"layeropt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a model with torch.optim.Adam and layeropt.Adam and compare them",
        description=(
            "Train one model with torch.optim.Adam(fused=True) and with layeropt.Adam "
            "attached to it, on the same batches; print peak memory by category, "
            "relative step time and the largest parameter difference."
        ),
    )
    demo.add_argument("--model", choices=DEMO_MODELS, default="gpt", help="default: gpt")
    demo.add_argument("--steps", type=int, default=None, help="steps per optimizer (default 8)")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    demo.add_argument(
        "--checkpoint", action="store_true", help="per-block activation checkpointing"
    )
    demo.add_argument("--tiny", action="store_true", help="small model: a smoke run of seconds")
    demo.add_argument("--plot", metavar="OUT.png", help="write the memory timeline (matplotlib)")
    demo.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (1e-3)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    plan_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``layeropt`` command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a usage error.

    Example:
        >>> main(["demo", "--tiny", "--model", "mlp"])  # doctest: +SKIP
        0
        >>> main(["plan", "llama-2-7b", "--gpu-memory", "24GiB"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    args = parser.parse_args(plan_cli.join_size_units(sys.argv[1:] if argv is None else argv))
    if args.command == "plan":
        return plan_cli.run(args)
    if args.command != "demo":
        parser.print_help(sys.stderr)
        return 2
    try:
        run_demo(
            args.model,
            steps=args.steps,
            device=args.device,
            use_checkpoint=args.checkpoint,
            tiny=args.tiny,
            plot=args.plot,
            lr=args.lr,
            progress=not args.no_progress,
        )
    except (ValueError, PlotDependencyError) as e:
        print(f"layeropt demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
