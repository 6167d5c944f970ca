"""What the benchmarks' command lines share: a quick-run limit, the thread count, where the figures go."""
from __future__ import annotations

import argparse

import torch


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=None, help="use this many examples of each split (a quick run)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The arguments, with torch's thread count set from --threads."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
