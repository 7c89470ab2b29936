"""The TritonPythonModel class every model.py exports: Triton's lifecycle reaches the adapter."""

from __future__ import annotations

import json

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.stateless import PreprocessingModel

from .fakes import CharTokenizer, FakePbUtils, Request


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
    (response,) = first.execute([Request({"text_input": "hi"})])
    assert response.outputs()["input_ids"].tolist() == [104, 105]
