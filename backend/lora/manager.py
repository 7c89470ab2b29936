"""LoRAManager: which adapters a model serves, which sit in the device's slots, and each step's map.

At load it wraps every decoder layer's attention projections and dense MLP in `LoRALinear`
(backend/lora/layer.py) and reads every listed adapter once, so a bad one fails the load, naming it.
Adapters stay read in host memory up to `max_cpu_loras` (least recently used dropped, read again
when asked for). A step's adapters are put in the `max_loras` device slots before its forward,
replacing the least recently used adapter that the step does not use (the scheduler admits
requests of at most `max_loras` adapters at once, so there is always one).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence as Seq

import numpy as np
import torch
from torch import nn

from ..config import EngineConfig
from ..errors import ConfigError, InvalidRequestError
from ..models.llama import LlamaForCausalLM, LlamaMLP
from ..sequence import Sequence
from .adapter import LoRAAdapter, load_adapter, read_lora_modules
from .layer import LoRALinear, LoRAStep

Target = tuple[LoRALinear, int]
"""An adapted layer and the index of a checkpoint projection's slice in it."""


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.paths = read_lora_modules(config.lora_modules)
        """Adapter name -> its folder."""
        self.max_rank = config.max_lora_rank
        self.step = LoRAStep(torch.zeros(config.max_loras, dtype=torch.float32, device=device))
        self.targets = self._wrap(model, config.max_loras, dtype, device)
        """(layer index, checkpoint module such as "self_attn.q_proj") -> where its delta goes."""
        self.slots: list[str | None] = [None] * config.max_loras
        """The adapter in each device slot."""
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(config.max_loras))
        """Slots, least recently used first."""
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._host_size = config.max_cpu_loras or config.max_loras
        self._fused_layers = model.fused_layers
        for name in self.paths:
            self._check_targets(self._read(name))

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    def check(self, name: str) -> None:
        """InvalidRequestError naming `lora_name` unless this model serves the adapter."""
        if name not in self.paths:
            served = self.names or "none (list them in lora_modules / multi_lora.json)"
            raise InvalidRequestError("lora_name", f"unknown adapter {name!r}; this model serves {served}")

    def slots_of(self, seqs: Seq[Sequence]) -> np.ndarray | None:
        """Each sequence's device slot (-1: the base model), its adapter put there first where it is
        not; None when none of them has an adapter."""
        names = [seq.params.lora_name for seq in seqs]
        wanted = {name for name in names if name is not None}
        if not wanted:
            return None
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"a step of {len(wanted)} adapters for {len(self.slots)} slots (max_loras)")
        slot_of = {name: i for i, name in enumerate(self.slots) if name in wanted}
        for name in sorted(wanted - set(slot_of)):
            slot_of[name] = self._place(name, wanted)
        for slot in slot_of.values():
            self._slot_use.move_to_end(slot)
        return np.fromiter((-1 if name is None else slot_of[name] for name in names), dtype=np.int32, count=len(names))

    def activate(self, token_slots: torch.Tensor | None, output_rows: torch.Tensor | None) -> None:
        """Set the step's map for the forward about to run (None: a step without adapter rows). The
        CPU's C decoder stack knows no adapters: a step with adapter rows runs the layers in Python."""
        self.step.set(token_slots, output_rows)
        self.model.fused_layers = self._fused_layers if token_slots is None else None

    # -- slots and host copies ---------------------------------------------------
    def _place(self, name: str, wanted: set[str]) -> int:
        slot = next(i for i in self._slot_use if self.slots[i] not in wanted)
        adapter = self._read(name)
        parts: dict[LoRALinear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, (a, b) in adapter.weights.items():
            layer, index = self.targets[key]
            parts.setdefault(layer, {})[index] = (a, b)
        for layer in self._layers():
            layer.load(slot, parts.get(layer, {}))
        self.step.scaling[slot] = adapter.scaling
        self.slots[slot] = name
        return slot

    def _read(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            adapter = self._host[name] = load_adapter(name, self.paths[name], self.max_rank)
            while len(self._host) > self._host_size:
                self._host.popitem(last=False)
        self._host.move_to_end(name)
        return adapter

    def _check_targets(self, adapter: LoRAAdapter) -> None:
        for layer, module in adapter.weights:
            if (layer, module) not in self.targets:
                served = sorted({m for _, m in self.targets})
                raise ConfigError("lora_modules", f"adapter {adapter.name!r} ({adapter.path}) adapts layer {layer}'s "
                                                  f"{module}, which is not served; adapters may target {served}")
            a, b = adapter.weights[(layer, module)]
            wrapper, index = self.targets[(layer, module)]
            rows = sum(wrapper.slices[index:]) if module in _STACKED_NAMES else wrapper.slices[index]
            if a.shape[1] != wrapper.a.shape[2] or b.shape[0] != rows:
                raise ConfigError("lora_modules", f"adapter {adapter.name!r} ({adapter.path}): layer {layer}'s {module} "
                                                  f"is [{b.shape[0]} x {a.shape[1]}], the model's is [{rows} x "
                                                  f"{wrapper.a.shape[2]}]: an adapter of another model")

    def _layers(self) -> list[LoRALinear]:
        return list(dict.fromkeys(wrapper for wrapper, _ in self.targets.values()))

    def _wrap(self, model: LlamaForCausalLM, num_slots: int, dtype: torch.dtype,
              device: torch.device) -> dict[tuple[int, str], Target]:
        """Wrap each layer's linears; the checkpoint projections each one stacks, per layer."""
        config = model.config
        targets: dict[tuple[int, str], Target] = {}
        for i, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            wrapped: list[tuple[nn.Module, str, int, tuple[int, ...]]] = [
                (attn, "qkv_proj", config.hidden_size, (attn.q_size, attn.kv_size, attn.kv_size)),
                (attn, "o_proj", attn.q_size, (config.hidden_size,))]
            if isinstance(mlp, LlamaMLP):  # a mixture of experts' experts are not adapted
                inter = mlp.intermediate_size
                wrapped += [(mlp, "gate_up_proj", config.hidden_size, (inter, inter)),
                            (mlp, "down_proj", inter, (config.hidden_size,))]
            for owner, attr, width_in, slices in wrapped:
                wrapper = LoRALinear(getattr(owner, attr), width_in, slices, num_slots, self.max_rank, self.step,
                                     dtype, device)
                setattr(owner, attr, wrapper)
                prefix = "self_attn." if owner is attn else "mlp."
                name = prefix + attr
                targets[(i, name)] = (wrapper, 0)  # the stacked projection itself (Phi-3's checkpoints have it)
                for index, projection in enumerate(model.packed_modules[name]):
                    targets[(i, projection)] = (wrapper, index)
        return targets


_STACKED_NAMES = frozenset(name for name, parts in LlamaForCausalLM.packed_modules.items() if len(parts) > 1)
"""Our stacked layers' own names: an adapter of a checkpoint that stacks them too spans all their rows."""


__all__ = ["LoRAManager"]
