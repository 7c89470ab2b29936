"""The TritonPythonModel class every model.py exports: Triton's lifecycle reaches the adapter."""

from __future__ import annotations

import json
import logging

from pagedserve.backend.triton_adapter.python_model import TritonLogHandler, triton_python_model
from pagedserve.backend.triton_adapter.stateless import PreprocessingModel

from .fakes import CharTokenizer, FakePbUtils, Logger, Request


class RecordingAdapter:
    calls: list[str] = []

    @classmethod
    def from_args(cls, pb_utils, args):
        cls.calls.append(f"init {args['model_name']}")
        return cls()

    def execute(self, requests):
        self.calls.append(f"execute {len(requests)}")
        return ["response"] * len(requests)

    def finalize(self):
        self.calls.append("finalize")


def test_triton_lifecycle_is_forwarded_to_the_adapter():
    model = triton_python_model(FakePbUtils(), RecordingAdapter)()
    model.initialize({"model_name": "llm", "model_config": json.dumps({})})
    assert model.execute([object(), object()]) == ["response", "response"]
    model.finalize()
    assert RecordingAdapter.calls == ["init llm", "execute 2", "finalize"]


def test_each_model_gets_its_own_adapter_instance(monkeypatch):
    monkeypatch.setattr(PreprocessingModel, "from_args", classmethod(lambda cls, pb, args: cls(pb, CharTokenizer())))
    cls = triton_python_model(FakePbUtils(), PreprocessingModel)
    first, second = cls(), cls()
    first.initialize({})
    second.initialize({})
    assert first.model is not second.model
    (response,) = first.execute([Request({"QUERY": [["hi"]]})])
    assert response.outputs()["INPUT_ID"].tolist() == [[104, 105]]


def test_the_engines_log_lines_reach_the_servers_log():
    """e.g. the dtype `auto` chose and why, written while the model loads."""
    engine_log = logging.getLogger("pagedserve")
    before = list(engine_log.handlers)
    engine_log.handlers[:] = [h for h in before if not isinstance(h, TritonLogHandler)]
    try:
        triton_python_model(FakePbUtils(), RecordingAdapter)().initialize({"model_name": "llm"})
        triton_python_model(FakePbUtils(), RecordingAdapter)().initialize({"model_name": "llm"})  # one handler, not two
        assert sum(isinstance(h, TritonLogHandler) for h in engine_log.handlers) == 1
        engine_log.info("dtype auto: float32 (why)")
        engine_log.warning("slow")
        assert Logger.lines[-2:] == ["dtype auto: float32 (why)", "W slow"]
    finally:
        engine_log.handlers[:] = before


def test_readiness_is_the_adapters_where_it_has_one():
    """Triton releases with python_backend#430 ask `is_ready()` on /v2/models/<name>/ready:
    llm answers for its engine; a model without a readiness of its own is ready once loaded."""
    class Engine(RecordingAdapter):
        ready = True

        def is_ready(self):
            return self.ready

    model = triton_python_model(FakePbUtils(), Engine)()
    assert model.is_ready() is False  # not initialized yet
    model.initialize({"model_name": "llm", "model_config": json.dumps({})})
    assert model.is_ready() is True
    Engine.ready = False
    assert model.is_ready() is False
    plain = triton_python_model(FakePbUtils(), RecordingAdapter)()
    plain.initialize({"model_name": "preprocessing", "model_config": json.dumps({})})
    assert plain.is_ready() is True
