"""An EngineModel over a fake engine thread, with metrics, shared by the llm_engine tests."""

from __future__ import annotations

import pytest

from pagedserve.backend.outputs import EngineStats
from pagedserve.backend.triton_adapter.engine_model import EngineModel
from pagedserve.backend.triton_adapter.metrics import EngineMetrics

from .fakes import CharTokenizer, FakeEngineThread, FakePbUtils

STATS = EngineStats(num_running=2, num_waiting=1, peak_num_running=3, kv_blocks_total=64, kv_blocks_used=10,
                    kv_blocks_free=54, kv_usage=10 / 64, prefix_hit_rate=0.5, num_preemptions=0,
                    prompt_tokens=0, generation_tokens=0)


@pytest.fixture
def engine_thread():
    return FakeEngineThread()


@pytest.fixture
def model(engine_thread):
    pb_utils = FakePbUtils()
    model = EngineModel(pb_utils, engine_thread, CharTokenizer(), lambda: STATS, EngineMetrics(pb_utils, {"model": "llm_engine", "version": "1"}))
    yield model
    model.finalize()
