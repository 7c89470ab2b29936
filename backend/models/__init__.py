"""Model definitions in plain torch."""

from .llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
