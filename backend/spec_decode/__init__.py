"""Speculative decoding (n-gram prompt lookup; greedy and sampled requests), behind one `Speculator`."""

from .config import SpeculativeConfig, parse
from .ngram import propose_ngram
from .speculator import SpecStats, Speculator, Verification

__all__ = ["SpeculativeConfig", "SpecStats", "Speculator", "Verification", "parse", "propose_ngram"]
