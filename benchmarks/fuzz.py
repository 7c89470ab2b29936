"""Requests a careless or hostile client could send, against a live server: every input of
`llm`, of the TensorRT-LLM models (`ensemble`, `tensorrt_llm_bls`) and of the OpenAI gateway,
with wrong types, shapes, sizes, extreme numbers, odd unicode, missing and extra fields.
Each must be answered with a result or with an error that names what was wrong, while a
bystander greedy stream runs beside them and keeps the tokens it gets alone; afterwards no
KV block is held.

    python benchmarks/fuzz.py --examples 2000            # starts its own tritonserver + gateway
    python benchmarks/fuzz.py --url localhost:8001 --gateway http://localhost:9000 --examples 500

The cases are hypothesis strategies built from the models' own config.pbtxt (every declared
input, its type and shape), so a new input is fuzzed without a change here.
`tests/integration/test_fuzz.py` runs a short version; `benchmarks/soak.py --fuzz-share`
mixes cases into the soak.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import re
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
TRITON_MODELS = ("llm", "ensemble", "tensorrt_llm_bls")
CASE_BUDGET_S = 20.0
"""A case still running after this long is cancelled by the fuzzer (a valid request asking for
many tokens): an outcome like any other, as long as the server answers the cancel."""
GATEWAY_KEY = "fuzz-key-0123456789"

# An error that says the server failed, not the client: an exception class leaking out of our
# parsing (Failure.of's INTERNAL wording), a failed engine step, a dead stub.
CRASH = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt): |Traceback|engine step failed|engine failed|"
                   r"not healthy|Stub process|Segmentation|internal_error|the engine shut down")


@dataclass
class Case:
    """One request: gRPC tensors for a Triton model, or an HTTP body for a gateway route."""

    entry: str
    """llm, ensemble, tensorrt_llm_bls, or openai."""
    kind: str
    """What was varied, for the report (`sampling_parameters.top_k`, `text_input:dtype`...)."""
    tensors: list[tuple[str, np.ndarray, str]] = field(default_factory=list)
    route: str = ""
    body: bytes = b""
    bounded: bool = True
    """It asks for a few tokens at most: no final within the budget is a hang, not a long request."""


@dataclass
class Outcome:
    verdict: str
    """result, named (an error naming what was wrong), cancelled (ran past CASE_BUDGET_S), crash."""
    message: str = ""


# -- the input surface, read from the models' config.pbtxt ------------------------------------
@dataclass
class Declared:
    name: str
    dtype: str
    dims: list[int]
    optional: bool


def declared_inputs(model: str, repository: Path = ROOT / "model_repository") -> tuple[list[Declared], bool]:
    """The model's inputs and whether it batches (max_batch_size > 0: a leading batch dim)."""
    text = (repository / model / "config.pbtxt").read_text()
    batching = int(re.search(r"max_batch_size:\s*(\d+)", text).group(1)) > 0
    block = text[text.index("input ["):]
    block = block[: block.index("\n]")]
    found = []
    for entry in re.finditer(r"\{\s*name:\s*\"(\w+)\"\s*data_type:\s*TYPE_(\w+)\s*dims:\s*\[([^\]]*)\]([^}]*)\}", block):
        dims = [int(d) for d in entry.group(3).replace(",", " ").split()]
        found.append(Declared(entry.group(1), entry.group(2), dims, "optional: true" in entry.group(4)))
    return found, batching


NUMPY = {"STRING": np.object_, "BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
         "FP32": np.float32, "FP16": np.float16, "BOOL": np.bool_}
WIRE = {"STRING": "BYTES"}

words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
odd_text = st.one_of(
    words,
    st.sampled_from(["", " ", "\x00", "\u202e\u0644\u0627", "🦙" * 40, "a" * 4000, "word " * 1500, "<|im_end|>",
                     "{{ raise('x') }}", "%s%n", "\ud7ff\ue000"]),
)
raw_bytes = st.one_of(odd_text.map(lambda s: s.encode()), st.binary(max_size=32),
                      st.sampled_from([b"\xff\xfe", b"\xc3", b"\xed\xa0\x80"]))
edge_ints = st.sampled_from([0, -1, 1, 2, 16, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**63, 2**64, -(2**63), 10**20])
any_number = st.one_of(edge_ints, st.integers(-5, 40), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.5, -0.0, 1e-30, 1e30, 3.4e38]))
wild = st.recursive(st.one_of(st.none(), st.booleans(), any_number, odd_text),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(words, inner, max_size=3)),
                    max_leaves=8)


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (a decompression bomb's shape: the pixel
    cap must refuse it from the header, before decoding)."""
    import io
    import struct
    import zlib

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1, 1)).save(out, format="PNG")
    data = bytearray(out.getvalue())
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    return bytes(data)


def _base64(data: bytes) -> bytes:
    import base64

    return base64.b64encode(data)


image_values = st.one_of(
    st.binary(max_size=48).map(_base64),  # base64 of anything: not an image
    st.builds(lambda: _base64(png_claiming(1, 1))), st.builds(lambda: _base64(png_claiming(1, 1))[:40]),  # truncated
    st.builds(lambda: _base64(png_claiming(100_000, 100_000))), st.builds(lambda: _base64(png_claiming(5_000, 5_000))),
    st.sampled_from([b"", b"not base64!", b"data:image/png;base64,", b"====", b"\xff"]), raw_bytes,
)
"""What `image` (base64 image files) is fuzzed with: files that are no image, truncated ones, headers
claiming a bomb's size, strings that are no base64."""


def scalar_values(dtype: str) -> st.SearchStrategy:
    if dtype in ("STRING", "BYTES"):
        return raw_bytes
    if dtype == "BOOL":
        return st.booleans()
    if dtype.startswith("FP"):
        return st.floats(width=32 if dtype != "FP16" else 16, allow_nan=True, allow_infinity=True)
    info = np.iinfo(NUMPY[dtype])
    return st.one_of(st.integers(int(info.min), int(info.max)), st.integers(-3, 40),
                     st.sampled_from([int(info.min), int(info.max), 0]))


def plausible_values(item: Declared) -> st.SearchStrategy:
    """Values a real client sends (so a case reaches the engine), per input name."""
    name = item.name
    if name in ("text_input", "decoder_text_input"):
        return st.sampled_from([b"The capital of France is", b"Hello", b"1, 2, 3,"])
    if name == "max_tokens":
        return st.integers(1, 8)
    if name in ("min_tokens", "min_length"):
        return st.integers(0, 2)
    if name in ("stream", "exclude_input_in_output") or item.dtype == "BOOL":
        return st.booleans()
    if name in ("temperature", "top_p", "repetition_penalty", "length_penalty"):
        return st.floats(0, 2)
    return scalar_values(item.dtype)


@st.composite
def tensor_of(draw, item: Declared, batching: bool, values: st.SearchStrategy, varied: bool) -> tuple[str, np.ndarray, str]:
    """One input with its declared shape and type, or (a varied one, now and then) not."""
    dtype = item.dtype if not varied or draw(st.integers(0, 11)) else draw(st.sampled_from(sorted(NUMPY)))
    if dtype != item.dtype:
        values = scalar_values(dtype)
    count = draw(st.integers(1, 4)) if -1 in item.dims else 1
    if varied and not draw(st.integers(0, 11)):
        count = draw(st.sampled_from([0, 2, 3]))
    items = draw(st.lists(values, min_size=count, max_size=count))
    shape = ([1] if batching else []) + ([count] if len(item.dims) <= 1 else [1, count])
    array = np.array(items if dtype not in ("STRING", "BYTES") else [bytes(v) for v in items], dtype=NUMPY[dtype])
    return item.name, array.reshape(shape), WIRE.get(dtype, dtype)


SAMPLING_KEYS = ["max_tokens", "n", "best_of", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs", "ignore_eos",
                 "stop", "stop_token_ids", "bad_words", "bad_words_ids", "include_stop_str_in_output",
                 "skip_special_tokens", "stream_interval", "use_beam_search", "logit_bias", "guided_json",
                 "truncate_prompt_tokens", "spaces_between_special_tokens", "no_such_key", "structured_outputs",
                 "guided_regex", "guided_choice", "guided_grammar", "guided_decoding", "guided_decoding_backend"]


@st.composite
def sampling_parameters(draw) -> tuple[str, bytes]:
    """The vLLM contract's JSON: plausible keys with wild values, or not an object, or not JSON."""
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return "sampling_parameters:not-json", draw(raw_bytes)
    if shape == 1:
        return "sampling_parameters:not-object", json.dumps(draw(wild)).encode()
    values: dict[str, Any] = {"max_tokens": draw(st.integers(1, 8)), "temperature": draw(st.sampled_from([0, 0.7, 1.0]))}
    varied = draw(st.lists(st.sampled_from(SAMPLING_KEYS), min_size=1, max_size=3, unique=True))
    for key in varied:
        values[key] = draw(wild)
    try:
        text = json.dumps(values, allow_nan=True)
    except (TypeError, ValueError):
        text = json.dumps({k: repr(v) for k, v in values.items()})
    return "sampling_parameters." + "+".join(sorted(varied)), text.encode()


@st.composite
def triton_case(draw, model: str) -> Case:
    """A request to one Triton model: its required inputs plausible, some inputs varied, sometimes
    one missing, sometimes an undeclared one."""
    inputs, batching = declared_inputs(model)
    by_name = {item.name: item for item in inputs if item.name not in ("cancel_request_id", "bls_caller", "input_ids")}
    chosen = {name: item for name, item in by_name.items() if not item.optional or name in ("text_input", "max_tokens")}
    varied = draw(st.lists(st.sampled_from(sorted(by_name)), min_size=1, max_size=3, unique=True))
    tensors, kinds = [], []
    for name, item in {**chosen, **{n: by_name[n] for n in varied}}.items():
        if name == "sampling_parameters" and name in varied:
            kind, text = draw(sampling_parameters())
            tensors.append((name, np.array([text], dtype=np.object_).reshape([1] * (1 + batching)), "BYTES"))
            kinds.append(kind)
            continue
        values = scalar_values(item.dtype) if name in varied and draw(st.booleans()) else plausible_values(item)
        if name in ("text_input", "messages") and name in varied:
            values = st.one_of(raw_bytes, plausible_values(item)) if name == "text_input" else raw_bytes
        if name == "image" and name in varied:
            values = image_values
        tensors.append(draw(tensor_of(item, batching, values, name in varied)))
        if name in varied:
            kinds.append(name if tensors[-1][2] == WIRE.get(item.dtype, item.dtype) else f"{name}:dtype")
    if model == "llm" and "sampling_parameters" not in varied and draw(st.booleans()):
        tensors.append(("sampling_parameters", np.array([json.dumps({"max_tokens": 4}).encode()], dtype=np.object_), "BYTES"))
    surprise = draw(st.integers(0, 24))
    if surprise == 0 and tensors:
        dropped = tensors.pop(draw(st.integers(0, len(tensors) - 1)))
        kinds.append(f"missing {dropped[0]}")
    elif surprise == 1:
        tensors.append(("no_such_input", np.array([1], dtype=np.int32).reshape([1] * (1 + batching)), "INT32"))
        kinds.append("undeclared input")
    unbounded = any(k.startswith(("max_tokens", "sampling_parameters")) and "max_tokens" in k for k in kinds)
    return Case(entry=model, kind=" ".join(sorted(kinds)) or "plain", tensors=tensors, bounded=not unbounded)


GATEWAY_FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "n", "temperature", "top_p", "top_k", "stream", "stop", "seed",
                        "logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
                        "suffix", "user", "stream_options", "min_tokens", "ignore_eos", "no_such_field"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "stream",
                             "stop", "seed", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
                             "stream_options", "presence_penalty", "no_such_field"],
}


@st.composite
def gateway_case(draw) -> Case:
    route = draw(st.sampled_from(sorted(GATEWAY_FIELDS)))
    body: dict[str, Any] = {"model": draw(st.sampled_from(["llm", "llm", "no-such-model", 7]))}
    if route == "/v1/completions":
        body["prompt"] = "The capital of France is"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    body["max_tokens"] = draw(st.integers(1, 6))
    varied = draw(st.lists(st.sampled_from(GATEWAY_FIELDS[route]), min_size=1, max_size=3, unique=True))
    for name in varied:
        body[name] = draw(wild)
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return Case("openai", f"{route} not-json", route=route, body=draw(raw_bytes))
    if shape == 1:
        body = draw(wild)
        varied = ["not-object"]
    try:
        raw = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        raw = repr(body).encode()
    return Case("openai", f"{route} " + "+".join(sorted(map(str, varied))), route=route, body=raw,
                bounded=not {"max_tokens", "max_completion_tokens"} & set(map(str, varied)))


def cases(models: tuple[str, ...] = TRITON_MODELS, gateway: bool = True) -> st.SearchStrategy[Case]:
    options = [triton_case(model) for model in models] + ([gateway_case()] if gateway else [])
    return st.one_of(options)


def draw_cases(count: int, seed_value: int, gateway: bool = True) -> list[Case]:
    """`count` cases, the same for the same seed (for the soak's mix)."""
    drawn: list[Case] = []

    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @seed(seed_value)
    @given(cases(gateway=gateway))
    def collect(case: Case) -> None:
        drawn.append(case)

    collect()
    return drawn[:count]


# -- sending and judging ---------------------------------------------------------------------
def judge_error(message: str) -> Outcome:
    message = message.strip()
    if not message or CRASH.search(message):
        return Outcome("crash", message or "(an error with no message)")
    return Outcome("named", message)


def send_triton(grpc_url: str, case: Case, budget_s: float = CASE_BUDGET_S) -> Outcome:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    cancel = False
    try:
        inputs = []
        for name, array, dtype in case.tensors:
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer(case.entry, inputs, request_id=uuid.uuid4().hex)
        except InferenceServerException as error:
            return judge_error(str(error))
        deadline = time.monotonic() + budget_s
        while True:
            try:
                result, error = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                cancel = True
                return Outcome("cancelled", f"no final within {budget_s:.0f} s; cancelled")
            if error is not None:
                return judge_error(error.message() if hasattr(error, "message") else str(error))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return Outcome("result")
    finally:
        try:
            client.stop_stream(cancel_requests=cancel)
        finally:
            client.close()


def send_gateway(base_url: str, case: Case, budget_s: float = CASE_BUDGET_S) -> Outcome:
    host = base_url.split("//", 1)[1]
    connection = http.client.HTTPConnection(host, timeout=budget_s)
    try:
        connection.request("POST", case.route, body=case.body,
                           headers={"Authorization": f"Bearer {GATEWAY_KEY}", "Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode("utf-8", "replace")
    except TimeoutError:
        return Outcome("cancelled", f"no answer within {budget_s:.0f} s; connection closed")
    finally:
        connection.close()
    if response.status >= 500 and response.status not in (503, 504):
        return Outcome("crash", f"{response.status}: {text[:300]}")
    if response.status >= 400:
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return Outcome("crash", f"{response.status} without an OpenAI error body: {text[:300]}")
        return judge_error(message)
    if "internal_error" in text or '"error"' in text and "data:" in text:
        return Outcome("crash", f"an error event in a 200 stream: {text[-300:]}")
    return Outcome("result")


def send(case: Case, grpc_url: str, gateway_url: str | None, budget_s: float = CASE_BUDGET_S) -> Outcome:
    if case.entry == "openai":
        assert gateway_url, "an openai case needs the gateway's URL"
        outcome = send_gateway(gateway_url, case, budget_s)
    else:
        outcome = send_triton(grpc_url, case, budget_s)
    if outcome.verdict == "cancelled" and case.bounded:  # a few tokens at most, and no answer: a lost final
        return Outcome("crash", f"no answer within {budget_s:.0f} s to a request for a few tokens at most")
    return outcome


# -- the bystander ---------------------------------------------------------------------------
BYSTANDER_PROMPT = "Once upon a time, in a small village by the sea,"


def bystander_text(grpc_url: str, max_tokens: int = 48) -> str:
    """One greedy streamed request on `llm`; its whole text."""
    from pagedserve.client.client import LLMClient

    return LLMClient(grpc_url).generate(BYSTANDER_PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True)


class Bystander(threading.Thread):
    """Runs the greedy request again and again until stopped; counts runs whose text differs
    from `reference` (what it got alone)."""

    def __init__(self, grpc_url: str, reference: str):
        super().__init__(name="fuzz-bystander", daemon=True)
        self.grpc_url, self.reference = grpc_url, reference
        self.runs, self.mismatches, self.errors = 0, [], []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                text = bystander_text(self.grpc_url)
            except Exception as error:  # noqa: BLE001 (reported, never silent)
                self.errors.append(str(error))
                continue
            self.runs += 1
            if text != self.reference:
                self.mismatches.append(text)

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)


# -- a run and its report --------------------------------------------------------------------
@dataclass
class Report:
    tried: Counter = field(default_factory=Counter)
    verdicts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    crashes: list[tuple[Case, str]] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)
    messages: Counter = field(default_factory=Counter)
    """Every named error's wording (request ids and numbers blanked), for reading them all."""

    def add(self, case: Case, outcome: Outcome) -> None:
        kind = f"{case.entry}: {case.kind.split(' ')[0].split('.')[0].split(':')[0] or 'plain'}"
        self.tried[kind] += 1
        self.verdicts[kind][outcome.verdict] += 1
        if outcome.verdict == "crash":
            self.crashes.append((case, outcome.message))
        elif outcome.verdict == "named":
            wording = re.sub(r"\[request id: \w+\] |-?\d[\d.e+-]*", "", outcome.message)[:110]
            self.examples.setdefault(kind, wording)
            self.messages[f"{case.entry}: {wording}"] += 1

    def table(self) -> str:
        lines = ["| entry: input varied | tried | results | named errors | cancelled (long) | crashes | an error it got |",
                 "|---|---:|---:|---:|---:|---:|---|"]
        for kind in sorted(self.tried):
            v = self.verdicts[kind]
            example = self.examples.get(kind, "").replace("|", "\\|")
            lines.append(f"| {kind} | {self.tried[kind]} | {v['result']} | {v['named']} | {v['cancelled']} | "
                         f"{v['crash']} | {example} |")
        total = Counter()
        for v in self.verdicts.values():
            total.update(v)
        lines.append(f"| **all** | **{sum(self.tried.values())}** | {total['result']} | {total['named']} | "
                     f"{total['cancelled']} | **{total['crash']}** | |")
        return "\n".join(lines)


def fuzz(grpc_url: str, gateway_url: str | None, examples: int, seed_value: int = 0,
         progress: Callable[[int, int], None] | None = None) -> tuple[Report, Bystander]:
    """Send `examples` cases one after another beside a bystander; the report and the bystander."""
    reference = bystander_text(grpc_url)
    bystander = Bystander(grpc_url, reference)
    bystander.start()
    report = Report()
    try:
        for i, case in enumerate(draw_cases(examples, seed_value, gateway=gateway_url is not None)):
            report.add(case, send(case, grpc_url, gateway_url))
            if progress is not None:
                progress(i + 1, examples)
    finally:
        bystander.stop()
    return report, bystander


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="gRPC endpoint of a running server (default: start one)")
    parser.add_argument("--gateway", default=None, help="base URL of a running gateway keyed with GATEWAY_KEY")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--show-errors", action="store_true", help="list every distinct named error's wording")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import read_metrics
    from pagedserve.client.process import ServerProcess, free_port, http_status
    from pagedserve.client.repository import write_repository
    from pagedserve.client.triton_server import TritonServer
    import os
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-fuzz-"))
    server = gateway = None
    if args.url is None:
        repository = write_repository(workdir / "model_repository", engine={"dtype": "float32", "max_model_len": "1024"})
        server = TritonServer(repository, log_file=workdir / "tritonserver.log").start(timeout=300)
        args.url = server.grpc_url
        if args.gateway is None:
            port = free_port()
            gateway = ServerProcess([sys.executable, "-m", "pagedserve.client.cli", "openai", "--port", str(port),
                                     "--triton-url", args.url], workdir / "gateway.log", name="pagedserve openai",
                                    env={**os.environ, "PAGEDSERVE_API_KEY": GATEWAY_KEY}).start()
            gateway.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
            args.gateway = f"http://localhost:{port}"
    started = time.monotonic()
    try:
        report, bystander = fuzz(args.url, args.gateway, args.examples, args.seed,
                                 lambda i, n: print(f"\r{i}/{n} cases", end="", file=sys.stderr, flush=True))
        print(file=sys.stderr)
        time.sleep(1.0)
        metrics_url = server.metrics_url if server else args.url.rsplit(":", 1)[0] + ":8002"
        blocks = read_metrics(metrics_url, ("pagedserve:kv_blocks_used",))["pagedserve:kv_blocks_used"]
    finally:
        if gateway is not None:
            gateway.stop()
        if server is not None:
            server.stop()
    text = "\n".join([
        f"{args.examples} cases (seed {args.seed}) in {time.monotonic() - started:.0f} s; bystander runs "
        f"{bystander.runs}, token mismatches {len(bystander.mismatches)}, errors {len(bystander.errors)}; "
        f"KV blocks used after: {blocks}", "", report.table()])
    if args.show_errors:
        text += "\n\n" + "\n".join(f"{count:5d}  {wording}" for wording, count in sorted(report.messages.items()))
    for case, message in report.crashes[:20]:
        text += f"\n\ncrash: {case.entry} {case.kind}: {message[:300]}\n  {case.tensors or case.body[:300]!r}"
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if not report.crashes and not bystander.mismatches and blocks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
