"""Load generator (filled in by the serving-benchmark work)."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=lambda args: print("pagedserve bench is not implemented yet") or 1)
