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
from typing import Any

import msgspec

ExternalBlockHash = bytes | int
HERE = os.path.dirname(os.path.abspath(__file__))


def tokens(start, n):
    return list(range(start, start + n))


# --- array_like releases -------------------------------------------------------------------
class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredA(ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemovedA(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedA(ArrayEvent, tag="AllBlocksCleared"):
    pass


# --- map (current main) --------------------------------------------------------------------
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredM(MapEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedM(MapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedM(MapEvent, tag="AllBlocksCleared"):
    pass


def write(name, obj):
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(msgspec.msgpack.Encoder().encode(obj))


# Integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): one above i64::MAX to pin u64.
write(
    "array-0.msgpack",
    ArrayBatch(
        ts=1700000000.5,
        events=[
            BlockStoredA(
                block_hashes=[11, 2**63 + 12],
                parent_block_hash=None,
                token_ids=tokens(100, 32),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=0,
    ),
)
write(
    "array-1.msgpack",
    ArrayBatch(
        ts=1700000001.25,
        events=[
            BlockStoredA(
                block_hashes=[13],
                parent_block_hash=2**63 + 12,
                token_ids=tokens(132, 16),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            BlockRemovedA(block_hashes=[13], medium="GPU"),
        ],
        data_parallel_rank=0,
    ),
)
write(
    "array-2.msgpack",
    ArrayBatch(ts=1700000002.0, events=[AllBlocksClearedA()], data_parallel_rank=0),
)

# Byte hashes (the default: sha256 digests, 32 bytes).
h0 = bytes(range(32))
h1 = bytes(range(1, 33))
write(
    "map-0.msgpack",
    MapBatch(
        ts=1700000003.5,
        events=[
            BlockStoredM(
                block_hashes=[h0],
                parent_block_hash=None,
                token_ids=tokens(100, 16),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockStoredM(
                block_hashes=[h1],
                parent_block_hash=h0,
                token_ids=tokens(116, 16),
                block_size=16,
                lora_id=None,
                medium=None,
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
        ],
        data_parallel_rank=0,
    ),
)
write(
    "map-1.msgpack",
    MapBatch(
        ts=1700000004.0,
        events=[BlockRemovedM(block_hashes=[h1], medium=None), AllBlocksClearedM()],
        data_parallel_rank=0,
    ),
)
