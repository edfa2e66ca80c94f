# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The parser's scan of a page in C (issue #33): the compiled reader.

parser.py is the reference and decides every case this module does not: it returns its own samples
only for pages whose every wanted line is one the reference's fast selector reads, and then the very
samples the reference returns (the differential tests and the fuzz harness check both on every
input). Anything else (a line it cannot read, a value float() reads only after its own handling, a
page with a character beyond Latin-1, a name that is not a plain metric name) goes to the reference
whole, so errors are the reference's own.

The reference's regex jumps from wanted line to wanted line but still looks at every line start
through an alternation of ~60 names; here each line's name is hashed once and looked up in a table.
"""

cimport cython
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp

import array

cdef extern from "Python.h":
    int PyUnicode_KIND(object)
    void *PyUnicode_DATA(object)
    double PyOS_string_to_double(const char *s, char **endptr, PyObject *overflow_exception) except? -1.0
    object PyType_GenericAlloc(PyTypeObject *, Py_ssize_t)

# Set once by parser.py (this module imports nothing of the package: no import circle).
cdef object _sample_type = None
cdef object _reference = None


def bind(sample_type, reference):
    """The Sample type to build and the reference parse to hand every page it does not read itself."""
    global _sample_type, _reference
    _sample_type = sample_type
    _reference = reference


cdef inline uint64_t _fnv(const unsigned char *s, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = 1469598103934665603ULL
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ s[i]) * 1099511628211ULL
    return h


@cython.final
cdef class _NameTable:
    """An open-addressing table of the wanted names' Latin-1 bytes, looked up by a line's name; before it, the
    first two characters of every wanted line (a bit per pair), which turn most other lines away unread."""
    cdef unsigned char starts[8192]
    cdef list _keys  # bytes, kept alive for the pointers below
    cdef list _names  # the str objects handed out as Sample.name
    cdef Py_ssize_t mask
    cdef bint usable  # False: some name is not a plain metric name; the reference reads these pages
    cdef uint64_t[::1] hashes
    cdef int[::1] slots  # index into _keys/_names, -1 for empty

    def __init__(self, names):
        cdef Py_ssize_t size = 8, i, slot
        self._keys = []
        self._names = []
        self.usable = True
        for name in names:
            if not isinstance(name, str) or not name or any(c in name for c in "{ \t\n"):
                self.usable = False
                return
            try:
                key = name.encode("latin-1")
            except UnicodeEncodeError:
                continue  # can never be on a Latin-1 page
            self._keys.append(key)
            self._names.append(name)
        while size < 4 * len(self._keys):
            size *= 2
        self.mask = size - 1
        for key in self._keys:
            # A one-character name's line goes on with `{` or a blank.
            for second in (key[1:2] or b"{ \t"):
                self.starts[(key[0] << 8 | second) >> 3] |= 1 << (second & 7)
        self.hashes = array.array("Q", [0]) * size
        self.slots = array.array("i", [-1]) * size
        for i, key in enumerate(self._keys):
            h = _fnv(key, len(key))
            slot = h & self.mask
            while self.slots[slot] != -1:
                slot = (slot + 1) & self.mask
            self.hashes[slot] = h
            self.slots[slot] = i

    cdef inline bint may_start(self, unsigned char first, unsigned char second) noexcept:
        return self.starts[(first << 8 | second) >> 3] & (1 << (second & 7))

    cdef object find(self, const unsigned char *s, Py_ssize_t n):
        cdef uint64_t h = _fnv(s, n)
        cdef Py_ssize_t slot = h & self.mask
        cdef int index
        cdef bytes key
        while True:
            index = self.slots[slot]
            if index == -1:
                return None
            if self.hashes[slot] == h:
                key = <bytes>self._keys[index]
                if len(key) == n and memcmp(<const char *>key, s, n) == 0:
                    return self._names[index]
            slot = (slot + 1) & self.mask


cdef dict _tables = {}


cdef inline bint _blank(unsigned char c) noexcept nogil:
    return c == 32 or c == 9


# 10**k for k <= 22: exact in a double, so that one division below is correctly rounded.
cdef double[23] _POWERS = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                           1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22]


cdef object _number(const unsigned char *s, Py_ssize_t start, Py_ssize_t end):
    """float() of the value, or None where float() would not read it or reads it by its own rules
    (underscores, Unicode digits and spaces): the reference then decides."""
    cdef Py_ssize_t i = start
    cdef unsigned char c
    cdef char *stop
    cdef double value
    cdef unsigned long long mantissa = 0
    cdef int digits = 0, decimals = -1
    cdef bint negative = False
    # Most values are plain decimals of a few digits (counts, seconds, ratios): with at most 15 digits the
    # digits are an exact integer and the quotient by an exact power of ten is the correctly rounded value,
    # the one float() computes (Clinger's fast path). Anything else goes to Python's own conversion.
    if i < end and (s[i] == 45 or s[i] == 43):  # - +
        negative = s[i] == 45
        i += 1
    while i < end:
        c = s[i]
        if 48 <= c <= 57:
            mantissa = mantissa * 10 + (c - 48)
            digits += 1
            if decimals >= 0:
                decimals += 1
        elif c == 46 and decimals < 0:  # the one decimal point
            decimals = 0
        else:
            break
        i += 1
    if i == end and 0 < digits <= 15:
        value = <double>mantissa / _POWERS[decimals] if decimals > 0 else <double>mantissa
        return -value if negative else value
    for i in range(start, end):
        c = s[i]
        if not (48 <= c <= 57 or 65 <= c <= 90 or 97 <= c <= 122 or c == 46 or c == 43 or c == 45):
            return None
    try:
        value = PyOS_string_to_double(<const char *>s + start, &stop, NULL)
    except ValueError:
        return None
    if stop != <char *>s + end:
        return None
    return value


def parse(str text, frozenset names):
    """parser.parse, in C where the page allows it; see the module's docstring."""
    if not names:
        return {}
    found = scan(text, names)
    return _reference(text, names) if found is None else found


def scan(str text, frozenset names):
    """The samples as the reference reads them, or None for a page this module leaves to the reference."""
    if _sample_type is None:
        raise RuntimeError("cparser.bind() has not been called (parser.py does, on import)")
    table = _tables.get(names)
    if table is None:
        if len(_tables) >= 128:
            _tables.clear()
        table = _tables[names] = _NameTable(names)
    if PyUnicode_KIND(text) != 1 or not (<_NameTable>table).usable:
        return None
    return _scan(text, <_NameTable>table)


cdef dict _scan(str text, _NameTable table):
    """The samples, or None where a wanted line is not one the reference's fast selector reads."""
    cdef const unsigned char *s = <const unsigned char *>PyUnicode_DATA(text)
    cdef Py_ssize_t n = len(text), line = 0, p, start, label_start, label_end, value_start, value_end, r
    cdef const unsigned char *hit
    cdef unsigned char c
    cdef dict found = {}
    cdef list samples
    cdef PyTypeObject *sample_type = <PyTypeObject *>_sample_type
    while line <= n:
        # As the reference's selector: a line's start, blanks, then a wanted name followed by `{` or a blank.
        p = line
        while p < n and _blank(s[p]):
            p += 1
        start = p
        name = None
        if p + 1 < n and table.may_start(s[p], s[p + 1]):
            while p < n:
                c = s[p]
                if c == 123 or c == 32 or c == 9 or c == 10:  # { space tab newline
                    break
                p += 1
            if p > start and p < n and s[p] != 10:
                name = table.find(s + start, p - start)
        if name is None:
            if p < n and s[p] == 10:
                line = p + 1
            else:
                hit = <const unsigned char *>memchr(s + p, 10, n - p) if p < n else NULL
                line = (hit - s) + 1 if hit != NULL else n + 1
            continue
        # A wanted line, read as the fast selector reads it.
        label_start = label_end = p
        if s[p] == 123:
            hit = <const unsigned char *>memchr(s + p + 1, 125, n - p - 1)
            if hit == NULL or memchr(s + p + 1, 10, (hit - s) - p - 1) != NULL:
                return None
            label_start = p + 1
            label_end = hit - s
            p = label_end + 1
        if p >= n or not _blank(s[p]):
            return None
        while p < n and _blank(s[p]):
            p += 1
        value_start = p
        while p < n:
            c = s[p]
            if c == 32 or c == 9 or c == 13 or c == 10 or c == 34:
                break
            p += 1
        value_end = p
        if value_end == value_start:
            return None
        if p < n and _blank(s[p]):  # an optional timestamp
            r = p
            while r < n and _blank(s[r]):
                r += 1
            if r < n and not (s[r] == 13 or s[r] == 10 or s[r] == 35 or s[r] == 34):
                while r < n:
                    c = s[r]
                    if c == 32 or c == 9 or c == 13 or c == 10 or c == 35 or c == 34:
                        break
                    r += 1
                p = r
        while p < n and _blank(s[p]):
            p += 1
        if p < n and s[p] == 35:  # an exemplar or a comment: to the line's end, no quote in it
            while p < n and not (s[p] == 13 or s[p] == 10 or s[p] == 34):
                p += 1
        if p < n and s[p] == 13:
            p += 1
        if p < n and s[p] != 10:
            return None
        value = _number(s, value_start, value_end)
        if value is None:
            return None
        # A Sample as tuple.__new__ makes it: allocated for three items, each set once.
        sample = PyType_GenericAlloc(sample_type, 3)
        label_text = text[label_start:label_end]
        Py_INCREF(name)
        PyTuple_SET_ITEM(sample, 0, name)
        Py_INCREF(label_text)
        PyTuple_SET_ITEM(sample, 1, label_text)
        Py_INCREF(value)
        PyTuple_SET_ITEM(sample, 2, value)
        samples = found.get(name)
        if samples is None:
            found[name] = samples = []
        samples.append(sample)
        line = p + 1
    return found
