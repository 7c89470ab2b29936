"""The prefix cache's events for routers (backend/kv_events.py): vLLM's keys, the events the block
manager records as blocks are named and evicted, and vLLM's wire format on a real ZMQ socket."""

from __future__ import annotations

import time

import pytest

from pagedserve.backend.block_manager import BlockManager, hash_block
from pagedserve.backend.config import EngineConfig
from pagedserve.backend.errors import ConfigError
from pagedserve.backend.kv_events import KVEventPublisher, KVEventRecorder, KVEventsConfig, external_hash, parse
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.sequence import Sequence

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")


def test_vllms_keys_in_every_form_and_refusals_naming_the_setting():
    assert parse("") is None and parse({}) is None and EngineConfig().kv_events is None
    assert parse('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5600", "topic": "kv"}') == \
        KVEventsConfig("tcp://*:5600", "kv")
    assert parse("endpoint=tcp://*:5601") == KVEventsConfig("tcp://*:5601", "")
    assert parse({"enable_kv_cache_events": False}) is None
    assert EngineConfig(kv_events_config="endpoint=tcp://*:5602").kv_events == KVEventsConfig("tcp://*:5602")
    for value, match in (("publisher=nats", "publisher must be 'zmq'"), ("endpoint=5557", "endpoint must be"),
                         ("replay_endpoint=tcp://*:1", "unknown key"), ("enable_kv_cache_events=maybe", "true or false")):
        with pytest.raises(ConfigError, match=match) as error:
            EngineConfig(kv_events_config=value)
        assert error.value.field == "kv_events_config"


def test_named_blocks_are_stored_in_chains_and_evicted_ones_removed():
    kv = BlockManager(4, 4)
    kv.events = recorder = KVEventRecorder(4)
    seq = Sequence("a", list(range(10, 19)), SamplingParams(max_tokens=4, lora_name=None))
    assert kv.allocate(seq, 9)
    seq.num_computed_tokens = 9
    kv.cache_full_blocks(seq)  # two full blocks: one event carrying both, chained
    first, second = hash_block(None, range(10, 14)), hash_block(hash_block(None, range(10, 14)), range(14, 18))
    assert recorder.take() == [{"type": "BlockStored", "block_hashes": [external_hash(first), external_hash(second)],
                                "parent_block_hash": None, "token_ids": list(range(10, 18)), "block_size": 4,
                                "lora_id": None, "medium": "GPU", "lora_name": None}]
    kv.free(seq)
    other = Sequence("b", list(range(50, 66)), SamplingParams(max_tokens=4, lora_name="sql"))
    assert kv.allocate(other, 16)  # all four blocks: the two named ones are evicted
    events = recorder.take()
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockRemoved"]
    assert sorted(h for e in events for h in e["block_hashes"]) == sorted([external_hash(first), external_hash(second)])
    other.num_computed_tokens = 16
    kv.cache_full_blocks(other)
    (stored,) = recorder.take()
    assert stored["lora_name"] == "sql" and len(stored["block_hashes"]) == 4 and stored["parent_block_hash"] is None
    assert stored["extra_keys"] == [["sql"]] * 4  # vLLM's per-block keys: the adapter's name


def test_a_blocks_images_are_its_extra_keys_and_text_blocks_have_none():
    from pagedserve.backend.multimodal.inputs import ImageItem, MultiModalPrompt

    kv = BlockManager(4, 4)
    kv.events = recorder = KVEventRecorder(4)
    seq = Sequence("a", list(range(10, 22)), SamplingParams(max_tokens=4))
    seq.mm = MultiModalPrompt([ImageItem(b"\x01" * 16, offset=5, length=2), ImageItem(b"\x02" * 16, offset=7, length=2)])
    assert kv.allocate(seq, 12)
    seq.num_computed_tokens = 12
    kv.cache_full_blocks(seq)  # blocks [0, 4) text, [4, 8) both images, [8, 12) the second's last token
    (stored,) = recorder.take()
    assert stored["extra_keys"] == [None, ["01" * 16, "02" * 16], ["02" * 16]]
    kv.free(seq)
    text = Sequence("b", list(range(40, 48)), SamplingParams(max_tokens=4))
    assert kv.allocate(text, 8)
    text.num_computed_tokens = 8
    kv.cache_full_blocks(text)
    assert all("extra_keys" not in event for event in recorder.take() if event["type"] == "BlockStored")  # as vLLM: left out


def test_batches_go_out_as_vllm_sends_them():
    recorder = KVEventRecorder(16)
    publisher = KVEventPublisher(KVEventsConfig("tcp://127.0.0.1:*", "kv"), recorder)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.RCVTIMEO, 5000)
    subscriber.connect(publisher.endpoint)
    try:
        received = []
        for _ in range(50):  # a PUB socket drops what it sends before the subscription is through
            recorder.cleared()
            publisher.publish(recorder.take())
            try:
                received.append(subscriber.recv_multipart(flags=zmq.NOBLOCK))
                break
            except zmq.Again:
                time.sleep(0.05)
        assert received, "nothing arrived"
        topic, sequence, payload = received[0]
        assert topic == b"kv" and len(sequence) == 8
        timestamp, events, rank = msgpack.unpackb(payload)
        assert isinstance(timestamp, float) and events == [{"type": "AllBlocksCleared"}] and rank is None
        time.sleep(0.2)
        while True:  # the clears sent while the first was on its way
            try:
                sequence = subscriber.recv_multipart(flags=zmq.NOBLOCK)[1]
            except zmq.Again:
                break
        recorder.removed(b"\x00" * 7 + b"\x05" + b"\xff" * 8)
        publisher.publish(recorder.take())
        topic, following, payload = subscriber.recv_multipart()
        assert int.from_bytes(following, "big") == int.from_bytes(sequence, "big") + 1
        assert msgpack.unpackb(payload)[1] == [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}]
        publisher.publish([])  # nothing recorded: nothing sent, no number used
    finally:
        subscriber.close(linger=0)
        publisher.close()
