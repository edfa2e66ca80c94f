"""The compiled reader (exporter/sources/cparser.pyx) against the reference (parser.reference_parse): the same
samples, in the same order, of the same type, and the same errors, on every fixture page, every input the fuzzer
kept, and generated lines built from every case the reference's grammar tells apart. `make test` installs the
package with a C compiler present, so the compiled reader must be there: a missing build fails here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from devtools import harness
from kvcache_exporter import adapters
from kvcache_exporter.sources import cparser, parser

PAGES = sorted(harness.FIXTURES.glob("*.txt")) + sorted(harness.FIXTURES.glob("sequences/*/*.txt"))
CRASHES = sorted((harness.REPO / "fuzz" / "crashes").glob("*.txt"))
WANTED = {name: adapter.wanted for name, adapter in adapters.ADAPTERS.items()}


def outcome(read, text: str, names: frozenset[str]):
    """What a reader answers, comparable: samples with their values' repr (NaN, -0.0), or the error."""
    try:
        found = read(text, names)
    except parser.ParseError as err:
        return "ParseError", str(err)
    return [(name, [(type(s), s.name, s.label_text, repr(s.value)) for s in samples]) for name, samples in found.items()]


def test_the_compiled_reader_is_the_one_that_runs():
    assert parser.READER == "cython"
    assert parser.parse is cparser.parse


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(harness.FIXTURES)))
def test_every_fixture_page_is_read_in_c_as_the_reference_reads_it(page):
    """Read in C, not handed back, but for OpenMetrics exemplars: their quoted labels after `#` are the
    reference's exact selector's to read (engines serve the text format 0.0.4 the exporter asks for)."""
    text = page.read_text()
    exemplars = ' # {' in text
    on_page = frozenset(sample[0] for sample in harness.oracle_samples(text))
    for names in [on_page, *WANTED.values()]:
        expected = outcome(parser.reference_parse, text, names)
        assert outcome(parser.parse, text, names) == expected
        if exemplars:
            assert cparser.scan(text, on_page) is None
        else:
            assert outcome(cparser.scan, text, names) == expected
    if not exemplars:
        assert sum(len(samples) for _, samples in outcome(cparser.scan, text, on_page)) > 10


@pytest.mark.parametrize("page", CRASHES, ids=lambda p: p.name)
def test_the_fuzzers_inputs_read_alike(page):
    text = page.read_text(errors="replace")
    for names in WANTED.values():
        assert outcome(parser.parse, text, names) == outcome(parser.reference_parse, text, names)


# Lines built from the pieces the reference's grammar tells apart: wanted and unwanted names (and a prefix of
# one), blanks, label sets with a `}` or a newline inside, values float() reads by its own rules (underscores,
# Unicode digits and spaces, hex), timestamps, exemplars and comments, quotes where none may be, line ends.
NAMES = ["m", "m_total", "mm", "other"]
WANTED_NAMES = frozenset({"m", "m_total"})
LEADS = ["", " ", "\t", "  "]
LABEL_SETS = ["", "{}", '{a="1"}', '{a="x",b="y",}', '{a="}"}', '{a="\\"}"} ', '{a="1"', '{a="\n"}', '{a="é"}',
              '{a="\u20ac"}', "{a=1}", '{ a = "1" }']
BLANKS = [" ", "\t", "  ", ""]
VALUES = ["1", "-2.5e3", "NaN", "+Inf", "-inf", "infinity", "nan", "1e999", "-0", ".5", "5.", "+.5e-3", "0x10",
          "1_000", "1__0", "\u0661", "1\xa0", "1\x0b", "1e", "e5", "--1", "1#x", '1"', "", "\u00b2", "1.0.0"]
TAILS = ["", " 1700000000000", "\t17", " 17 ", " 1 2", ' 17"', " # {t=\"x\"} 1.0 2", " #c", ' # "q"', "#", " \r",
         " 17#"]
ENDS = ["\n", "\r\n", "\r", "\n\n", ""]

line = st.builds(lambda *parts: "".join(parts), st.sampled_from(LEADS), st.sampled_from(NAMES),
                 st.sampled_from(LABEL_SETS), st.sampled_from(BLANKS), st.sampled_from(VALUES), st.sampled_from(TAILS),
                 st.sampled_from(ENDS))
comment = st.sampled_from(["# HELP m a gauge\n", "# TYPE m gauge\n", "#\n", "\n", "garbage{{{ here\n"])


@settings(max_examples=1500, deadline=None, derandomize=True)  # the same examples every run: no CI luck
@given(st.lists(st.one_of(line, comment), min_size=1, max_size=6))
def test_generated_lines_read_alike(lines):
    text = "".join(lines)
    assert outcome(parser.parse, text, WANTED_NAMES) == outcome(parser.reference_parse, text, WANTED_NAMES)


WELL_FORMED = ['m 1\n', ' m{a="1"} 2.5 1700000000000\n', 'm_total{a="x",} NaN # {t=y} 1 2\r\n',
               'mm{a="}"} 1\nm\t-Inf\n', "# HELP m x\nm{} +Inf", 'other{a="1\n m 3\n']


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_wanted_lines_are_read_in_c(text):
    """The generated test above holds whichever reader answers; these pages must be the C one's to answer."""
    found = cparser.scan(text, WANTED_NAMES)
    assert found is not None
    assert outcome(cparser.scan, text, WANTED_NAMES) == outcome(parser.reference_parse, text, WANTED_NAMES)


@pytest.mark.parametrize("text", ['m{a="}"} 1\n', 'm 1_000\n', 'm \u0661\n', 'm{a="\u20ac"} 1\n', "m 1 2 3\n",
                                  'm 1 # {t="y"} 2\n'])
def test_what_the_c_reader_leaves_to_the_reference(text):
    assert cparser.scan(text, WANTED_NAMES) is None
    assert outcome(parser.parse, text, WANTED_NAMES) == outcome(parser.reference_parse, text, WANTED_NAMES)


@settings(max_examples=3000, deadline=None, derandomize=True)
@given(st.sampled_from(["", "-", "+"]), st.text(alphabet="0123456789", min_size=1, max_size=18),
       st.integers(-1, 18))
def test_decimal_values_are_the_values_float_reads(sign, digits, point):
    """Plain decimals take the C reader's own conversion (up to 15 digits): bit for bit what float() reads."""
    value = sign + (digits if point < 0 else digits[:point] + "." + digits[point:])
    found = cparser.scan(f"m {value}\n", WANTED_NAMES)
    assert found is not None
    assert repr(found["m"][0].value) == repr(float(value))
