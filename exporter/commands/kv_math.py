"""`kvcache-exporter kv-math`: the KV memory arithmetic (kvcache_exporter.kvmath) on the command line,
and a live target's capacity."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from ..config import Config, target_from_url
from ..kvmath import AUTO, DTYPE_BYTES, ArchitectureError, KVLayout, layout_from_mapping
from ..runtime.direct import DirectPolls
from ..units import format_bytes, parse_size

# How long `--target` waits for the engine's page: one read by hand, not a poll on a cadence.
TARGET_TIMEOUT = 10.0


class _UsageError(Exception):
    pass


class TargetUnavailable(Exception):
    pass


def read_capacity_tokens(url: str) -> int:
    """The engine's KV capacity in tokens, summed over its data-parallel pools. Raises ValueError (a bad
    URL) or TargetUnavailable."""
    with DirectPolls(Config(targets=(target_from_url(url),), timeout=TARGET_TIMEOUT)) as polls:
        (outcome,) = polls.poll_once()
        if not outcome.up:
            reason = next(reason for reason, count in polls.targets[0].failures.items() if count)
            raise TargetUnavailable(f"{url}: poll failed ({reason})")
    capacities = [rank.gauges.get("capacity_tokens") for rank in outcome.ranks.values()]
    if not capacities or None in capacities:
        raise TargetUnavailable(f"{url}: the engine does not report its KV capacity")
    return int(sum(capacities))


class _ArgumentParser(argparse.ArgumentParser):
    """Raises instead of printing the usage block and exiting, so main() reports one line."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# CLI flags for the explicit numbers: flag name = mapping key with dashes.
_EXPLICIT_FLAGS = (
    ("layers", "decoder layers"),
    ("attention_layers", "layers that hold KV (default: layers - recurrent layers)"),
    ("recurrent_layers", "Mamba / linear-attention layers (hold a fixed state, no KV)"),
    ("attention_heads", "query heads (KV heads default to it; head dim = hidden size / it)"),
    ("kv_heads", "KV heads (GQA: fewer than attention heads; MQA: 1)"),
    ("head_dim", "head dimension"),
    ("hidden_size", "hidden size (head dim = hidden size / attention heads when not given)"),
    ("sliding_window", "sliding window in tokens"),
    ("sliding_window_layers", "attention layers that use the window (default: all)"),
    ("kv_lora_rank", "MLA compressed KV dimension (DeepSeek V2/V3)"),
    ("qk_rope_head_dim", "MLA decoupled RoPE key dimension"),
)


def _build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(
        prog="kvcache-exporter kv-math",
        description="KV-cache memory arithmetic: bytes per token, per sequence, and how many "
        "sequences fit in a KV budget (docs/kv-math.md).",
    )
    model = parser.add_argument_group("model: a config.json, or explicit numbers")
    model.add_argument("--config-json", metavar="PATH", help="Hugging Face config.json (or its directory)")
    for key, text in _EXPLICIT_FLAGS:
        model.add_argument("--" + key.replace("_", "-"), dest=key, type=_positive_int, metavar="N", help=text)
    model.add_argument("--model-dtype", help="the model's dtype (default: the config's torch_dtype, else bf16)")
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--dtype", "--kv-cache-dtype", dest="kv_cache_dtype", default=AUTO,
        help="KV cache dtype: auto (= model dtype), bf16, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2, int8",
    )
    serving.add_argument("--state-dtype", help="recurrent state dtype of hybrid models (default: model dtype)")
    serving.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (figures per GPU)")
    serving.add_argument("--seq-len", type=_positive_int, metavar="L", help="tokens per sequence")
    serving.add_argument("--budget", type=_size, metavar="SIZE", help="KV memory per GPU, e.g. 40GiB or 80GB")
    serving.add_argument("--offload-size", type=_size, metavar="SIZE",
                         help="a KV offload tier's size over all TP ranks (vLLM --kv-offloading-size), e.g. 64GiB")
    capacity = serving.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-tokens", type=_positive_int, metavar="N", help="KV pool capacity in tokens")
    capacity.add_argument("--target", metavar="URL", help="read the capacity in tokens from a live engine's /metrics")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _layout_from_args(args: argparse.Namespace) -> KVLayout:
    explicit = {key: getattr(args, key) for key, _ in _EXPLICIT_FLAGS if getattr(args, key) is not None}
    if args.config_json and explicit:
        raise _UsageError(f"--config-json cannot be combined with {_flag(next(iter(explicit)))}")
    if not args.config_json and not explicit:
        raise _UsageError("give --config-json PATH, or the model's numbers (--layers, --kv-heads, --head-dim, ...)")
    if args.config_json:
        explicit["config_json"] = args.config_json
    if args.model_dtype:
        explicit["model_dtype"] = args.model_dtype
    layout = layout_from_mapping(explicit)
    if args.state_dtype:
        layout = dataclasses.replace(layout, state_dtype=args.state_dtype)
    return layout


def _flag(key: str) -> str:
    """The command-line flag for a mapping key or argument name (`kv_heads` -> `--kv-heads`)."""
    if key == "kv_cache_dtype":
        return "--dtype"
    return "--" + key.replace("_", "-") if re.fullmatch(r"[a-z_]+", key) else key


def _report(layout: KVLayout, args: argparse.Namespace, capacity_tokens: int | None) -> dict[str, Any]:
    kv_dtype = layout.resolve_kv_dtype(args.kv_cache_dtype)
    tp, seq_len = args.tp, args.seq_len
    report: dict[str, Any] = {
        "layout": dataclasses.asdict(layout),
        "kv_cache_dtype": kv_dtype,
        "bytes_per_element": DTYPE_BYTES[kv_dtype],
        "tp": tp,
        "bytes_per_token": layout.bytes_per_token(kv_dtype),
        "bytes_per_token_per_gpu": layout.bytes_per_token(kv_dtype, tp),
        "recurrent_state_bytes_per_sequence": layout.recurrent_state_bytes(),
        "recurrent_state_bytes_per_sequence_per_gpu": layout.recurrent_state_bytes(tp),
        "seq_len": seq_len,
        "bytes_per_sequence": None,
        "bytes_per_sequence_per_gpu": None,
        "budget_bytes_per_gpu": args.budget,
        "sequences_in_budget": None,
        "capacity_tokens": capacity_tokens,
        "sequences_in_capacity": None,
        "offload_bytes": args.offload_size,
        "offload_tokens": None,
        "sequences_in_offload": None,
    }
    # The tier keeps KV blocks, not recurrent state: its size over the bytes of a token on all ranks, before
    # the engine rounds down to whole blocks. A model without attention layers has no KV to offload.
    if args.offload_size is not None and report["bytes_per_token"]:
        report["offload_tokens"] = args.offload_size // report["bytes_per_token"]
    if seq_len is not None:
        report["bytes_per_sequence"] = layout.bytes_per_sequence(seq_len, kv_dtype)
        report["bytes_per_sequence_per_gpu"] = layout.bytes_per_sequence(seq_len, kv_dtype, tp)
        if args.budget is not None:
            report["sequences_in_budget"] = layout.sequences_in_budget(args.budget, seq_len, kv_dtype, tp)
        if capacity_tokens is not None:
            report["sequences_in_capacity"] = layout.sequences_in_capacity(capacity_tokens, seq_len)
        if report["offload_tokens"] is not None:
            report["sequences_in_offload"] = layout.sequences_in_capacity(report["offload_tokens"], seq_len)
    return report


def _human_lines(layout: KVLayout, report: dict[str, Any]) -> list[str]:
    def amount(count: int) -> str:
        return f"{count} ({format_bytes(count)})"

    tp, seq_len = report["tp"], report["seq_len"]
    per_gpu = f" per GPU at TP {tp}"
    lines = [
        f"model: {layout.describe()}",
        f"KV cache dtype: {report['kv_cache_dtype']} ({report['bytes_per_element']} B per element)",
        f"bytes per token: {amount(report['bytes_per_token'])}",
    ]
    if tp > 1:
        lines.append(f"bytes per token{per_gpu}: {amount(report['bytes_per_token_per_gpu'])}")
    if seq_len is not None:
        lines.append(f"bytes per sequence of {seq_len} tokens: {amount(report['bytes_per_sequence'])}")
        if tp > 1:
            lines.append(f"bytes per sequence{per_gpu}: {amount(report['bytes_per_sequence_per_gpu'])}")
    if layout.recurrent_layers:
        state = report["recurrent_state_bytes_per_sequence_per_gpu"]
        where = per_gpu if tp > 1 else ""
        shown = "not given by the config" if state is None else amount(state)
        lines.append(f"recurrent state per sequence{where}: {shown}")
    if report["sequences_in_budget"] is not None:
        where = " per GPU" if tp > 1 else ""
        lines.append(
            f"sequences of {seq_len} tokens in {format_bytes(report['budget_bytes_per_gpu'])}{where}:"
            f" {report['sequences_in_budget']}"
        )
    if report["offload_tokens"] is not None:
        lines.append(f"offload tier of {format_bytes(report['offload_bytes'])}: {report['offload_tokens']} tokens")
        if report["sequences_in_offload"] is not None:
            lines.append(f"sequences of {seq_len} tokens in the offload tier: {report['sequences_in_offload']}")
    if report["sequences_in_capacity"] is not None:
        lines.append(
            f"sequences of {seq_len} tokens in {report['capacity_tokens']} tokens of KV capacity:"
            f" {report['sequences_in_capacity']}"
        )
    return lines


def main(argv: list[str]) -> int:
    """`kvcache-exporter kv-math ARGS`: 0 on success, 2 with one line on stderr for bad input,
    1 when a --target cannot be read."""
    prog = "kvcache-exporter kv-math"
    try:
        args = _build_parser().parse_args(argv)
        layout = _layout_from_args(args)
        for flag, value in (("--budget", args.budget), ("--capacity-tokens", args.capacity_tokens),
                            ("--target", args.target)):
            if value is not None and args.seq_len is None:
                raise _UsageError(f"{flag} needs --seq-len")
        # Reject a bad --dtype or a TP that cannot split the cache before polling any target.
        layout.bytes_per_token(args.kv_cache_dtype, args.tp)
        layout.recurrent_state_bytes(args.tp)
        capacity = args.capacity_tokens
        if args.target is not None:
            try:
                capacity = read_capacity_tokens(args.target)
            except Exception as err:  # whatever the poll raises (network, parse): one line, no traceback
                print(f"{prog}: error: --target: {err}", file=sys.stderr)
                return 1
        report = _report(layout, args, capacity)
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except _UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except ArchitectureError as err:
        print(f"{prog}: error: {_flag(err.key)}: {err.problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print("\n".join(_human_lines(layout, report)))
    return 0
