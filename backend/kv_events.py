"""The prefix cache's events published as vLLM publishes them (`kv_events_config`), so an
LLM-aware router knows which replica holds which prefix instead of guessing from what it routed
(vLLM's router: `--policy kv_aware --kv-event-source WORKER=tcp://host:port`).

What is published: a block named for prefix reuse (`BlockStored`: its hash, its parent's, its
token ids, the block size, the LoRA adapter's name), a named block evicted (`BlockRemoved`), the
prefix cache reset (`AllBlocksCleared`). The block manager records them as they happen; the engine
sends them once a step as one batch. The wire format is vLLM's: a ZMQ PUB socket, each message
`[topic, sequence number (8 bytes, big-endian), payload]`, the payload a msgpack array
`[timestamp, events, data-parallel rank]`, each event a msgpack map tagged by `"type"`. A block's
hash is the first 8 bytes of its content hash as an unsigned integer (vLLM's integer form);
routers key blocks by the token ids they carry, so only its consistency matters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .values import setting_items

FIELD = "kv_events_config"
KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "topic")


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"
    """Where the PUB socket binds (a `*` host, as vLLM binds)."""
    topic: str = ""


def parse(value: Any) -> KVEventsConfig | None:
    """The parsed setting (vLLM's --kv-events-config keys), None when off: empty, or
    `enable_kv_cache_events` false."""
    if value is None or (isinstance(value, str) and not value.strip()) or value == {}:
        return None
    items = setting_items(FIELD, value)
    unknown = sorted(set(items) - set(KEYS))
    if unknown:
        raise ConfigError(FIELD, f"unknown key(s) {unknown}; known keys: {list(KEYS)}")
    enabled = str(items.get("enable_kv_cache_events", "true")).strip().lower()
    if enabled not in ("true", "false", "1", "0"):
        raise ConfigError(FIELD, f"enable_kv_cache_events must be true or false, got {enabled!r}")
    if enabled in ("false", "0"):
        return None
    publisher = str(items.get("publisher", "zmq")).strip().lower()
    if publisher != "zmq":
        raise ConfigError(FIELD, f"publisher must be 'zmq' (the one vLLM's routers subscribe to), got {publisher!r}")
    endpoint = str(items.get("endpoint", KVEventsConfig.endpoint)).strip()
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(FIELD, f"endpoint must be tcp://HOST:PORT or ipc://PATH (e.g. tcp://*:5557), got {endpoint!r}")
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        raise ConfigError(FIELD, "needs pyzmq and msgpack: pip install 'pagedserve[kv-events]'") from None
    return KVEventsConfig(endpoint, str(items.get("topic", "")))


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big")


@dataclass
class KVEventRecorder:
    """The events of the block manager since the last `take` (vLLM's event shapes, as dicts)."""

    block_size: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int], lora_name: str | None,
               extra_keys: tuple | None = None) -> None:
        """extra_keys: what else the block's hash covers, as vLLM names it per block (the content
        hashes of the images whose tokens it holds, then the LoRA adapter's name); vLLM leaves the
        field out of an event none of whose blocks has any."""
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [external_hash(block_hash)],
                                 "parent_block_hash": external_hash(parent) if parent is not None else None,
                                 "token_ids": list(token_ids), "block_size": self.block_size, "lora_id": None,
                                 "medium": "GPU", "lora_name": lora_name}
        if extra_keys:
            event["extra_keys"] = [list(extra_keys)]
        last = self.events[-1] if self.events else None
        if (last is not None and last["type"] == "BlockStored" and last["lora_name"] == lora_name
                and last["block_hashes"][-1] == event["parent_block_hash"]):  # the chain goes on: one event, as vLLM
            if "extra_keys" in last or "extra_keys" in event:
                last["extra_keys"] = (last.get("extra_keys") or [None] * len(last["block_hashes"])) + \
                    event.get("extra_keys", [None])
            last["block_hashes"] += event["block_hashes"]
            last["token_ids"] += event["token_ids"]
        else:
            self.events.append(event)

    def removed(self, block_hash: bytes) -> None:
        self.events.append({"type": "BlockRemoved", "block_hashes": [external_hash(block_hash)], "medium": "GPU"})

    def cleared(self) -> None:
        self.events.append({"type": "AllBlocksCleared"})

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class KVEventPublisher:
    """A ZMQ PUB socket sending each step's events (those `recorder` gathered) as one numbered batch."""

    def __init__(self, config: KVEventsConfig, recorder: KVEventRecorder):
        import msgpack
        import zmq

        self.recorder = recorder
        self._zmq, self._pack = zmq, msgpack.packb
        self._context: Any = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self._sequence = 0

    def flush(self) -> None:
        """Send what the recorder gathered since the last flush."""
        self.publish(self.recorder.take())

    def publish(self, events: list[dict[str, Any]]) -> None:
        """One batch (nothing when there are no events); never blocks (a slow subscriber loses
        messages, and its router sees the gap in the sequence numbers)."""
        if not events:
            return
        payload = self._pack([time.time(), events, None], use_bin_type=True)
        try:
            self._socket.send_multipart([self._topic, self._sequence.to_bytes(8, "big"), payload],
                                        flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass
        self._sequence += 1

    def close(self) -> None:
        self._socket.close(linger=0)
