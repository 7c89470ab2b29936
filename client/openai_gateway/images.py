"""A chat's `image_url` parts as `llm`'s `image` input takes them (base64 files, in order), the
parts themselves becoming the chat template's image placeholders ({"type": "image"}).

`data:` URLs are always taken (their payload checked as base64). An http(s) URL is fetched only
from the hosts an operator names (`allowed_media_domains`, vLLM's --allowed-media-domains), at
most `max_image_bytes`, within `image_fetch_timeout_s`, following no redirect: a gateway that
fetches whatever URL a client names lets any client make requests from inside the cluster
(server-side request forgery). Every refusal names the part's field."""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from .config import knob
from .errors import OpenAIError


@dataclass(frozen=True)
class RemoteImage:
    """An http(s) image URL to fetch before the request goes to Triton."""

    url: str
    param: str
    """The part's field, e.g. messages[0].content[1].image_url.url."""


Image = str | RemoteImage
"""A base64 image file, or one to fetch."""


def image_of_part(part: Any, param: str) -> Image:
    """An `image_url` part's image: its data URL's base64 payload, or the http(s) URL to fetch."""
    extra = part.model_extra or {}
    value = extra.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise OpenAIError(400, f"`{param}.image_url.url`: give the image as a data: URL or an http(s) URL",
                          param=f"{param}.image_url.url")
    param = f"{param}.image_url.url"
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64") or not payload:
            raise OpenAIError(400, f"`{param}`: a data: URL must be base64 (data:image/png;base64,...)", param=param)
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise OpenAIError(400, f"`{param}`: the data: URL's payload is not base64", param=param) from None
        return payload
    if urllib.parse.urlsplit(url).scheme in ("http", "https"):
        return RemoteImage(url, param)
    raise OpenAIError(400, f"`{param}`: only data: and http(s) URLs are taken", param=param)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect could lead anywhere: the allowed host must serve the image itself


async def resolve(images: list[Image], allowed_domains: list[str], max_bytes: int, timeout_s: float) -> list[str]:
    """Every image as base64, the remote ones fetched (concurrently) within the gateway's limits."""
    remote = [image for image in images if isinstance(image, RemoteImage)]
    if not remote:
        return [image for image in images if isinstance(image, str)]
    fetched = iter(await asyncio.gather(*(asyncio.to_thread(_fetch, image, allowed_domains, max_bytes, timeout_s)
                                          for image in remote)))
    return [next(fetched) if isinstance(image, RemoteImage) else image for image in images]


def _fetch(image: RemoteImage, allowed_domains: list[str], max_bytes: int, timeout_s: float) -> str:
    host = (urllib.parse.urlsplit(image.url).hostname or "").lower()
    if not any(host == domain or host.endswith("." + domain) for domain in allowed_domains):
        why = (f"{host!r} is not among the gateway's allowed media domains ({knob('allowed_media_domains')})"
               if allowed_domains else f"this gateway fetches no image URLs ({knob('allowed_media_domains')} is empty)")
        raise OpenAIError(400, f"`{image.param}`: {why}; send the image as a data: URL", param=image.param)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(image.url, headers={"User-Agent": "pagedserve"}), timeout=timeout_s) as reply:
            data = reply.read(max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as error:
        raise OpenAIError(400, f"`{image.param}`: could not fetch the image ({error})", param=image.param) from None
    if len(data) > max_bytes:
        raise OpenAIError(400, f"`{image.param}`: the image is larger than {max_bytes} bytes ({knob('max_image_bytes')})",
                          param=image.param)
    return base64.b64encode(data).decode()
