"""Batched LoRA: each token's row of a linear layer's output plus its own adapter's low-rank delta.

Many adapters serve in one step (punica / S-LoRA): the adapters loaded on the device sit in
slots of one stack per layer, and each token names its slot. Layout (shared by every
implementation):
  x            [tokens, in]             the layer's input rows
  out          [tokens, out]            the base layer's output, added to in place
  a            [slots, rank, in]        each slot's A (lora_A), rows past its rank zero
  b            [slots, out, rank]       each slot's B (lora_B), columns past its rank zero
  scaling      float32 [slots]          each slot's lora_alpha / r (or / sqrt(r), rsLoRA)
  token_slots  int32 [tokens]           each token's slot; -1: no adapter (the base model alone)
Per token t with slot s >= 0:
  out[t] += ((x[t] @ a[s]^T) rounded to x.dtype @ b[s]^T) rounded to x.dtype * scaling[s]
PEFT's order (`lora_B(lora_A(x)) * scaling`, then added), so half-precision results round as its do.

A layer that stacks several checkpoint projections (q/k/v into qkv_proj) stacks their A rows
(`rank` = projections x the rank a slot holds) and lays their B blocks on the diagonal: the zero
blocks add exact zeros, and every projection's delta is its own.

`add_lora_ref` is the torch reference (the CPU path, the test oracle): two matmuls per slot in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SlotRows:
    """The rows of a step that use one slot (None: every row), and that slot's scaling."""

    slot: int
    rows: torch.Tensor | None
    scaling: float


def slot_groups(token_slots: torch.Tensor, scaling: torch.Tensor) -> list[SlotRows]:
    """The step's rows grouped by slot (the reference's work list; computed once a step, as every
    adapted layer of the step reads the same)."""
    slots = token_slots.cpu().numpy()
    scales = scaling.tolist()
    groups = []
    for slot in np.unique(slots).tolist():
        if slot < 0:
            continue
        rows = np.flatnonzero(slots == slot)
        every = len(rows) == len(slots)
        groups.append(SlotRows(slot, None if every else torch.from_numpy(rows).to(token_slots.device), scales[slot]))
    return groups


def add_lora_ref(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
    token_slots: torch.Tensor, groups: list[SlotRows] | None = None,
) -> torch.Tensor:
    """out += each token's adapter delta (see the module docstring); returns out. `groups`: the
    rows by slot where the caller has them already (`slot_groups`)."""
    for group in slot_groups(token_slots, scaling) if groups is None else groups:
        xs = x if group.rows is None else x.index_select(0, group.rows)
        delta = ((xs @ a[group.slot].t()) @ b[group.slot].t()) * group.scaling  # a Python float, as PEFT's
        if group.rows is None:
            out.add_(delta)
        else:
            out.index_add_(0, group.rows, delta)
    return out


__all__ = ["SlotRows", "add_lora_ref", "slot_groups"]
