"""LoRA adapters served per request, many in one step: PEFT adapters read (adapter.py), the
adapted linear layers and the step's token -> slot map (layer.py), and the adapters' slots on
the device (manager.py). The batched delta itself is a kernel (kernels/lora.py, kernels/triton/lora.py)."""
