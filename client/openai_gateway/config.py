"""The gateway's settings, validated once; fed by `pagedserve openai` and the Python API.

Safe by default: it listens on loopback only, and refuses to listen anywhere else
without an API key unless told so explicitly (`allow_unauthenticated`). The key comes
from `api_key` / `api_key_file`, else from $PAGEDSERVE_API_KEY / $PAGEDSERVE_API_KEY_FILE.
Every limit is a knob here, and every error past a limit names its knob.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field

from .reasoning_parsers import REASONING_PARSERS
from .tool_parsers import PARSERS

API_KEY_ENV = "PAGEDSERVE_API_KEY"
API_KEY_FILE_ENV = "PAGEDSERVE_API_KEY_FILE"
LOOPBACK = "127.0.0.1"

# knob -> its `pagedserve openai` flag (errors name both)
FLAGS = {
    "max_body_bytes": "--max-body-bytes",
    "max_choices_per_request": "--max-choices-per-request",
    "max_connections": "--max-connections",
    "max_header_bytes": "--max-header-bytes",
    "header_timeout_s": "--header-timeout",
    "body_timeout_s": "--body-timeout",
    "keep_alive_timeout_s": "--keep-alive-timeout",
    "request_timeout_s": "--request-timeout",
    "tool_call_parser": "--tool-call-parser",
    "reasoning_parser": "--reasoning-parser",
    "generation_config": "--generation-config",
    "allowed_media_domains": "--allowed-media-domains",
    "max_image_bytes": "--max-image-bytes",
    "image_fetch_timeout_s": "--image-fetch-timeout",
}
GENERATION_CONFIGS = ("auto", "vllm")


def knob(name: str) -> str:
    """How an error names a setting: the config field and its command-line flag."""
    return f"the gateway's `{name}` ({FLAGS[name]})" if name in FLAGS else f"the gateway's `{name}`"


class GatewayConfigError(ValueError):
    """A gateway setting is invalid; the message names it."""


@dataclass
class GatewayConfig:
    host: str = LOOPBACK
    """Loopback by default; another address needs an API key or `allow_unauthenticated`."""
    port: int = 9000
    """9000, as Triton's own OpenAI frontend."""
    triton_url: str = "localhost:8001"
    """gRPC endpoint of the tritonserver that serves the models."""
    models: list[str] = field(default_factory=lambda: ["llm"])
    """Triton models (text in, text out, vLLM-backend contract) offered as OpenAI models."""
    served_model_name: str | None = None
    """The OpenAI model id of the one model, when it should not be its Triton name."""
    tokenizer: str | None = None
    """The served model's tokenizer (a GGUF file or a Hugging Face directory), for the routes that
    render a request's prompt as token ids without running it (vLLM's --tokenizer); default: the
    `model` parameter of the Triton model's configuration, which a gateway beside its tritonserver
    can read."""
    triton_metrics_url: str | None = None
    """host:port of the Triton server's metrics, which /metrics passes through; default: the host of
    `triton_url`, port 8002."""
    lora_modules: list[str] = field(default_factory=list)
    """LoRA adapters offered as OpenAI models of their own (vLLM's way: `model` names the adapter), each
    `NAME` (an adapter of the first model) or `NAME=MODEL` (one of that Triton model, by its OpenAI id): a
    request for it goes to that model with `lora_name` NAME in its sampling parameters. The server's
    multi_lora.json lists what each model serves."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer key checked on every /v1 route; default: $PAGEDSERVE_API_KEY; none: open.
    After validation it holds the key in effect, wherever it came from."""
    api_key_file: str | None = None
    """A file holding the key (a mounted Secret); default: $PAGEDSERVE_API_KEY_FILE.
    Surrounding whitespace (a trailing newline) is not part of the key."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback `host` without an API key (anyone who reaches it can use it)."""
    default_max_tokens: int = 16
    """max_tokens when a request gives none (vLLM's and Triton's frontend's default)."""
    generation_config: str = "auto"
    """Where a request's unset sampling fields come from (vLLM's --generation-config): auto, the served
    model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, where it sets
    them), as vLLM's OpenAI server; vllm, vLLM's own defaults (temperature 1, no top-p / top-k cut)."""
    tool_call_parser: str = "auto"
    """How `tool_choice: auto` reads a model's tool calls (vLLM's --tool-call-parser): hermes
    (Hermes, Qwen), mistral, llama3_json, or auto (each family known by its own markers)."""
    reasoning_parser: str | None = None
    """How a reasoning model's chat text is told apart into `reasoning` and the answer (vLLM's
    --reasoning-parser): deepseek_r1 (`<think>`...`</think>`), qwen3 (the same; off where a request's
    chat_template_kwargs turn enable_thinking off), openai_gptoss (gpt-oss's Harmony channels, its
    tool calls included); None: the text is the answer."""
    # -- limits --------------------------------------------------------------------------
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body (bytes); a larger one gets 413."""
    max_choices_per_request: int = 64
    """Most choices one request may ask for: prompts x `n` (completions), `n` (chat)."""
    max_connections: int = 512
    """Most open connections (and requests in flight): a request on one more gets 503 (uvicorn's limit_concurrency)."""
    max_header_bytes: int = 16 * 1024
    """Largest request line + headers (h11's max_incomplete_event_size); larger: 400 and closed."""
    header_timeout_s: float = 10.0
    """A request's line and headers must arrive within this (from connecting, or from its
    first byte on a kept-alive connection); else 408 and the connection is closed."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this after its headers; else 408."""
    keep_alive_timeout_s: float = 5.0
    """An idle kept-alive connection is closed after this (uvicorn's timeout_keep_alive)."""
    request_timeout_s: float = 600.0
    """Deadline of one request to Triton, first token to last; past it the Triton requests
    are cancelled and the client gets 504 (an error event when streamed)."""
    # -- images (a vision-language model's `image_url` parts) -------------------------------
    allowed_media_domains: list[str] = field(default_factory=list)
    """Hosts (and their subdomains) whose http(s) image URLs the gateway fetches (vLLM's
    --allowed-media-domains); empty: none, images come as data: URLs only."""
    max_image_bytes: int = 20 * 1024 * 1024
    """Largest image fetched from a URL, bytes."""
    image_fetch_timeout_s: float = 10.0
    """Seconds a URL's image may take to arrive."""

    def __post_init__(self) -> None:
        self.api_key = self._resolve_api_key()
        if not 0 <= self.port <= 65535:
            raise GatewayConfigError(f"port: {self.port} is not a TCP port (0-65535)")
        if not self.models or not all(self.models):
            raise GatewayConfigError("models: name at least one Triton model, e.g. llm")
        if self.served_model_name is not None and len(self.models) != 1:
            raise GatewayConfigError("served_model_name: only with exactly one model")
        self.adapters()
        if self.default_max_tokens < 1:
            raise GatewayConfigError(f"default_max_tokens: {self.default_max_tokens} must be at least 1")
        if self.generation_config not in GENERATION_CONFIGS:
            raise GatewayConfigError(f"generation_config (--generation-config): {self.generation_config!r} is not one of "
                                     f"{', '.join(GENERATION_CONFIGS)}")
        if self.tool_call_parser not in PARSERS:
            raise GatewayConfigError(f"tool_call_parser (--tool-call-parser): {self.tool_call_parser!r} is not one of "
                                     f"{', '.join(PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise GatewayConfigError(f"reasoning_parser (--reasoning-parser): {self.reasoning_parser!r} is not one of "
                                     f"{', '.join(REASONING_PARSERS)}")
        self.allowed_media_domains = [domain.strip().lower().lstrip(".") for domain in self.allowed_media_domains
                                      if domain.strip()]
        if ":" not in self.triton_url:
            raise GatewayConfigError(f"triton_url: {self.triton_url!r} must be host:port (the gRPC port, e.g. localhost:8001)")
        for name in ("max_body_bytes", "max_choices_per_request", "max_connections", "max_header_bytes", "max_image_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GatewayConfigError(f"{name} ({FLAGS[name]}): {value!r} must be a whole number, at least 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "request_timeout_s",
                     "image_fetch_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise GatewayConfigError(f"{name} ({FLAGS[name]}): {value!r} must be a number of seconds above 0")
        if not self.api_key and not self.allow_unauthenticated and not is_loopback(self.host):
            raise GatewayConfigError(
                f"host: {self.host!r} is not a loopback address and no API key is set, so anyone who can reach "
                f"port {self.port} could use the models. Set a key ({API_KEY_ENV}, or a file holding it: "
                f"--api-key-file / api_key_file / {API_KEY_FILE_ENV}), or pass --allow-unauthenticated "
                f"(allow_unauthenticated=True) to serve it open; or bind {LOOPBACK}."
            )

    def _resolve_api_key(self) -> str | None:
        """The key in effect: the config's own (api_key, api_key_file) before the environment's."""
        if self.api_key is not None and self.api_key_file is not None:
            raise GatewayConfigError("api_key and api_key_file: set one, not both")
        if self.api_key is not None:
            return _checked_key(self.api_key, "api_key")
        if self.api_key_file is not None:
            return _read_key_file(self.api_key_file, "api_key_file")
        from_env = os.environ.get(API_KEY_ENV) or None
        file_env = os.environ.get(API_KEY_FILE_ENV) or None
        keys = {}
        if from_env is not None:
            keys[API_KEY_ENV] = _checked_key(from_env, f"${API_KEY_ENV}")
        if file_env is not None:
            keys[API_KEY_FILE_ENV] = _read_key_file(file_env, f"${API_KEY_FILE_ENV}")
        if len(set(keys.values())) > 1:
            raise GatewayConfigError(f"${API_KEY_ENV} and the file ${API_KEY_FILE_ENV} names hold different keys: "
                                     "set one, or make them agree")
        return next(iter(keys.values()), None)

    def metrics_url(self) -> str:
        """host:port of the Triton server's metrics."""
        if self.triton_metrics_url:
            return self.triton_metrics_url
        host = self.triton_url.rsplit(":", 1)[0] if ":" in self.triton_url else self.triton_url
        return f"{host}:8002"

    def model_ids(self) -> dict[str, str]:
        """OpenAI model id -> Triton model name (an adapter's: the model that serves it)."""
        return self._base_ids() | {name: model for name, (model, _) in self.adapters().items()}

    def _base_ids(self) -> dict[str, str]:
        if self.served_model_name:
            return {self.served_model_name: self.models[0]}
        return {name: name for name in self.models}

    def adapters(self) -> dict[str, tuple[str, str]]:
        """OpenAI model id of each LoRA adapter -> (Triton model, lora_name)."""
        base = self._base_ids()
        adapters = {}
        for item in self.lora_modules:
            name, _, model = (part.strip() for part in item.partition("="))
            model = model or next(iter(base))
            if not name or model not in base or name in base or name in adapters:
                raise GatewayConfigError(f"lora_modules (--lora-module): {item!r} must be NAME or NAME=MODEL, NAME new "
                                         f"and MODEL one of {sorted(base)}")
            adapters[name] = (base[model], name)
        return adapters


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (an unknown name is not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _checked_key(key: str, source: str) -> str:
    key = key.strip()
    if not key:
        raise GatewayConfigError(f"{source}: the API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise GatewayConfigError(f"{source}: the API key must be printable ASCII without spaces (as sent in "
                                 "`Authorization: Bearer <key>`)")
    return key


def _read_key_file(path: str, source: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return _checked_key(file.read(), f"{source} {path}")
    except (OSError, UnicodeDecodeError) as error:
        raise GatewayConfigError(f"{source}: cannot read the API key from {path}: {error}") from None
