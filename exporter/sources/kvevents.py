"""Decodes the KV-cache event streams vLLM and SGLang publish over ZMQ PUB into block events.

A message is three frames, `[topic, seq, payload]`: `seq` an 8-byte big-endian counter that starts at
0 per publisher process, `payload` a msgpack batch written by msgspec. Every shape seen in the field
is accepted (docs/kv-events.md names the engine versions):

- batch: a positional array `[ts, events, dp_rank?]` (every engine so far), or a map
  `{ts, events, data_parallel_rank | attn_dp_rank}`;
- event: a tagged array `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium,
  ...]` (msgspec `array_like=True`: vLLM before its switch to maps, SGLang before #37482) or a tagged
  map `{"type": "BlockStored", "block_hashes": [...], "medium": "GPU", ...}` (later versions);
- block hash: an unsigned or signed 64-bit int, or the digest's bytes; all become one unsigned 64-bit
  key (vLLM's int form is the digest's last 8 bytes read big-endian, so a digest folds to the same key).

A store also names who holds its blocks: the LoRA adapter (`lora_name`, else the deprecated `lora_id`)
and the tenant, the request's `cache_salt` (SGLang's `cache_salt` key or `metadata`, vLLM's `extra_keys`,
untagged as vLLM 0.32 sends them or tagged "cache_salt"; vLLM puts the salt on a request's first block
only, so the pool state lets the later blocks inherit their parent's tenant). A salt never leaves this module in
clear: `tenant_of` turns it into a keyed hash (docs/kv-events.md, "Who holds the KV").

Nothing here knows about pools: exporter.blocks folds the events into pool state.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import msgpack

MASK64 = (1 << 64) - 1
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
# Positions of the fields the tracker reads in the array form of each event (index 0 is the tag).
_ARRAY_MEDIUM = {STORED: 6, REMOVED: 2}
_ARRAY_GROUP = {STORED: 9, REMOVED: 3}
_ARRAY_PARENT, _ARRAY_TOKEN_IDS, _ARRAY_BLOCK_SIZE, _ARRAY_LORA_ID, _ARRAY_LORA_NAME, _ARRAY_EXTRA_KEYS = 2, 3, 4, 5, 7, 8
_ARRAY_FIELDS = {STORED: 12, REMOVED: 4, CLEARED: 1}  # the longest array of each seen (vLLM, 2026)
# Map keys known per event type: vLLM's and SGLang's fields, newest versions included.
_KNOWN_KEYS = {
    STORED: frozenset({"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                       "event_version", "locality", "ownership", "cache_salt", "session_id", "metadata"}),
    REMOVED: frozenset({"type", "block_hashes", "medium", "group_idx", "locality", "ownership"}),
    CLEARED: frozenset({"type"}),
}
END_SEQ = MASK64  # the replay stream's last reply carries seq -1 as 8 bytes
# Payload bytes per event from which a batch is decoded field by field with the token ids skipped: building the ids
# costs about 0.02 us each, reading a batch one field at a time about 0.1 us more per field (a store has about 11,
# a removal 4), so skipping pays once the ids outweigh the fields; from 1,024 bytes per event (about 200 ids) it
# pays for certain. At 512 ids per block decoding takes half as long; at 16 a batch is read whole as before
# (bench/kvevents.py).
SKIP_TOKEN_IDS_FROM = 1024


# A salt is the tenant's isolation key, often low in entropy (a tenant id): an unkeyed short hash of it
# could be reversed by hashing candidate ids. Keyed by a random key per exporter process, the label
# tells tenants apart and reveals nothing; the price: a tenant's label changes when the exporter restarts.
_TENANT_KEY = os.urandom(16)
TENANT_HEX_DIGITS = 12  # 48 bits: no collision expected below millions of tenants per pool


def tenant_of(salt) -> str | None:
    """The tenant label of a cache salt: a keyed BLAKE2b digest, never the salt."""
    if salt is None or salt == "" or salt == b"":
        return None
    data = salt if isinstance(salt, bytes) else str(salt).encode()
    return hashlib.blake2b(data, key=_TENANT_KEY, digest_size=TENANT_HEX_DIGITS // 2).hexdigest()


class DecodeError(Exception):
    """A message that is not a KV event batch; the reason is for the log, never for a label."""


@dataclass(slots=True)
class BlockEvent:
    kind: str  # STORED, REMOVED or CLEARED
    hashes: list[int]  # unsigned 64-bit keys; empty for CLEARED
    medium: str | None = None  # None where the engine sends none (the GPU pool)
    group_idx: int | None = None  # KV cache group of hybrid models (vLLM); None for the one group
    parent: int | None = None  # a store's parent block (its chain's previous block), as a key
    adapter: str | None = None  # a store's LoRA adapter; None for the base model
    tenant: str | None = None  # a store's tenant (tenant_of its cache salt); None where no salt is sent
    # A store's token ids (every block's, in order) and tokens per block: decoded only when asked for (the fleet
    # index, exporter.fleet, matches blocks by content); None where not asked for or not sent.
    token_ids: list[int] | None = None
    block_size: int | None = None


@dataclass(slots=True)
class Batch:
    seq: int
    ts: float  # the engine's wall clock when it published the batch (unix seconds)
    dp_rank: int | None
    events: list[BlockEvent]
    unknown_types: int = 0  # events of a type this decoder does not know: skipped
    unknown_fields: int = 0  # events carrying fields this decoder does not know: decoded, the fields skipped


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes], max_bytes: int, token_ids: bool = False) -> Batch:
    """A PUB message `[topic, seq, payload]` as a Batch; raises DecodeError."""
    if len(frames) != 3:
        raise DecodeError(f"{len(frames)} frames, expected 3 (topic, sequence, payload)")
    _, seq_frame, payload = frames
    return decode_payload(parse_seq(seq_frame), payload, max_bytes, token_ids)


def decode_payload(seq: int, payload: bytes, max_bytes: int, token_ids: bool = False) -> Batch:
    """`token_ids`: keep the stores' token ids (the fleet index's), else they are skipped unread where that pays."""
    if len(payload) > max_bytes:
        raise DecodeError(f"payload of {len(payload)} bytes, above the limit of {max_bytes}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False) if token_ids else _unpack_batch(payload)
    except Exception as err:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise DecodeError(f"not msgpack: {err}") from None
    if isinstance(batch, list) and len(batch) >= 2:
        ts, raw_events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
    elif isinstance(batch, dict):
        ts, raw_events = batch.get("ts"), batch.get("events")
        dp_rank = batch.get("data_parallel_rank", batch.get("attn_dp_rank"))
    else:
        raise DecodeError("batch is neither [ts, events, dp_rank?] nor a map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(raw_events, list):
        raise DecodeError("batch without a numeric ts and a list of events")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise DecodeError(f"dp_rank {dp_rank!r} is not an integer")
    out = Batch(seq, float(ts), dp_rank, [])
    try:
        _decode_events(raw_events, out, token_ids)
    except (TypeError, AttributeError):  # an unhashable tag, a map where a list belongs, ...
        raise DecodeError("an event of the wrong shape") from None
    return out


def _unpack_batch(payload: bytes):
    """The payload as msgpack.unpackb reads it; in a batch whose stores carry long token lists (vLLM sends every
    block's token ids) those are skipped unread, None in their place: only the fleet index uses them, and with it
    on, decode_payload reads the batch whole instead."""
    size = len(payload)
    # Events counted by their tags (BlockStored, BlockRemoved, AllBlocksCleared; a token id's bytes may match too:
    # an estimate), in large batches only.
    if size < SKIP_TOKEN_IDS_FROM or size < SKIP_TOKEN_IDS_FROM * payload.count(b"Block"):
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=size)
    unpacker.feed(payload)
    unpack = unpacker.unpack
    kind = _kind(payload, 0)
    if kind is list:
        fields = unpacker.read_array_header()
        batch = [_unpack_events(unpacker, payload) if field == 1 else unpack() for field in range(fields)]
    elif kind is dict:
        batch = {}
        for _ in range(unpacker.read_map_header()):
            key = unpack()
            batch[key] = _unpack_events(unpacker, payload) if key == "events" else unpack()
    else:
        batch = unpack()
    if unpacker.tell() != size:
        raise ValueError("extra data after the batch")
    return batch


def _unpack_events(unpacker: msgpack.Unpacker, payload: bytes):
    unpack, skip, tell = unpacker.unpack, unpacker.skip, unpacker.tell
    if _kind(payload, tell()) is not list:
        return unpack()
    events = []
    for _ in range(unpacker.read_array_header()):
        kind = _kind(payload, tell())
        if kind is dict:
            event = {}
            for _ in range(unpacker.read_map_header()):
                key = unpack()
                if key == "token_ids":
                    skip()
                    event[key] = None
                else:
                    event[key] = unpack()
        elif kind is list:
            event = []
            for field in range(unpacker.read_array_header()):
                if field == _ARRAY_TOKEN_IDS and event[0] == STORED:
                    skip()
                    event.append(None)
                else:
                    event.append(unpack())
        else:
            event = unpack()
        events.append(event)
    return events


def _kind(payload: bytes, at: int) -> type | None:
    """dict or list where the msgpack object at `at` is a map or an array (by its first byte), else None."""
    if at >= len(payload):
        return None
    first = payload[at]
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return dict
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return list
    return None


def _decode_events(raw_events: list, out: Batch, with_tokens: bool) -> None:
    append = out.events.append
    for raw in raw_events:
        if isinstance(raw, list) and raw:
            kind = raw[0]
            if kind not in _ARRAY_FIELDS:
                out.unknown_types += 1
                continue
            if kind == CLEARED:
                append(BlockEvent(CLEARED, []))
                if len(raw) > 1:
                    out.unknown_fields += 1
                continue
            if len(raw) < 2:
                raise DecodeError(f"{kind} without block_hashes")
            medium_at, group_at = _ARRAY_MEDIUM[kind], _ARRAY_GROUP[kind]
            medium, group = _at(raw, medium_at), _at(raw, group_at)
            if len(raw) > _ARRAY_FIELDS[kind]:
                out.unknown_fields += 1
            hashes = raw[1]
            if kind == STORED:
                # SGLang's salted stores: its 7 fields plus a {cache_salt} map where vLLM has lora_name
                salted = isinstance(_at(raw, _ARRAY_LORA_NAME), dict)
                salt = raw[_ARRAY_LORA_NAME].get("cache_salt") if salted else None
                lora_name = None if salted else _at(raw, _ARRAY_LORA_NAME)
                lora_id, extra, parent = _at(raw, _ARRAY_LORA_ID), _at(raw, _ARRAY_EXTRA_KEYS), _at(raw, _ARRAY_PARENT)
                tokens, block_size = _at(raw, _ARRAY_TOKEN_IDS), _at(raw, _ARRAY_BLOCK_SIZE)
        elif isinstance(raw, dict):
            kind = raw.get("type")
            known = _KNOWN_KEYS.get(kind)
            if known is None:
                out.unknown_types += 1
                continue
            if not raw.keys() <= known:
                out.unknown_fields += 1
            if kind == CLEARED:
                append(BlockEvent(CLEARED, []))
                continue
            hashes, medium, group = raw.get("block_hashes"), raw.get("medium"), raw.get("group_idx")
            if kind == STORED:
                lora_name, lora_id, extra = raw.get("lora_name"), raw.get("lora_id"), raw.get("extra_keys")
                metadata = raw.get("metadata")
                salt = raw.get("cache_salt") or (metadata.get("cache_salt") if isinstance(metadata, dict) else None)
                parent = raw.get("parent_block_hash")
                tokens, block_size = raw.get("token_ids"), raw.get("block_size")
        else:
            raise DecodeError(f"event is neither a tagged array nor a tagged map: {type(raw).__name__}")
        if medium is not None and not isinstance(medium, str):
            raise DecodeError(f"{kind} medium {medium!r} is not a string")
        if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
            raise DecodeError(f"{kind} group_idx {group!r} is not an integer")
        if kind == REMOVED:
            append(BlockEvent(kind, normalise_hashes(hashes), medium, group))
            continue
        adapter = lora_name if isinstance(lora_name, str) and lora_name else (
            str(lora_id) if isinstance(lora_id, int) and not isinstance(lora_id, bool) else None)
        if salt is None:
            salt = _salt_of(extra, adapter is not None)
        parent_key = normalise_hashes([parent])[0] if parent is not None else None
        event = BlockEvent(kind, normalise_hashes(hashes), medium, group, parent_key, adapter, tenant_of(salt),
                           block_size=block_size if block_size.__class__ is int and block_size >= 0 else None)
        if with_tokens:
            event.token_ids = tokens if isinstance(tokens, list) else None
        append(event)


def _at(raw: list, index: int):
    """Field `index` of an array event; None where the array is shorter (a version without the field)."""
    return raw[index] if len(raw) > index else None


def _salt_of(extra_keys, with_lora: bool):
    """The cache salt among vLLM's extra_keys (one entry per block; the salt on a request's first block only).
    Tagged (a `cache_salt` entry, as an array or a map), or untagged as vLLM 0.32 publishes them
    (vllm/v1/core/kv_cache_utils.py, to_event_extra_keys): the block's keys in the order the LoRA name, the
    multi-modal (identifier, offset) pairs, the salt, the prompt-embeds digests (bytes); so the strings of the
    first block are the LoRA name where the request has an adapter (`with_lora`), then the salt."""
    if not isinstance(extra_keys, list):
        return None
    for block_keys in extra_keys:
        for entry in block_keys if isinstance(block_keys, (list, tuple)) else ():
            if isinstance(entry, list) and len(entry) >= 2 and entry[0] == "cache_salt":
                return entry[1]
            if isinstance(entry, dict) and entry.get("type") == "cache_salt":
                return entry.get("cache_salt", entry.get("salt", entry.get("value")))
    first = extra_keys[0] if extra_keys else None
    strings = [entry for entry in first if isinstance(entry, str)] if isinstance(first, (list, tuple)) else []
    return strings[1 if with_lora else 0] if len(strings) == (2 if with_lora else 1) else None


def normalise_hashes(hashes) -> list[int]:
    """Block hashes as unsigned 64-bit keys: ints masked (a signed -1 is 2**64-1), bytes by their last 8."""
    if not isinstance(hashes, list):
        raise DecodeError(f"block_hashes is {type(hashes).__name__}, not a list")
    try:
        return [h & MASK64 if h.__class__ is int else _fold(h) for h in hashes]
    except TypeError:
        raise DecodeError("a block hash is neither an integer nor bytes") from None


def _fold(value) -> int:
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise TypeError(value)
