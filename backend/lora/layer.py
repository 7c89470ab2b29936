"""An adapted linear layer: the base layer's output plus each token's own adapter's delta.

`LoRALinear` wraps whatever the base layer is (plain, CPU-packed, fp8, int4): the delta reads the
layer's input, not its weight. Its stacks hold one slot per adapter on the device (kernels/lora.py's
layout); `LoRAStep` says, for the step being run, which slot each token uses, and is shared by every
wrapped layer of the model. A step without adapter rows leaves `token_slots` None and the wrapper
is the base layer alone (a CUDA graph captured so replays it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels.dispatch import add_lora
from pagedserve.kernels.lora import SlotRows, slot_groups


class LoRAStep:
    """The token -> slot map of the step being run (set by the model runner around its forward)."""

    def __init__(self, scaling: torch.Tensor) -> None:
        self.scaling = scaling
        """float32 [slots]: each slot's adapter's scaling (the manager writes it as it places adapters)."""
        self.token_slots: torch.Tensor | None = None
        """int32 [tokens]: each input row's slot, -1 for none; None: no row of this step has an adapter."""
        self.output_slots: torch.Tensor | None = None
        """The same for the rows the step samples: the last layer past its attention runs those alone."""
        self._groups: dict[int, list[SlotRows]] = {}

    def set(self, token_slots: torch.Tensor | None, output_rows: torch.Tensor | None) -> None:
        self.token_slots = token_slots
        self.output_slots = None if token_slots is None or output_rows is None else token_slots[output_rows]
        self._groups = {}

    def slots_for(self, rows: int) -> tuple[torch.Tensor, list[SlotRows] | None] | None:
        """The slots of a layer input of `rows` rows (every token's, or the sampled rows'), with the
        rows grouped by slot on CPU (the reference's work list, made once a step); None: no adapter."""
        slots = self.token_slots
        if slots is None:
            return None
        if rows != slots.shape[0]:
            if self.output_slots is None or rows != self.output_slots.shape[0]:
                raise ValueError(f"a layer input of {rows} rows in a step of {slots.shape[0]} tokens")
            slots = self.output_slots
        if slots.device.type != "cpu":
            return slots, None
        groups = self._groups.get(rows)
        if groups is None:
            groups = self._groups[rows] = slot_groups(slots, self.scaling)
        return slots, groups


class LoRALinear(nn.Module):
    """`base` plus the delta of each token's adapter slot. `slices`: the output widths of the checkpoint
    projections stacked in the layer (q, k, v for qkv_proj), each with its own rank columns."""

    a: torch.Tensor  # buffers, declared for the type checker
    b: torch.Tensor

    def __init__(self, base: nn.Module, in_features: int, slices: tuple[int, ...], num_slots: int, max_rank: int,
                 step: LoRAStep, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.slices = slices
        self.max_rank = max_rank
        self.step = step
        """The step's token -> slot map and each slot's scaling, shared by the model's wrapped layers."""
        rank = len(slices) * max_rank
        self.register_buffer("a", torch.zeros(num_slots, rank, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, sum(slices), rank, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step.slots_for(x.shape[0])
        if step is None:
            return out
        return add_lora(out, x, self.a, self.b, self.step.scaling, *step)

    def __getattr__(self, name: str) -> Any:
        """The base layer's attributes (its weight, method, collectives) through the wrapper: code that
        reads a layer's weights (the CPU's C decoder stack, which runs the steps without adapter rows)
        finds them as before."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base":
                raise
            return getattr(super().__getattr__("base"), name)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter in `slot`: parts maps a slice's index to its (A [r, in], B [rows, r]); B
        of slice i starts at that slice's first output row and may span the slices after it (a
        projection the checkpoint already stacks). Slices it leaves out get zeros (no delta)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, (a, b) in parts.items():
            rank, row = a.shape[0], sum(self.slices[:index])
            columns = slice(index * self.max_rank, index * self.max_rank + rank)
            self.a[slot, columns].copy_(a)
            self.b[slot, row : row + b.shape[0], columns].copy_(b)


__all__ = ["LoRALinear", "LoRAStep"]
