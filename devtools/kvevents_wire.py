"""KV event messages as vLLM and SGLang put them on the wire, built with msgpack from the engines' msgspec
struct definitions (the decoder under test never builds them).

msgspec's rules that decide the bytes, and how each builder follows them:
- `tag=True`: the class name is the tag; under `array_like=True` it is element 0 of the array, else the
  key "type", written first in the map.
- `array_like=True`: every field in declaration order (a subclass's after its base's, kw_only ones
  last); `omit_defaults` leaves nothing out of an array (msgspec 0.23 checked, below).
- without `array_like`: a map of the fields in declaration order; with `omit_defaults=True` the fields
  equal to their default are left out, a field without a default is always written (even None).
- float fields as float 64, ints in their shortest form, `bytes` as bin, `str` as str (msgpack-python's
  `packb` does the same, so the builders only arrange the values).

Checked once, byte for byte, against msgspec 0.23.0's own Encoder on structs declared as below: every
encoding identical (msgspec is not a dependency of the project or its tests).

The struct definitions followed, per encoding (repository, path, version):

VLLM_V1_EARLY  vllm-project/vllm vllm/distributed/kv_events.py @ b4e69e0a (PR #16750):
    EventBatch(array_like, omit_defaults): ts: float, events: list
    KVCacheEvent(array_like, omit_defaults, tag)
    BlockStored: block_hashes: list[int], parent_block_hash: int|None, token_ids: list[int], block_size: int,
                 lora_id: int|None
    BlockRemoved: block_hashes: list[int];  AllBlocksCleared: (no field)
    Hashes: Python hash() values, signed 64-bit.
VLLM_ARRAY     the same file before PR #42892 (fields of #19737, #27577, #33304, #37688, #40984 added):
    EventBatch(array_like, omit_defaults): ts, events, data_parallel_rank: int|None = None
    BlockStored: ..., lora_id, medium: str|None, lora_name: str|None, extra_keys = None, group_idx = None,
                 kv_cache_spec_kind = None, kv_cache_spec_sliding_window = None
    BlockRemoved: block_hashes, medium: str|None, group_idx = None
    Hashes: u64 (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or the digest's bytes (=0).
VLLM_MAP       @ 0181ea31 and v0.26.0 (PR #42892): the events lose array_like (maps, omit_defaults);
    the envelope stays an array (v0.26.0 capture in volcano-sh/kthena#1535); 0181ea31 itself declares
    the envelope without array_like, so a map envelope {ts, events, data_parallel_rank} is built too.
SGLANG_EARLY   sgl-project/sglang python/sglang/srt/disaggregation/kv_events.py @ 006d053f:
    identical to VLLM_V1_EARLY; hashes signed (hash(tuple(page_tokens))).
SGLANG_MEDIUM  the same path, medium/salt era (StorageMedium, BlockStoredWithMetadata):
    EventBatch(array_like, no omit_defaults): ts, events, attn_dp_rank: int|None = None (always written)
    KVCacheEvent(array_like, tag, no omit_defaults)
    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium: str|None = None
    BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only): metadata {cache_salt} (written last)
    BlockRemoved: block_hashes, medium = None
    Hashes: signed int64 of the SHA-256 chain's first 8 bytes.
SGLANG_MAP     after PR #37482: events as tagged maps, cache_salt/session_id optional keys, the envelope
    still [ts, events, attn_dp_rank] (PR #37271 shows both byte layouts).
"""

from __future__ import annotations

import msgpack

ENCODINGS = ("vllm-v1-early", "vllm-array", "vllm-map", "vllm-map-envelope", "sglang-early", "sglang-medium",
             "sglang-map")


NO_DEFAULT = object()


def _stored_fields(encoding: str, hashes, parent, tokens, block_size, medium, group_idx, salt, lora_name):
    """(name, value, default or NO_DEFAULT) of BlockStored's fields in declaration order."""
    base = [("block_hashes", hashes, NO_DEFAULT), ("parent_block_hash", parent, NO_DEFAULT),
            ("token_ids", tokens, NO_DEFAULT), ("block_size", block_size, NO_DEFAULT), ("lora_id", None, NO_DEFAULT)]
    if encoding in ("vllm-v1-early", "sglang-early"):
        return base
    if encoding.startswith("vllm"):
        return base + [("medium", medium, NO_DEFAULT), ("lora_name", lora_name, NO_DEFAULT),
                       ("extra_keys", _extra_keys(hashes, group_idx, salt), None),
                       ("group_idx", group_idx, None),
                       ("kv_cache_spec_kind", "full_attention" if group_idx is not None else None, None),
                       ("kv_cache_spec_sliding_window", None, None)]
    fields = base + [("medium", medium, None)]
    if encoding == "sglang-map" and salt is not None:
        fields.append(("cache_salt", salt, None))
    if encoding == "sglang-map" and lora_name is not None:
        fields.append(("lora_name", lora_name, None))
    return fields


def _extra_keys(hashes, group_idx, salt):
    """vLLM's extra_keys: one entry per block; a salt as the typed CacheSaltKey (tag "cache_salt", RFC
    vllm#55487; the struct's array form assumed) on the request's first block only, as vLLM salts it."""
    if salt is not None:
        return [[["cache_salt", salt]]] + [None] * (len(hashes) - 1)
    return [None] * len(hashes) if group_idx is not None else None


def _removed_fields(encoding: str, hashes, medium, group_idx):
    if encoding in ("vllm-v1-early", "sglang-early"):
        return [("block_hashes", hashes, NO_DEFAULT)]
    if encoding.startswith("vllm"):
        return [("block_hashes", hashes, NO_DEFAULT), ("medium", medium, NO_DEFAULT), ("group_idx", group_idx, None)]
    return [("block_hashes", hashes, NO_DEFAULT), ("medium", medium, None)]


def _event(encoding: str, tag: str, fields: list, trailing: list | None = None):
    if encoding in ("vllm-map", "vllm-map-envelope", "sglang-map"):
        event = {"type": tag}
        for name, value, default in fields:
            if default is NO_DEFAULT or value != default:  # every map encoding here has omit_defaults
                event[name] = value
        return event
    return [tag, *(value for _, value, _ in fields), *(trailing or [])]


def stored(encoding: str, hashes: list, parent=None, block_size: int = 16, medium: str | None = "GPU",
           group_idx: int | None = None, salt: str | None = None, lora_name: str | None = None):
    tokens = list(range(block_size * len(hashes)))
    if encoding in ("vllm-v1-early", "sglang-early"):
        medium = None
    fields = _stored_fields(encoding, hashes, parent, tokens, block_size, medium, group_idx, salt, lora_name)
    trailing = [{"cache_salt": salt}] if encoding == "sglang-medium" and salt is not None else None
    return _event(encoding, "BlockStored", fields, trailing)


def removed(encoding: str, hashes: list, medium: str | None = "GPU", group_idx: int | None = None):
    if encoding in ("vllm-v1-early", "sglang-early"):
        medium = None
    return _event(encoding, "BlockRemoved", _removed_fields(encoding, hashes, medium, group_idx))


def cleared(encoding: str):
    return _event(encoding, "AllBlocksCleared", [])


def batch(encoding: str, ts: float, events: list, dp_rank: int | None = 0) -> bytes:
    if encoding == "vllm-map-envelope":
        envelope = {"ts": ts, "events": events}
        if dp_rank is not None:
            envelope["data_parallel_rank"] = dp_rank
        return msgpack.packb(envelope)
    if encoding in ("vllm-v1-early", "sglang-early"):
        return msgpack.packb([ts, events])
    return msgpack.packb([ts, events, dp_rank])  # an array writes every field, a None rank too


def message(encoding: str, seq: int, ts: float, events: list, topic: bytes = b"", dp_rank: int | None = 0) -> list:
    """The three frames the engines' ZmqEventPublisher sends."""
    return [topic, seq.to_bytes(8, "big"), batch(encoding, ts, events, dp_rank)]


def hash_as(key: int, form: str):
    """The wire form of the unsigned 64-bit `key`: `u64`, `i64` (the same 64 bits as signed) or `bytes`
    (a 32-byte digest whose last 8 bytes are `key`, as vLLM sends with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    if form == "u64":
        return key
    if form == "i64":
        return key - (1 << 64) if key >= 1 << 63 else key
    return bytes(range(24)) + key.to_bytes(8, "big")
