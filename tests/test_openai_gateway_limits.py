"""The OpenAI gateway is safe by default (issue 45): loopback unless a key is set, the key
checked in constant time and read from the environment or a file, every limit a knob
whose error names it, a deadline on every request to Triton, a /health that says only
ready or not, and its own failures reported as internal.

The gateway is served for real (uvicorn on a loopback port, in a thread, with the
settings `pagedserve openai` uses) in front of a fake Triton, so each test takes well
under a second; tests/integration/test_openai_gateway.py runs it against tritonserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

from pagedserve.client.cli import main as cli
from pagedserve.client.openai_gateway import GatewayConfig, GatewayConfigError
from pagedserve.client.openai_gateway import app as app_module
from pagedserve.client.openai_gateway.app import create_app
from pagedserve.client.openai_gateway.config import API_KEY_ENV, API_KEY_FILE_ENV
from pagedserve.client.openai_gateway.server import uvicorn_config
from pagedserve.client.openai_gateway.triton_stream import LLMStep, SampleDelta

KEY = "sk-test-0123456789"
CHAT = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)


# -- a fake Triton and a real server in front of it ------------------------------------
def step(text: str = "hi", final: bool = True) -> LLMStep:
    return LLMStep([SampleDelta(text=text, finish_reason="stop" if final else None, num_tokens=1)], 3, final)


class FakeTriton:
    """TritonLLM's interface. `script(request)` is an async generator of steps (default:
    one final step); `opened` / `closed` count the streams begun and closed (a closed
    stream is a cancelled Triton request unless it ended)."""

    def __init__(self, script=None, ready: bool = True):
        self.script = script or self.one_step
        self.ready = ready
        self.requests: list = []
        self.opened = self.closed = 0

    @staticmethod
    async def one_step(request):
        yield step()

    async def is_ready(self, model: str) -> bool:
        return self.ready

    async def stream(self, model, request):
        self.requests.append(request)
        self.opened += 1
        try:
            async for item in self.script(request):
                yield item
        finally:
            self.closed += 1

    async def close(self) -> None:
        pass


async def first_then_hang(request):
    yield step("first ", final=False)
    await asyncio.Event().wait()


async def hang(request):
    await asyncio.Event().wait()
    yield step()  # never reached


class Gateway:
    def __init__(self, port: int, triton: FakeTriton):
        self.port, self.triton = port, triton

    def connection(self, timeout: float = 5.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def call(self, method: str, path: str, body=None, headers=None, timeout: float = 5.0):
        """(status, parsed JSON body or text, headers) of one request on a new connection."""
        connection = self.connection(timeout)
        try:
            raw = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            connection.request(method, path, body=raw, headers={"Content-Type": "application/json"} | (headers or {}))
            response = connection.getresponse()
            data = response.read().decode()
            with contextlib.suppress(ValueError):
                data = json.loads(data)
            return response.status, data, response
        finally:
            connection.close()

    def post(self, path: str, body, key: str | None = None, **kwargs):
        return self.call("POST", path, body, {"Authorization": f"Bearer {key}"} if key else None, **kwargs)

    def raw_socket(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@contextlib.contextmanager
def serving(triton: FakeTriton | None = None, **settings):
    """The gateway with `settings` (GatewayConfig fields) on a free loopback port."""
    triton = triton or FakeTriton()
    config = GatewayConfig(port=0, **settings)
    server = uvicorn.Server(uvicorn_config(config, create_app(config, triton=triton), timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.01)
    try:
        yield Gateway(server.servers[0].sockets[0].getsockname()[1], triton)
    finally:
        server.should_exit = True
        thread.join(10)


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def read_until_closed(client: socket.socket) -> str:
    """What the server sends until it closes the connection."""
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data.decode()


def events(text: str) -> list:
    """The data of each server-sent event, parsed ("[DONE]" as is)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


# -- binding and the key -----------------------------------------------------------------
def test_it_binds_loopback_by_default_and_refuses_an_open_network_address():
    assert GatewayConfig().host == "127.0.0.1"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        GatewayConfig(host=host)
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "gateway.example"):
        with pytest.raises(GatewayConfigError) as refused:
            GatewayConfig(host=host)
        message = str(refused.value)
        assert "PAGEDSERVE_API_KEY" in message and "--api-key-file" in message
        assert "--allow-unauthenticated" in message and "allow_unauthenticated=True" in message
    assert GatewayConfig(host="0.0.0.0", api_key=KEY).api_key == KEY
    assert GatewayConfig(host="0.0.0.0", allow_unauthenticated=True).api_key is None


def test_the_command_line_refuses_an_open_address_without_a_key(monkeypatch, capsys):
    served = []
    monkeypatch.setattr("pagedserve.client.openai_gateway.run_gateway", served.append)
    assert cli(["openai", "--host", "0.0.0.0"]) == 2
    assert "--allow-unauthenticated" in capsys.readouterr().err and not served
    assert cli(["openai", "--host", "0.0.0.0", "--allow-unauthenticated", "--request-timeout", "7",
                "--max-body-bytes", "1000", "--max-choices-per-request", "8"]) == 0
    (config,) = served
    assert (config.host, config.api_key, config.request_timeout_s, config.max_body_bytes,
            config.max_choices_per_request) == ("0.0.0.0", None, 7.0, 1000, 8)
    assert cli(["openai"]) == 0 and served[-1].host == "127.0.0.1"


def test_api_key_on_the_command_line_works_but_warns_about_ps(monkeypatch, capsys):
    served = []
    monkeypatch.setattr("pagedserve.client.openai_gateway.run_gateway", served.append)
    assert cli(["openai", "--host", "0.0.0.0", "--api-key", KEY]) == 0
    err = capsys.readouterr().err
    assert "ps" in err and API_KEY_ENV in err and "--api-key-file" in err
    assert served[0].api_key == KEY and KEY not in repr(served[0])
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert cli(["openai", "--host", "0.0.0.0"]) == 0
    assert served[1].api_key == KEY and "warning" not in capsys.readouterr().err


def test_the_key_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "api-key"
    secret.write_text(KEY + "\n")  # as `kubectl create secret --from-file` of an echoed key holds it
    assert GatewayConfig(api_key_file=str(secret)).api_key == KEY
    monkeypatch.setenv(API_KEY_FILE_ENV, str(secret))
    assert GatewayConfig(host="0.0.0.0").api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, KEY)  # a chart may set both from the same Secret
    assert GatewayConfig().api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, "another-key")
    with pytest.raises(GatewayConfigError, match=API_KEY_FILE_ENV):
        GatewayConfig()
    assert GatewayConfig(api_key="explicit").api_key == "explicit"  # the config's own key comes first
    monkeypatch.delenv(API_KEY_FILE_ENV)
    assert GatewayConfig().api_key == "another-key"
    with pytest.raises(GatewayConfigError, match="set one"):
        GatewayConfig(api_key=KEY, api_key_file=str(secret))
    with pytest.raises(GatewayConfigError, match="cannot read"):
        GatewayConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(GatewayConfigError, match="empty"):
        GatewayConfig(api_key_file=str(tmp_path / "empty"))
    with pytest.raises(GatewayConfigError, match="printable ASCII"):
        GatewayConfig(api_key="two words")


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    with serving(api_key=KEY) as gateway:
        assert gateway.call("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        assert compared and all(len(a) == len(b) for a, b in compared)  # digests: the length does not leak
        for header in (None, f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer "):
            status, body, _ = gateway.call("GET", "/v1/models", headers={"Authorization": header} if header else None)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", header
        assert gateway.call("GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
        status, body, _ = gateway.post("/v1/chat/completions", CHAT)
        assert status == 401 and not gateway.triton.requests
        assert gateway.call("GET", "/health")[0] == 200  # the one route open without the key
        assert gateway.call("GET", "/v1/nothing")[0] == 401


def test_without_the_key_no_body_is_read():
    with serving(api_key=KEY, max_body_bytes=10**6, body_timeout_s=5) as gateway, gateway.raw_socket() as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        started = time.monotonic()
        answer = read_until_closed(client)  # at once, not after the body or its timeout
        assert answer.startswith("HTTP/1.1 401") and time.monotonic() - started < 2


# -- /health and what is not served ---------------------------------------------------------
def test_health_says_ready_or_not_and_nothing_else():
    with serving(triton_url="triton.internal:8001") as gateway:
        for path in ("/health", "/health/ready"):
            assert gateway.call("GET", path)[:2] == (200, {"status": "ok"})
        gateway.triton.ready = False
        status, body, _ = gateway.call("GET", "/health")
        assert (status, body) == (503, {"status": "unavailable"})
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert gateway.call("GET", path)[0] == 404


# -- limits ---------------------------------------------------------------------------------
def test_a_body_past_max_body_bytes_is_refused_naming_the_knob():
    with serving(max_body_bytes=2000) as gateway:
        assert gateway.post("/v1/chat/completions", CHAT)[0] == 200
        big = CHAT | {"messages": [{"role": "user", "content": "x" * 3000}]}
        status, body, response = gateway.post("/v1/chat/completions", big)
        assert status == 413 and "max_body_bytes" in body["error"]["message"]
        assert "--max-body-bytes" in body["error"]["message"] and response.getheader("connection") == "close"
        # no Content-Length (chunked): counted as it arrives
        connection = gateway.connection()
        connection.request("POST", "/v1/chat/completions", body=iter([json.dumps(big).encode()]),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413 and "max_body_bytes" in response.read().decode()
        connection.close()
        assert len(gateway.triton.requests) == 1


def test_a_body_that_trickles_past_body_timeout_gets_408():
    with serving(body_timeout_s=0.3) as gateway, gateway.raw_socket() as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"model\"")
        started = time.monotonic()
        answer = read_until_closed(client)
        assert answer.startswith("HTTP/1.1 408") and "body_timeout_s" in answer and "--body-timeout" in answer
        assert time.monotonic() - started < 3 and not gateway.triton.requests


def test_prompts_times_n_past_max_choices_per_request_is_refused_before_triton():
    with serving(max_choices_per_request=4) as gateway:
        ok = {"model": "llm", "prompt": ["a", "b"], "n": 2}
        assert gateway.post("/v1/completions", ok)[0] == 200 and len(gateway.triton.requests) == 2
        for body, param in (({"prompt": ["a", "b", "c"], "n": 2}, "n"), ({"prompt": ["p"] * 5}, "prompt"),
                            ({"prompt": "a", "n": 5}, "n")):
            status, answer, _ = gateway.post("/v1/completions", {"model": "llm"} | body)
            assert status == 400 and answer["error"]["param"] == param, body
            assert "max_choices_per_request" in answer["error"]["message"]
            assert "--max-choices-per-request" in answer["error"]["message"]
        status, answer, _ = gateway.post("/v1/chat/completions", CHAT | {"n": 5})
        assert status == 400 and answer["error"]["param"] == "n" and "max_choices_per_request" in answer["error"]["message"]
        assert len(gateway.triton.requests) == 2  # nothing refused reached Triton


def test_the_default_caps_a_fan_out():
    assert GatewayConfig().max_choices_per_request == 64
    with serving() as gateway:
        status, answer, _ = gateway.post("/v1/completions", {"model": "llm", "prompt": ["a"] * 33, "n": 2})
        assert status == 400 and "max_choices_per_request" in answer["error"]["message"]
        assert not gateway.triton.requests


def test_headers_that_do_not_arrive_within_header_timeout_get_408_and_the_connection_closed():
    with serving(header_timeout_s=0.4) as gateway:
        with gateway.raw_socket() as silent:  # connects and sends nothing
            started = time.monotonic()
            answer = read_until_closed(silent)
            assert answer.startswith("HTTP/1.1 408") and "header_timeout_s" in answer and "--header-timeout" in answer
            assert 0.3 < time.monotonic() - started < 3
        with gateway.raw_socket() as slow:  # a byte at a time never extends the deadline
            started = time.monotonic()
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.05)
                if time.monotonic() - started > 0.6:
                    break
            assert slow.recv(4096).decode().startswith("HTTP/1.1 408")
        # a whole request in time is served
        with gateway.raw_socket() as polite:
            polite.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert polite.recv(4096).decode().startswith("HTTP/1.1 200")


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_timeout():
    with serving(keep_alive_timeout_s=0.3, header_timeout_s=5) as gateway, gateway.raw_socket() as client:
        started = time.monotonic()
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_until_closed(client)  # the server closes it
        assert answer.startswith("HTTP/1.1 200") and answer.endswith('{"status":"ok"}')
        assert 0.25 < time.monotonic() - started < 3


def test_headers_past_max_header_bytes_are_refused():
    with serving(max_header_bytes=4096) as gateway:
        assert gateway.call("GET", "/health", headers={"X-Pad": "a" * 3000})[0] == 200
        status, text, response = gateway.call("GET", "/health", headers={"X-Pad": "a" * 8000})  # arrives whole
        assert status == 431 and "max_header_bytes" in text and "--max-header-bytes" in text
        with gateway.raw_socket() as client:  # or in pieces
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(OSError):
                for _ in range(10):
                    client.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
            assert client.recv(4096).decode().startswith("HTTP/1.1 431")


def test_a_connection_past_max_connections_gets_503():
    with serving(max_connections=2) as gateway, gateway.raw_socket() as one, gateway.raw_socket() as two:
        one.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert one.recv(4096).decode().startswith("HTTP/1.1 200")
        two.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert two.recv(4096).decode().startswith("HTTP/1.1 200")
        assert gateway.call("GET", "/health")[0] == 503  # a third connection, while two are open


# -- the deadline to Triton -------------------------------------------------------------------
def test_a_request_past_request_timeout_is_cancelled_and_answered_504():
    with serving(FakeTriton(first_then_hang), request_timeout_s=0.5) as gateway:
        started = time.monotonic()
        status, body, _ = gateway.post("/v1/chat/completions", CHAT, timeout=10)
        assert status == 504 and body["error"]["code"] == "timeout"
        assert "request_timeout_s" in body["error"]["message"] and "--request-timeout" in body["error"]["message"]
        assert 0.4 < time.monotonic() - started < 5
        assert wait_for(lambda: gateway.triton.closed == gateway.triton.opened == 1)  # the Triton request was cancelled

        # streamed: the 200 went out with the first chunk, so the deadline is an error event, then [DONE]
        status, text, _ = gateway.post("/v1/chat/completions", CHAT | {"stream": True}, timeout=10)
        sent = events(text)
        assert status == 200 and sent[-1] == "[DONE]"
        assert any(e["choices"] and e["choices"][0]["delta"].get("content") == "first "
                   for e in sent[:-2] if isinstance(e, dict))
        assert sent[-2]["error"]["code"] == "timeout" and "request_timeout_s" in sent[-2]["error"]["message"]
        assert wait_for(lambda: gateway.triton.closed == gateway.triton.opened == 2)

    with serving(FakeTriton(hang), request_timeout_s=0.3) as gateway:  # nothing at all before the deadline
        status, body, _ = gateway.post("/v1/completions", {"model": "llm", "prompt": ["a", "b"], "stream": True}, timeout=10)
        assert status == 504 and body["error"]["code"] == "timeout"
        assert wait_for(lambda: gateway.triton.closed == gateway.triton.opened == 2)


def test_the_default_deadline_is_finite():
    assert 0 < GatewayConfig().request_timeout_s <= 3600
    with pytest.raises(GatewayConfigError, match="request_timeout_s"):
        GatewayConfig(request_timeout_s=0)
    with pytest.raises(GatewayConfigError, match="max_body_bytes"):
        GatewayConfig(max_body_bytes=0)


# -- what each failure is called ------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_gateway():
    with pytest.MonkeyPatch.context() as environment:
        environment.delenv(API_KEY_ENV, raising=False)
        environment.delenv(API_KEY_FILE_ENV, raising=False)
        with serving() as gateway:
            yield gateway


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"top_k": 1e20}, "top_k"),
    ("/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**40}, "max_completion_tokens"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"seed": -1}, "seed"),
    ("/v1/chat/completions", {"seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 11}, "repetition_penalty"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"stop_token_ids": [5, -1]}, "stop_token_ids.1"),
    ("/v1/chat/completions", {"stop_token_ids": [2**31]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {"stream_interval": 0}, "stream_interval"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_every_numeric_field_is_range_checked_naming_it(shared_gateway, path, fields, param):
    base = CHAT if "chat" in path else {"model": "llm", "prompt": "hi"}
    shared_gateway.triton.requests.clear()
    status, body, _ = shared_gateway.post(path, base | fields)
    assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert not shared_gateway.triton.requests


def test_nan_and_infinity_are_refused():
    with serving() as gateway:
        for raw in ('{"temperature": NaN', '{"top_p": Infinity', '{"min_p": NaN', '{"repetition_penalty": -Infinity'):
            body = raw + ', "model": "llm", "messages": [{"role": "user", "content": "hi"}]}'
            status, answer, _ = gateway.post("/v1/chat/completions", body)
            assert status == 400 and answer["error"]["param"] == raw[2:].split('"')[0], raw
        status, answer, _ = gateway.post("/v1/chat/completions", '{"model": "llm", "messages": [')
        assert status == 400 and answer["error"]["param"] is None and "not valid JSON" in answer["error"]["message"]
        assert not gateway.triton.requests


def test_bodies_that_are_no_json_object_get_an_openai_error_naming_the_body():
    """Found by benchmarks/fuzz.py: bytes that are not UTF-8 got Starlette's own `{"detail": ...}`,
    an empty body an error naming the field `None`."""
    with serving() as gateway:
        for raw in (b"\x8d\xb8HC]H\tLr", b"", b"[1, 2]", b"null"):
            status, answer, _ = gateway.post("/v1/completions", raw)
            assert status == 400 and answer["error"]["type"] == "invalid_request_error", (raw, answer)
            assert "None" not in answer["error"]["message"] and "body" in answer["error"]["message"], (raw, answer)
        assert not gateway.triton.requests


async def broken(request):
    yield step("ok ", final=False)
    raise RuntimeError("a bug in the gateway")


async def broken_at_once(request):
    raise KeyError("a bug in the gateway")
    yield step()  # an async generator


def test_a_failure_of_the_gateway_itself_is_500_internal_not_the_clients_400():
    with serving(FakeTriton(broken_at_once)) as gateway:
        status, body, _ = gateway.post("/v1/chat/completions", CHAT)
        assert status == 500 and body["error"]["code"] == "internal_error"
        assert body["error"]["type"] == "internal_server_error" and "KeyError" not in body["error"]["message"]
    with serving(FakeTriton(broken)) as gateway:
        status, text, _ = gateway.post("/v1/chat/completions", CHAT | {"stream": True})
        sent = events(text)
        assert status == 200 and sent[-2]["error"]["code"] == "internal_error" and sent[-1] == "[DONE]"
        assert gateway.post("/v1/chat/completions", CHAT)[1]["error"]["code"] == "internal_error"
