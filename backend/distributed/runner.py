"""TensorParallelRunner: rank 0's ModelRunner. Each forward's flat inputs go to the
workers first, so every rank runs the same step on its share of the model."""

from __future__ import annotations

from typing import Any

import torch

from ..attention import AttentionKernels, LayerKVCache
from ..model_runner import ModelInputs, ModelRunner
from .workers import WorkerPool


class TensorParallelRunner(ModelRunner):
    def __init__(self, workers: WorkerPool, *runner_args: Any, **runner_settings: Any):
        """`runner_args`, `runner_settings`: ModelRunner's. Returns once every worker holds
        its KV cache of the same number of blocks."""
        super().__init__(*runner_args, **runner_settings)
        self.workers = workers
        workers.init_workers(len(self.kv_caches[0].key))

    def run(
        self, inputs: ModelInputs, kv_caches: list[LayerKVCache] | None = None, attention: AttentionKernels | None = None
    ) -> torch.Tensor:
        if kv_caches is not None or attention is not None:  # fp8 KV calibration: refused with tensor parallelism
            raise NotImplementedError("scratch KV caches are not sharded over tensor-parallel ranks")
        with self.workers.naming_failures():
            self.workers.send_step(inputs)
            logits = super().run(inputs)
        self.workers.end_step()
        return logits

    def recover(self) -> None:
        self.workers.recover()

    def close(self) -> None:
        self.workers.close()
