"""Writes the golden vLLM KV-event payloads used by router/tests/kv_events.rs.

Run with msgspec installed (`pip install msgspec==0.19.0`):

    python3 router/tests/data/vllm-kv-events/gen.py

The structs below mirror (field names, order, defaults and msgspec options) the wire types of
vLLM's `vllm/distributed/kv_events.py` in its two encodings:

- `array`: the `array_like=True` releases (vLLM 0.9-0.11, and SGLang's
  `sglang/srt/disaggregation/kv_events.py`): a batch is `[ts, events, data_parallel_rank]` and
  each event a positional array with the tag first.
- `map`: the current vLLM main branch, where neither the batch nor the events are
  `array_like`: a batch is `{"ts", "events", "data_parallel_rank"}` and each event a map with
  the tag under `"type"`.

Each file is one batch's msgpack payload (the third ZMQ frame), encoded by
`msgspec.msgpack.Encoder()` as the publisher thread does.
"""

import os
from types import SimpleNamespace
from typing import Any

import msgspec

ExternalBlockHash = bytes | int
HERE = os.path.dirname(os.path.abspath(__file__))


def tokens(start, n):
    return list(range(start, start + n))


def wire_types(array_like, kv_cache_spec):
    """One encoding's batch and event structs: `array_like` is the msgspec option the releases
    set on both the batch and the events; `kv_cache_spec` adds the two trailing `BlockStored`
    fields that main has and the releases do not."""

    class Batch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event, tag="BlockStored"):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None

    class BlockStoredWithSpec(BlockStored, tag="BlockStored"):
        # msgspec puts these after the inherited fields, where main has them.
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event, tag="BlockRemoved"):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event, tag="AllBlocksCleared"):
        pass

    return SimpleNamespace(
        Batch=Batch,
        BlockStored=BlockStoredWithSpec if kv_cache_spec else BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
    )


# array_like releases, and current main.
ARRAY = wire_types(array_like=True, kv_cache_spec=False)
MAP = wire_types(array_like=False, kv_cache_spec=True)


def stored(wire, block_hashes, parent_block_hash, token_ids, medium="GPU", **later_fields):
    """A `BlockStored` of 16-token blocks without LoRA."""
    return wire.BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **later_fields,
    )


def write(name, wire, ts, *events):
    """Writes one batch of `events` from data-parallel rank 0, encoded as the publisher does."""
    batch = wire.Batch(ts=ts, events=list(events), data_parallel_rank=0)
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(msgspec.msgpack.Encoder().encode(batch))


# Integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): one above i64::MAX to pin u64.
write(
    "array-0.msgpack",
    ARRAY,
    1700000000.5,
    stored(ARRAY, [11, 2**63 + 12], None, tokens(100, 32)),
)
write(
    "array-1.msgpack",
    ARRAY,
    1700000001.25,
    stored(ARRAY, [13], 2**63 + 12, tokens(132, 16), group_idx=0),
    ARRAY.BlockRemoved(block_hashes=[13], medium="GPU"),
)
write("array-2.msgpack", ARRAY, 1700000002.0, ARRAY.AllBlocksCleared())

# Byte hashes (the default: sha256 digests, 32 bytes).
h0 = bytes(range(32))
h1 = bytes(range(1, 33))
write(
    "map-0.msgpack",
    MAP,
    1700000003.5,
    stored(MAP, [h0], None, tokens(100, 16)),
    stored(
        MAP,
        [h1],
        h0,
        tokens(116, 16),
        medium=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    ),
)
write(
    "map-1.msgpack",
    MAP,
    1700000004.0,
    MAP.BlockRemoved(block_hashes=[h1], medium=None),
    MAP.AllBlocksCleared(),
)
