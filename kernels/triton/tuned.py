"""Kernel choices measured once on a GPU and committed with the code, one JSON file per
device name under `configs/` (as vLLM commits its fused-MoE configs): which tile, split and
kernel each Triton launch takes at each shape and M bucket, on that GPU.

Why committed rather than timed: a server should not time candidates on the request path
(the first requests would pay for it, and a CUDA graph captured before the timing would keep
whatever ran first), and a GPU's answer does not change between runs. The sweep that writes
these files is `benchmarks/tune_kernels.py`; it times a wider space than the launchers' own
`_candidates`, so a committed choice need not be one of them.

Order of choice for one launch (`triton/gemm.py`'s `timed_choice`, and `choice` for launches
that never time): the committed file of this GPU; else a choice an earlier process timed on
this kind of GPU (the cache directory); else timing among the candidates once, or the first
candidate where timing is off. A device with no file runs today's heuristics unchanged.

A key names its fields (`KEY_FIELDS`): the same tuple the launchers build for the timing
cache, less the device (the file is the device's). The file records the Triton version it was
tuned with; a choice is a launch's block sizes, warps and stages, valid under any version, so
a different version is logged, not refused.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .gemm import GemmConfig

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_DIR_ENV = "PAGEDSERVE_TUNED_CONFIG_DIR"
"""Another folder of per-GPU files in place of the committed one (a sweep run on a GPU type the
project has no file for, kept by its operator)."""


def config_dir() -> Path:
    """The folder the engine reads: $PAGEDSERVE_TUNED_CONFIG_DIR, else the committed `configs/`."""
    return Path(os.environ.get(CONFIG_DIR_ENV) or CONFIG_DIR)

KEY_FIELDS: Dict[str, Tuple[str, ...]] = {
    # the launchers' key tuples, field by field, the device left out (kernels/triton/int4.py, fp8.py, moe.py, lora.py)
    "w4a16": ("m", "n", "k", "group", "dtype", "bias"),
    "fp8": ("m", "n", "k", "dtype", "mode", "bias", "group", "codes"),
    "moe": ("pairs", "block_m0", "experts", "hidden", "inter", "form", "group", "dtype", "bias", "clamped"),
    "lora": ("m", "block_m0", "slots", "rank", "width_in", "width_out", "dtype"),
}


def file_name(device_name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `NVIDIA_H100_80GB_HBM3.json`."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_") + ".json"


def _plain(value: Any) -> Any:
    """A key part as JSON has it: dtypes by name (`bfloat16`), everything else as is."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def named(key: Sequence[Any]) -> Dict[str, Any]:
    """A launcher's key tuple as {field: value}, without the device; KeyError for an unknown kernel,
    ValueError where the tuple does not have the kernel's fields."""
    kernel = key[0]
    rest = [part for part in key[1:] if not isinstance(part, torch.device)]
    names = KEY_FIELDS[kernel]
    if len(rest) != len(names):
        raise ValueError(f"a {kernel} key has fields {names}, got {tuple(rest)}")
    return {"kernel": kernel, **{name: _plain(v) for name, v in zip(names, rest)}}


def key_text(key: Dict[str, Any]) -> str:
    """The lookup string of a named key: its fields in order, `|`-joined."""
    return "|".join(f"{name}={key[name]}" for name in ("kernel", *KEY_FIELDS[key["kernel"]]))


def config_from(entry: Dict[str, Any]) -> GemmConfig:
    """A GemmConfig from a file's `config` object; ValueError naming an unknown field."""
    known = {f.name for f in fields(GemmConfig)}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"unknown GemmConfig fields {sorted(unknown)} (known: {sorted(known)})")
    return GemmConfig(**entry)


class TunedConfigs:
    """One device's committed choices: {key text: GemmConfig}, read once."""

    def __init__(self, path: Optional[Path], entries: Dict[str, GemmConfig], meta: Dict[str, Any]):
        self.path = path
        self.entries = entries
        self.meta = meta

    @classmethod
    def read(cls, path: Path) -> "TunedConfigs":
        """The file at `path`; ValueError naming the file and the entry at fault."""
        with open(path) as f:
            data = json.load(f)
        entries: Dict[str, GemmConfig] = {}
        for i, item in enumerate(data.get("choices", [])):
            try:
                entries[key_text(item["key"])] = config_from(item["config"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: choice {i} ({item.get('key')}) is malformed: {e!r}; "
                                 f"rerun benchmarks/tune_kernels.py on that GPU or delete the entry") from e
        meta = {k: v for k, v in data.items() if k != "choices"}
        return cls(path, entries, meta)

    def lookup(self, key: Sequence[Any]) -> Optional[GemmConfig]:
        if not self.entries or key[0] not in KEY_FIELDS:
            return None
        return self.entries.get(key_text(named(key)))


_NONE = TunedConfigs(None, {}, {})


def for_device_name(device_name: str, directory: Optional[str] = None) -> TunedConfigs:
    """The committed choices of the GPU called `device_name` in `directory` (default `config_dir()`);
    empty where there is no file."""
    return _read_once(device_name, str(directory or config_dir()))


@functools.lru_cache(maxsize=None)
def _read_once(device_name: str, directory: str) -> TunedConfigs:
    path = Path(directory) / file_name(device_name)
    if not path.exists():
        log.info("no tuned kernel configs for %s (%s): launch heuristics", device_name, path.name)
        return _NONE
    tuned = TunedConfigs.read(path)
    import triton

    version = tuned.meta.get("triton")
    log.info("tuned kernel configs for %s: %d choices from %s%s", device_name, len(tuned.entries), path.name,
             f" (tuned under triton {version}, running {triton.__version__})" if version != triton.__version__ else "")
    return tuned


def for_device(device: torch.device) -> TunedConfigs:
    """The committed choices of a CUDA device (empty off CUDA: the interpreter's tiles are its own)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return _NONE
    return for_device_name(torch.cuda.get_device_name(device))


def committed_choice(key: Sequence[Any], candidates: List[GemmConfig]) -> Optional[GemmConfig]:
    """The committed choice for a launcher's key, or None. Where it equals a candidate, that
    candidate itself is returned (a few are told apart by identity, e.g. fp8's SCALED_MM)."""
    device = next((part for part in key if isinstance(part, torch.device)), None)
    if device is None:
        return None
    chosen = for_device(device).lookup(key)
    if chosen is None:
        return None
    return next((c for c in candidates if c == chosen), chosen)


_CHOSEN: Dict[Tuple, GemmConfig] = {}


def choice(key: Tuple, candidates: List[GemmConfig]) -> GemmConfig:
    """For launches that never time: the committed choice, else the first candidate; looked up
    once per key (such a launch runs in every adapted linear of every step)."""
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _CHOSEN[key] = committed_choice(key, candidates) or candidates[0]
    return chosen


def entry(key: Sequence[Any], config: GemmConfig, **measured: float) -> Dict[str, Any]:
    """One `choices` item of a file, as the sweep writes it (its timings beside, for the reader)."""
    return {"key": named(key), "config": asdict(config), **measured}


__all__ = ["CONFIG_DIR", "CONFIG_DIR_ENV", "KEY_FIELDS", "TunedConfigs", "choice", "committed_choice", "config_dir",
           "entry", "file_name", "for_device", "for_device_name", "named"]
