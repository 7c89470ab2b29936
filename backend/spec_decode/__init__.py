"""Speculative decoding (slice 1: n-gram prompt lookup, greedy-exact), behind one `Speculator`."""

from .config import SpeculativeConfig, parse
from .ngram import propose_ngram
from .speculator import SpecStats, Speculator

__all__ = ["SpeculativeConfig", "SpecStats", "Speculator", "parse", "propose_ngram"]
