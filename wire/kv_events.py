"""SGLang KV-cache events (srt/disaggregation/kv_events.py) as msgspec structs.

Frames on the ZMQ PUB socket are ``[topic, seq (8-byte big-endian), msgpack(EventBatch)]``.
SGLang >= 0.5.20 encodes events as tagged maps (``{"type": "BlockStored", ...}``);
<= 0.5.19 as tagged arrays (``["BlockStored", ...]``). Both decode here; ``encode_batch``
writes either form so the simulator can impersonate either version.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Literal, Union

import msgspec

Medium = Literal["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]


class _MapEvent(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class BlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    cache_salt: str | None = None


class BlockStoredRef(_MapEvent, tag="BlockStored"):
    """BlockStored without ``token_ids``, for routers that only need the hashes: msgspec
    skips the (long) token list without building it. See ``decode_batch(tokens=False)``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    cache_salt: str | None = None


class BlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    attn_dp_rank: int | None = None


class _RefBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStoredRef, BlockRemoved, AllBlocksCleared]]
    attn_dp_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


_SEQ = struct.Struct(">q")
_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(EventBatch)
_events_decoder = msgspec.msgpack.Decoder(list[Event])
_raw_decoder = msgspec.msgpack.Decoder(_RawBatch)
_ref_decoder = msgspec.msgpack.Decoder(_RefBatch)
_any_decoder = msgspec.msgpack.Decoder()


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    return _SEQ.unpack(frame)[0]


def _legacy(event: Event) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: EventBatch, *, legacy_arrays: bool = False) -> bytes:
    if not legacy_arrays:
        return _encoder.encode(batch)
    return _encoder.encode([batch.ts, [_legacy(e) for e in batch.events], batch.attn_dp_rank])


def _from_legacy(raw: list) -> Event:
    """An array-encoded event; anything else (a map of a kind this version does not know, a
    newer engine's) is a ValueError, which drops its batch as undecodable."""
    kind = raw[0] if isinstance(raw, list) and raw else None
    try:
        if kind == "BlockStored":
            return BlockStored(raw[1], raw[2], raw[3], raw[4], *(raw[5:7]))
        if kind == "BlockRemoved":
            return BlockRemoved(raw[1], *(raw[2:3]))
    except IndexError:
        raise ValueError(f"KV event {kind} with {len(raw) - 1} fields") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {kind if kind is not None else raw!r:.100}")


# Batches bigger than this are decoded a part at a time (``decode_in_parts``).
_WHOLE_BYTES = 32 * 1024


def decode_in_parts(payload: bytes, size: int = 256) -> Iterator[list[Event]]:
    """A batch's events, at most ``size`` at a time, each part decoded only when asked for.

    One scheduler step reports every page it stored in one message: thousands of events at
    page size 1 (~1 us each to decode and as much to apply), which a consumer on an event
    loop spreads over several turns instead of stalling the loop for milliseconds. Batches
    under 32 KiB decode in one call, as ``decode_batch``; bigger ones are split undecoded
    (``msgspec.Raw``) and each part decoded as one msgpack array. A part that does not
    decode raises where it comes, after the parts before it."""
    if len(payload) <= _WHOLE_BYTES:
        yield decode_batch(payload).events
        return
    raws = _raw_decoder.decode(payload).events
    for start in range(0, len(raws), size):
        part = raws[start:start + size]
        try:
            events = _events_decoder.decode(_array_header(len(part)) + b"".join(part))
        except msgspec.ValidationError:
            events = _legacy_events(part)
        yield events


def _legacy_events(raws: list[msgspec.Raw]) -> list[Event]:
    """Events in SGLang <= 0.5.19's arrays (or of a kind this version does not know)."""
    return [_from_legacy(_any_decoder.decode(e)) for e in raws]


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def decode_batch(payload: bytes, *, tokens: bool = True) -> EventBatch:
    """Decode either SGLang encoding; unknown event kinds raise ValueError. With
    ``tokens=False`` map-encoded stores come back as ``BlockStoredRef`` (no token ids)."""
    if not tokens:
        try:
            return _ref_decoder.decode(payload)  # type: ignore[return-value]  # same shape
        except msgspec.ValidationError:
            pass  # legacy arrays: decoded in full below
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    raw = _raw_decoder.decode(payload)
    return EventBatch(raw.ts, _legacy_events(raw.events), raw.attn_dp_rank)
