# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The adapters' two loops over a page's samples in C (issue #48): the compiled fold.

base.reference_collapse and base.reference_fold_histogram are the reference; these are the same loops, line for
line, over the same dictionaries (the label-text caches, the slices, the copies, the bucket bounds as keys, so
that NaN, -0.0 and duplicate bounds behave as there), without the interpreter's work per sample: the tuple
unpacking, the method look-ups, the float boxing of the comparisons and sums. Where a value is not a float (a
sample built by hand), the comparison and the sum are Python's own. The differential tests check both on every
fixture page, every input the fuzzer kept and generated histograms.
"""

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_CheckExact
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM

# This module imports nothing of the package: base.py imports it.
cdef object _INF = float("inf")
# One object for equal (rank, slice) keys and equal copies, so that the fold tells a sample of the copy before it
# by identity (the buckets of one copy are consecutive lines) instead of hashing the key again.
cdef dict _interned = {}
cdef Py_ssize_t _INTERNED_LIMIT = 50_000


cdef object _intern(object key):
    cdef PyObject *found = PyDict_GetItem(_interned, key)
    if found != NULL:
        return <object>found
    if len(_interned) >= _INTERNED_LIMIT:
        _interned.clear()
    _interned[key] = key
    return key


cdef inline bint _replaces(object value, object seen) except -1:
    """`value > seen or seen != seen`: a larger copy wins, and a NaN loses to any number."""
    cdef double v, s
    if PyFloat_CheckExact(value) and PyFloat_CheckExact(seen):
        v = PyFloat_AS_DOUBLE(value)
        s = PyFloat_AS_DOUBLE(seen)
        return v > s or s != s
    return bool(value > seen or seen != seen)


cdef inline object _add(object total, object value):
    if PyFloat_CheckExact(total) and PyFloat_CheckExact(value):
        return PyFloat_AS_DOUBLE(total) + PyFloat_AS_DOUBLE(value)
    return total + value


cdef object _scaled(object value, object scale):
    """base._scaled: `value` in the contract's unit (a fraction divides by its inverse)."""
    cdef double v, s
    if PyFloat_CheckExact(value) and (PyFloat_CheckExact(scale) or type(scale) is int) and scale > 0:
        v = PyFloat_AS_DOUBLE(value)
        s = scale  # an int converted as Python's float arithmetic converts it
        return v / (1.0 / s) if s < 1 else v * s
    return value / (1 / scale) if scale < 1 else value * scale


cdef inline object _cached(dict cache, object label_text):
    """The cache's entry for a label text, or NULL-as-Ellipsis where it has none (None is an entry: rejected)."""
    cdef PyObject *found = PyDict_GetItem(cache, label_text)
    return Ellipsis if found == NULL else <object>found


def collapse(samples, dict cache, slice_of, series):
    cdef dict slices = {}
    cdef dict totals = {}
    cdef object sample, label_text, key, value
    cdef PyObject *found
    cdef PyObject *k
    cdef PyObject *v
    cdef Py_ssize_t pos = 0
    for sample in samples:
        label_text = <object>PyTuple_GET_ITEM(sample, 1)
        key = _cached(cache, label_text)
        if key is Ellipsis:
            key = slice_of(label_text, series)
            cache[label_text] = key
        if key is None:
            continue
        value = <object>PyTuple_GET_ITEM(sample, 2)
        found = PyDict_GetItem(slices, key)
        if found == NULL or _replaces(value, <object>found):
            slices[key] = value
    while PyDict_Next(slices, &pos, &k, &v):
        out_key = <object>PyTuple_GET_ITEM(<object>k, 0)
        found = PyDict_GetItem(totals, out_key)
        totals[out_key] = _add(0.0 if found == NULL else <object>found, <object>v)
    return totals


def fold_histogram(tuple parts, tuple caches, copy_of, series, kept):
    cdef dict copies = {}
    cdef dict totals = {}
    cdef dict cache, by_copy, buckets, into_buckets
    cdef list into, best
    cdef object samples, sample, label_text, key, slice_key, copy, best_copy
    cdef object last_slice_key = None, last_copy = None
    cdef list entry = None
    cdef PyObject *found
    cdef PyObject *k
    cdef PyObject *v
    cdef PyObject *ck
    cdef PyObject *cv
    cdef Py_ssize_t part, pos, copy_pos
    for part in range(3):
        samples = parts[part]
        cache = <dict>caches[part]
        for sample in samples:
            label_text = <object>PyTuple_GET_ITEM(sample, 1)
            key = _cached(cache, label_text)
            if key is Ellipsis:
                key = copy_of(label_text, series, part == 0, kept)
                if key is not None:
                    key = (_intern(key[0]), _intern(key[1]), key[2])
                cache[label_text] = key
            if key is None:
                continue
            slice_key = <object>PyTuple_GET_ITEM(key, 0)
            copy = <object>PyTuple_GET_ITEM(key, 1)
            if slice_key is not last_slice_key or copy is not last_copy:
                found = PyDict_GetItem(copies, slice_key)
                if found == NULL:
                    by_copy = {}
                    copies[slice_key] = by_copy
                else:
                    by_copy = <dict>found
                found = PyDict_GetItem(by_copy, copy)
                if found == NULL:
                    entry = [{}, None, None]
                    by_copy[copy] = entry
                else:
                    entry = <list>found
                last_slice_key, last_copy = slice_key, copy
            if part == 0:
                (<dict>entry[0])[<object>PyTuple_GET_ITEM(key, 2)] = <object>PyTuple_GET_ITEM(sample, 2)
            else:
                entry[part] = <object>PyTuple_GET_ITEM(sample, 2)
    pos = 0
    while PyDict_Next(copies, &pos, &k, &v):
        # The first copy by its labels of those that are whole (their +Inf bucket and their sum there).
        best = None
        best_copy = None
        copy_pos = 0
        while PyDict_Next(<dict>v, &copy_pos, &ck, &cv):
            entry = <list>cv
            if _INF in <dict>entry[0] and entry[1] is not None and (best is None or <object>ck < best_copy):
                best, best_copy = entry, <object>ck
        if best is None:
            continue  # without its +Inf bucket or its sum a histogram is incomplete
        buckets = <dict>best[0]
        rank_name = <object>PyTuple_GET_ITEM(<object>k, 0)
        found = PyDict_GetItem(totals, rank_name)
        if found == NULL:
            into = [{}, 0.0, 0.0]
            totals[rank_name] = into
        else:
            into = <list>found
        into_buckets = <dict>into[0]
        copy_pos = 0
        while PyDict_Next(buckets, &copy_pos, &ck, &cv):
            found = PyDict_GetItem(into_buckets, <object>ck)
            into_buckets[<object>ck] = _add(0.0 if found == NULL else <object>found, <object>cv)
        into[1] = _add(into[1], best[1])
        into[2] = _add(into[2], buckets[_INF] if best[2] is None else best[2])
    scale = series.scale
    pos = 0
    while PyDict_Next(totals, &pos, &k, &v):
        into = <list>v
        totals[<object>k] = ([(_scaled(bound, scale), cumulative) for bound, cumulative in sorted(into[0].items())],
                             _scaled(into[1], scale), into[2])
    return totals
