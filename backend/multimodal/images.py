"""Images as requests send them (file bytes, or PIL images through the Python API), decoded to RGB
under a pixel cap checked from the header before any pixel is decoded (a small file can claim a
huge picture), and named by a hash of their pixels."""

from __future__ import annotations

import hashlib
import io
from typing import Any

from ..errors import InvalidRequestError


def load_image(data: Any, field: str, max_pixels: int) -> Any:
    """An RGB PIL image from file bytes (PNG, JPEG, WebP, ... what Pillow reads) or a PIL image;
    InvalidRequestError naming `field` for anything else, a truncated file, or a picture over
    `max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        try:
            image = Image.open(io.BytesIO(bytes(data)))
        except Image.DecompressionBombError as error:  # Pillow's own guard, far above ours, read from the header
            raise InvalidRequestError(field, f"is over the engine's max_image_pixels ({max_pixels}): {error}") from None
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise InvalidRequestError(field, f"is not an image Pillow can read ({error})") from None
    else:
        raise InvalidRequestError(field, f"must be image file bytes or a PIL image, got {type(data).__name__}")
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequestError(field, f"has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise InvalidRequestError(field, f"is {width}x{height} = {width * height} pixels; the limit is {max_pixels} "
                                         "(the engine's max_image_pixels): send a smaller image")
    try:
        return image.convert("RGB")  # decodes: a truncated or corrupt file fails here
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidRequestError(field, f"could not be decoded ({error}); is the file complete?") from None


def image_hash(image: Any) -> bytes:
    """128-bit blake2b of an RGB image's size and pixels: the same picture, however it was encoded
    or sent, gets the same name."""
    digest = hashlib.blake2b(b"image", digest_size=16)
    digest.update(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.digest()


def pixels_hash(pixels: Any) -> bytes:
    """128-bit blake2b of a processed picture (a tensor of pixel values, e.g. one of Gemma 3's
    pan-and-scan crops), for the runs of tokens made from such a piece rather than a whole image."""
    digest = hashlib.blake2b(b"pixels", digest_size=16)
    digest.update(str(tuple(pixels.shape)).encode())
    digest.update(pixels.contiguous().numpy().tobytes())
    return digest.digest()
