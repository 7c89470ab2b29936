"""The proposers that run a model of their own (a draft model, an EAGLE-3 head), loaded for an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .config import SpeculativeConfig
from .draft_model import load_draft
from .eagle3 import load_eagle3
from .own_cache import OwnCacheProposer

if TYPE_CHECKING:
    from ..cpu.backend import CpuBackend

def load_model_proposer(spec: SpeculativeConfig | None, loaded: Any, model_path: str, dtype: torch.dtype,
                        device: torch.device, attention_backend: str, cpu: CpuBackend | None,
                        load_format: str = "auto") -> OwnCacheProposer | None:
    """The draft model or EAGLE-3 head `speculative_config` names (checked against the target), None
    for n-gram or no speculation; load_format `dummy` gives a draft model random weights too (the
    head always reads its files)."""
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "eagle3":
        return load_eagle3(spec, loaded.model, loaded.config, dtype, device, attention_backend)
    return load_draft(spec, loaded.config, loaded.tokenizer, model_path, dtype, device, attention_backend, cpu, load_format)
