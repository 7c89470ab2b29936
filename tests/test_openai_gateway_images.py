"""A chat's image_url parts on the way to `llm` (client/openai_gateway/images.py): each becomes the
chat template's {"type": "image"} placeholder and its image goes, base64, to the `image` input in
order; data: URLs always, http(s) URLs only from the operator's allowed media domains, within the
size cap, with no redirect followed; every refusal names the part's field."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading

import pytest

from pagedserve.client.openai_gateway import GatewayConfig
from pagedserve.client.openai_gateway.errors import OpenAIError
from pagedserve.client.openai_gateway.images import RemoteImage, resolve
from pagedserve.client.openai_gateway.schemas import ChatCompletionRequest
from pagedserve.client.openai_gateway.translate import chat_request

PNG = b"\x89PNG\r\n\x1a\n" + b"pixels" * 10
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def chat(*parts: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": list(parts)}])


def test_image_parts_become_placeholders_and_the_image_input_in_order():
    request = chat_request(chat({"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": DATA_URL}},
                                {"type": "image_url", "image_url": {"url": "https://images.example.com/b.png"}}), 16)
    assert request.messages == [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                                             {"type": "image"}]}]
    assert request.images == [base64.b64encode(PNG).decode(),
                              RemoteImage("https://images.example.com/b.png", "messages[0].content[2].image_url.url")]
    text_only = chat_request(chat({"type": "text", "text": "a"}, {"type": "text", "text": "b"}), 16)
    assert text_only.messages[0]["content"] == "ab" and "image" not in text_only.inputs()


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@not base64@@@", "payload is not base64"),
    ("data:image/png,rawbytes", "a data: URL must be base64"),
    ("file:///etc/passwd", r"only data: and http\(s\) URLs are taken"),
    ("", r"give the image as a data: URL or an http\(s\) URL"),
])
def test_bad_image_urls_are_refused_by_field(url, message):
    with pytest.raises(OpenAIError, match=message) as refused:
        chat_request(chat({"type": "image_url", "image_url": {"url": url}}), 16)
    assert refused.value.status == 400 and refused.value.param == "messages[0].content[0].image_url.url"


class ImageServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere.png")
            self.end_headers()
            return
        body = PNG * (1000 if self.path == "/big.png" else 1)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fetch(url: str, allowed: list[str], max_bytes: int = 10_000) -> list[str]:
    return asyncio.run(resolve(["inline", RemoteImage(url, "messages[0].content[0].image_url.url")], allowed, max_bytes, 5.0))


def test_urls_are_fetched_only_from_allowed_domains_within_the_cap(image_host):
    assert fetch(f"{image_host}/a.png", ["127.0.0.1"]) == ["inline", base64.b64encode(PNG).decode()]
    for allowed, message in (([], "fetches no image URLs"), (["images.example.com"], "is not among")):
        with pytest.raises(OpenAIError, match=message) as refused:
            fetch(f"{image_host}/a.png", allowed)
        assert refused.value.param == "messages[0].content[0].image_url.url"
    with pytest.raises(OpenAIError, match="larger than 10000 bytes"):
        fetch(f"{image_host}/big.png", ["127.0.0.1"])
    with pytest.raises(OpenAIError, match="could not fetch the image"):  # a redirect is not followed
        fetch(f"{image_host}/moved.png", ["127.0.0.1"])


def test_media_settings_are_checked_once():
    config = GatewayConfig(allowed_media_domains=[" Images.Example.com ", ".cdn.example.org"])
    assert config.allowed_media_domains == ["images.example.com", "cdn.example.org"]
    from pagedserve.client.openai_gateway.config import GatewayConfigError
    with pytest.raises(GatewayConfigError, match="max_image_bytes"):
        GatewayConfig(max_image_bytes=0)
