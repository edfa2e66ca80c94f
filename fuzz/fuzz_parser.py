"""Coverage-guided fuzzing (atheris) of everything a target's page goes through before it is rendered.

    python fuzz/fuzz_parser.py -max_total_time=300

Invariant: for any page text, parsing it with each adapter's wanted names, reading every
sample's labels, adapting the samples and deriving the KV gauges and pressure state either
returns or raises exporter.sources.parser.ParseError; and the compiled reader (parser.parse where
it was built) answers exactly what the pure-Python reference (parser.reference_parse) answers,
the same samples or the same error, and so do the adapters' compiled loops (cfold.pyx) and theirs
(devtools.harness.reference_fold): the same Snapshot, values compared by repr. Every input is read twice: as the page text
itself, and as the recipe of a structured page (structured_page). Any other exception, or more
than 10 s on one input, is a finding: libFuzzer stops, prints the traceback and writes the input
to fuzz/crashes/crash-<sha1>. (Target.poll turns an exception into a failed poll: such a page
makes its target unreadable for no good reason. A slow page is worse: it holds the GIL, so
every other poll and scrape waits for it.)

With no corpus directory on the command line, the seeds are the fixture pages (tests/fixtures,
read only) and new inputs go to fuzz/corpus/ (not versioned), so a later run resumes from them.
Replay inputs without fuzzing by naming them: `python fuzz/fuzz_parser.py fuzz/crashes/*.txt`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # the exporter of this checkout, whatever else is installed

with atheris.instrument_imports(include=["kvcache_exporter"]):
    from kvcache_exporter import adapters, derive
    from kvcache_exporter.sources import parser
    from kvcache_exporter.thresholds import DEFAULT
from devtools import harness  # after the package: its modules imported instrumented above

SEEDS = REPO / "tests" / "fixtures"
CORPUS = HERE / "corpus"
CRASHES = HERE / "crashes"
# Fixed so that runs are reproducible; the pressure rate needs a history, which one poll does not have.
POLL_TIME = 1_700_000_000.0


# Structured pages: the wanted names of every adapter, with the labels the adapters read and the
# values engines really print, so that mutations reach adapt and derive instead of stopping at the
# first malformed line of a raw page.
NAMES = sorted(set().union(*(adapter.wanted for adapter in adapters.ADAPTERS.values())))
LABELS = ["le", "engine", "dp_rank", "tp_rank", "model_name", "pid", "reason", "priority", "is_streaming",
          "cache_source", "num_gpu_blocks", "block_size", "kv_cache_size_tokens", "page_size", "num_pages"]
NUMBERS = ["0", "1", "2", "16", "1001", "0.5", "0.99", "-1", "1e308", "+Inf", "-Inf", "NaN"]
LABEL_VALUES = NUMBERS + ["", "None", "capacity", "deferred", "total", "device", "\u00b2", "1_000", "0x10", " 1"]
MAX_LINES = 16


def structured_page(data: bytes) -> str:
    """Well-formed sample lines built from the fuzzer's bytes: names and label names from the
    adapters' tables, sample values numbers, label values typical ones or any (escaped) text."""
    provider = atheris.FuzzedDataProvider(data)

    def number() -> str:
        return provider.PickValueInList(NUMBERS) if provider.ConsumeBool() else repr(provider.ConsumeRegularFloat())

    def label_value() -> str:
        if provider.ConsumeBool():
            return provider.PickValueInList(LABEL_VALUES)
        text = provider.ConsumeUnicodeNoSurrogates(8)
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    lines = []
    for _ in range(provider.ConsumeIntInRange(1, MAX_LINES)):
        labels = ",".join(f'{provider.PickValueInList(LABELS)}="{label_value()}"'
                          for _ in range(provider.ConsumeIntInRange(0, 3)))
        lines.append(f"{provider.PickValueInList(NAMES)}{{{labels}}} {number()}")
    return "\n".join(lines) + "\n"


def reading(read, text: str, names: frozenset[str]):
    try:
        return [(name, [(s.name, s.label_text, repr(s.value)) for s in samples]) for name, samples in read(text, names).items()]
    except parser.ParseError as err:
        return f"ParseError: {err}"


def assert_readers_agree(text: str, names: frozenset[str]) -> None:
    compiled, reference = reading(parser.parse, text, names), reading(parser.reference_parse, text, names)
    if compiled != reference:
        raise AssertionError(f"the compiled reader ({parser.READER}) answered {compiled!r:.300}, "
                             f"the reference {reference!r:.300}")


def adapting(adapter, samples) -> str:
    try:
        return repr(type(adapter)().adapt(samples))  # a new adapter: caches of its own
    except parser.ParseError as err:
        return f"ParseError: {err}"


def assert_folds_agree(adapter, samples) -> None:
    compiled = adapting(adapter, samples)
    with harness.reference_fold():
        reference = adapting(adapter, samples)
    if compiled != reference:
        raise AssertionError(f"the compiled fold ({adapters.ADAPTER}) answered {compiled!r:.300}, "
                             f"the reference {reference!r:.300}")


def read_page(text: str) -> None:
    """What Target.poll does with a page between fetching and rendering it: detection for
    `engine: auto`, then each adapter as if configured for it. Raises ParseError."""
    adapters.detect(text)
    parser.has_samples(text)
    for adapter in adapters.ADAPTERS.values():
        assert_readers_agree(text, adapter.wanted)
        try:
            samples = parser.parse(text, adapter.wanted)
            for found in samples.values():
                for sample in found:
                    sample.labels  # noqa: B018 (raises ParseError on a bad label set)
            assert_folds_agree(adapter, samples)
            snapshot = adapter.adapt(samples)
            derive.derive(snapshot, {}, POLL_TIME, DEFAULT)  # kv_gauges and pressure_state of every rank
        except parser.ParseError:
            pass


def test_one_input(data: bytes) -> None:
    # Target.poll refuses a page that is not UTF-8 before parsing; every other text is fair game.
    read_page(data.decode("utf-8", errors="replace"))
    read_page(structured_page(data))


# libFuzzer options this target runs with unless the command line sets them.
DEFAULT_OPTIONS = {
    "-artifact_prefix": f"{CRASHES}/",
    "-dict": str(HERE / "exposition.dict"),
    # A page must be read well within a poll interval; seconds on one page is a bug, not bad luck.
    "-timeout": "10",
}


def default_arguments(argv: list[str]) -> list[str]:
    """The default options, and the corpus directories unless the command line names inputs of its own."""
    args = list(argv)
    given = {arg.split("=", 1)[0] for arg in args[1:] if arg.startswith("-")}
    args += [f"{option}={value}" for option, value in DEFAULT_OPTIONS.items() if option not in given]
    CRASHES.mkdir(exist_ok=True)
    if not [arg for arg in args[1:] if not arg.startswith("-")]:
        CORPUS.mkdir(exist_ok=True)
        args += [str(CORPUS), str(SEEDS)]  # libFuzzer writes new inputs to the first directory only
    return args


def main() -> None:
    atheris.Setup(default_arguments(sys.argv), test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
