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

import torch


def add_lora_ref(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """out += each token's adapter delta (see the module docstring); returns out."""
    slots = token_slots.to(torch.int64)
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).flatten()
        shrunk = x.index_select(0, rows) @ a[slot].to(x.dtype).t()
        delta = (shrunk @ b[slot].to(x.dtype).t()) * float(scaling[slot])  # a Python float, as PEFT's
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


__all__ = ["add_lora_ref"]
