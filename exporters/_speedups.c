/*
 * The exporters' per-row work in C: Chrome trace "X" events, frame columns, and
 * the columns the trace reader takes from decoded events (event_columns).
 *
 * exporters/chrome/_encode.py, exporters/frame.py and exporters/chrome/_events.py
 * keep the reference implementations and use this module when it was built (see
 * setup.py; the build is optional). Python still does everything that needs judgement: the
 * per-name prefixes, the quoting of names, keys and error texts, and every attribute
 * key or value that is not an exact str, int, float or bool (C calls back for those).
 * This module orders the rows and does the per-row arithmetic and concatenation, the
 * formatting with the GIL released once every Python value is read (encode_x_events):
 *
 *   prefix tid ,"ts": us ,"dur": us ,"span_id":"hex16","parent_id":"hex16","status": status
 *   [,"attrs":{ attrs }] [,"args":{"error": quoted-error }] }
 *
 * (the attributes outside "args", where no viewer keys frames on them; the
 * "attrs" object is left out when a span has none, "args" when it has no error)
 *
 * with ts = start_ns - origin_ns and dur = max(end_ns - start_ns, 0) written
 * as exact decimal microseconds (three fraction digits), and for frames it
 * takes rows apart into typed columns (dictionary-encoded strings, int64,
 * float64 and bool buffers for numpy.frombuffer).
 *
 * THE RULE, followed throughout this file:
 *   - No borrowed reference is held across any call that can run Python code.
 *     That includes calls into Python callbacks, __hash__/__eq__/__lt__/
 *     __repr__/__index__/__len__ of user objects, and any allocation of a
 *     GC-tracked object (a collection runs finalizers, which can do anything).
 *     Such a reference is made strong first (Py_INCREF, released after) or
 *     fetched again after the call. Caches that compare objects by address
 *     (KeyOrder, SlotCache, Encoder.last) own what they compare, so that an
 *     address cannot be reused by another object while it is cached.
 *   - Input containers that C walks are copied (the row lists, the attribute
 *     lists; the snapshot of a row's attribute dict holds strong references),
 *     or, where no call in the loop can run Python code, their length is
 *     checked on each access.
 *   - Integer arithmetic on times cannot overflow: the difference of two int64
 *     is written from its sign and its magnitude (which fits in uint64), so
 *     ts and dur are exact for any int64 times, as the Python encoder's.
 *     Buffer sizes are checked before they grow.
 *   - Attribute keys that are not exact str send the row's batch to the Python
 *     encoder: C then never calls a user __hash__/__eq__/__lt__ on a key, and
 *     per-row key sorting orders exactly like the Python encoder's.
 *
 * Module state (the FrozenAttributes type, registered once) is process-wide;
 * the module refuses to load in a second interpreter of the process
 * (ImportError), where the exporters then use their pure-Python paths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static PyObject *frozen_type = NULL; /* exporters.FrozenAttributes, a dict subclass */
static PyInterpreterState *owner_interp = NULL;

static inline int
is_plain_dict(PyObject *d)
{
    /* a dict, or a FrozenAttributes (a dict subclass that overrides no read method) */
    return PyDict_CheckExact(d) || (frozen_type != NULL && (PyObject *)Py_TYPE(d) == frozen_type);
}

static const char digit_pairs[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

static inline int
digits_ull(unsigned long long v)
{
    /* the decimal digits of v (1 for 0) */
#if defined(__GNUC__)
    static const unsigned long long pow10[20] = {
        1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL, 10000000ULL,
        100000000ULL, 1000000000ULL, 10000000000ULL, 100000000000ULL, 1000000000000ULL,
        10000000000000ULL, 100000000000000ULL, 1000000000000000ULL, 10000000000000000ULL,
        100000000000000000ULL, 1000000000000000000ULL, 10000000000000000000ULL};
    unsigned long long w = v | 1ULL; /* as many digits as v: a power of ten above 1 is even */
    int t = ((64 - __builtin_clzll(w)) * 1233) >> 12; /* log10(2) ~ 1233 / 4096 */
    return t + 1 - (w < pow10[t]);
#else
    int n = 1;
    while (v >= 10000) {
        v /= 10000;
        n += 4;
    }
    return n + (v >= 10) + (v >= 100) + (v >= 1000);
#endif
}

/* The lengths of what put_ll and put_diff_us write: the exact size of each event is
 * known before it is formatted, so each part is made at its size (no resize). */
static inline Py_ssize_t
len_ll(long long v)
{
    return v < 0 ? 1 + digits_ull((unsigned long long)(-(v + 1)) + 1ULL) : digits_ull(v);
}

static inline Py_ssize_t
len_diff_us(long long hi, long long lo)
{
    int neg = hi < lo;
    unsigned long long mag = neg ? (unsigned long long)lo - (unsigned long long)hi
                                 : (unsigned long long)hi - (unsigned long long)lo;
    return neg + digits_ull(mag / 1000ULL) + 4;
}

static inline char *
put_ull(char *p, unsigned long long v)
{
    /* digits_ull(v) digits, written from the end two at a time */
    int n = digits_ull(v);
    char *t = p + n;
    while (v >= 100) {
        unsigned d = (unsigned)(v % 100);
        v /= 100;
        t -= 2;
        memcpy(t, digit_pairs + 2 * d, 2);
    }
    if (v >= 10) {
        memcpy(t - 2, digit_pairs + 2 * v, 2);
    }
    else {
        t[-1] = (char)('0' + v);
    }
    return p + n;
}

static inline char *
put_ll(char *p, long long v)
{
    if (v < 0) {
        *p++ = '-';
        return put_ull(p, (unsigned long long)(-(v + 1)) + 1ULL);
    }
    return put_ull(p, (unsigned long long)v);
}

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t extra)
{
    if (extra < 0 || extra > PY_SSIZE_T_MAX - b->len) {
        PyErr_NoMemory();
        return -1;
    }
    if (b->len + extra <= b->cap) {
        return 0;
    }
    Py_ssize_t need = b->len + extra;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < need) {
        cap = cap > PY_SSIZE_T_MAX / 2 ? need : cap * 2;
    }
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int
buf_reserve(Buf *b, Py_ssize_t extra)
{
    /* room for extra more bytes: 0, or -1 with MemoryError set (inline: the common case
     * is one comparison; cap - len never overflows) */
    if (extra >= 0 && extra <= b->cap - b->len) {
        return 0;
    }
    return buf_grow(b, extra);
}

static int
buf_add(Buf *b, const char *s, Py_ssize_t n)
{
    if (buf_reserve(b, n) < 0) {
        return -1;
    }
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

static int
buf_add_str(Buf *b, PyObject *s)
{
    /* the UTF-8 of a str (no Python code runs: at most the UTF-8 cache is allocated) */
    Py_ssize_t n;
    const char *p;
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "Expected a str from the encoder, but received %.100s.",
                     Py_TYPE(s)->tp_name);
        return -1;
    }
    if (PyUnicode_IS_COMPACT_ASCII(s)) { /* its data is its UTF-8 */
        return buf_add(b, (const char *)PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s));
    }
    p = PyUnicode_AsUTF8AndSize(s, &n);
    if (p == NULL) {
        return -1;
    }
    return buf_add(b, p, n);
}

static int
buf_add_ll(Buf *b, long long v)
{
    if (buf_reserve(b, 21) < 0) {
        return -1;
    }
    b->len = put_ll(b->data + b->len, v) - b->data;
    return 0;
}

static PyObject *
buf_to_str(const Buf *b)
{
    for (Py_ssize_t i = 0; i < b->len; i++) {
        if ((unsigned char)b->data[i] >= 128) {
            return PyUnicode_DecodeUTF8(b->data, b->len, "strict");
        }
    }
    PyObject *s = PyUnicode_New(b->len, 127);
    if (s != NULL && b->len) {
        memcpy(PyUnicode_DATA(s), b->data, (size_t)b->len);
    }
    return s;
}

static inline Py_ssize_t
plain_ascii_len(const unsigned char *s, Py_ssize_t n)
{
    /* how many bytes of the ASCII text s[0..n) JSON writes as they are (printable, not
     * '"' or '\\'): eight at a time while none of them is another, then one by one */
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w, q, b, d;
        memcpy(&w, s + i, 8);
        q = w ^ (ones * '"');
        b = w ^ (ones * '\\');
        d = w ^ (ones * 0x7f);
        /* a byte below 0x20, or one equal to '"', '\\' or DEL (each test: some byte is
         * zero, or below 0x20): exact as to whether any byte is, which is all it asks */
        if ((((w - ones * 0x20) & ~w) | ((q - ones) & ~q) | ((b - ones) & ~b) |
             ((d - ones) & ~d)) &
            highs) {
            break;
        }
    }
    while (i < n && s[i] >= 0x20 && s[i] < 0x7f && s[i] != '"' && s[i] != '\\') {
        i++;
    }
    return i;
}

/* One attribute value as JSON, appended to b. Exact bool/int/float/str are done
 * here (a str of printable ASCII but '"' and '\\' is itself in quotes, as
 * json.encoder.encode_basestring_ascii writes it; another str goes through the
 * strings cache: str value -> JSON literal); any other
 * value, and an int whose str() fails (more digits than Python allows), goes
 * through encode_value, the Python encoder, which never raises for a bad value.
 * v is a strong reference the caller holds. */
static int
add_value(Buf *b, PyObject *v, PyObject *strings, PyObject *encode_value)
{
    PyObject *text;
    if (v == Py_True) {
        return buf_add(b, "true", 4);
    }
    if (v == Py_False) {
        return buf_add(b, "false", 5);
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow && !(x == -1 && PyErr_Occurred())) {
            return buf_add_ll(b, x);
        }
        PyErr_Clear();
        text = PyObject_Str(v);
        if (text == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                return -1;
            }
            PyErr_Clear(); /* too many digits: the Python encoder says what it is */
            text = PyObject_CallOneArg(encode_value, v);
        }
    }
    else if (PyUnicode_CheckExact(v)) {
        if (PyUnicode_IS_ASCII(v)) { /* printable ASCII but '"' and '\\': itself, quoted */
            const unsigned char *s = PyUnicode_DATA(v);
            Py_ssize_t n = PyUnicode_GET_LENGTH(v);
            if (plain_ascii_len(s, n) == n) { /* what encode_basestring_ascii gives it */
                if (buf_reserve(b, n + 2) < 0) {
                    return -1;
                }
                b->data[b->len] = '"';
                memcpy(b->data + b->len + 1, s, (size_t)n);
                b->data[b->len + n + 1] = '"';
                b->len += n + 2;
                return 0;
            }
        }
        text = PyDict_GetItemWithError(strings, v); /* exact str key: no Python code */
        if (text != NULL) {
            return buf_add_str(b, text); /* used before anything else runs */
        }
        if (PyErr_Occurred()) {
            return -1;
        }
        text = PyObject_CallOneArg(encode_value, v);
        if (text == NULL) {
            return -1;
        }
        if (PyDict_GET_SIZE(strings) > 65536) {
            PyDict_Clear(strings);
        }
        if (PyDict_SetItem(strings, v, text) < 0) {
            Py_DECREF(text);
            return -1;
        }
    }
    else if (PyFloat_CheckExact(v) && isfinite(PyFloat_AS_DOUBLE(v))) {
        text = PyObject_Repr(v);
    }
    else {
        text = PyObject_CallOneArg(encode_value, v);
    }
    if (text == NULL) {
        return -1;
    }
    int rc = buf_add_str(b, text);
    Py_DECREF(text);
    return rc;
}

/* The sorted key order of an attribute dict seen, and each key's head
 * (',"key":'). Rows mostly share their keys and key order, so the order is
 * reused while a row's keys are the same objects in the same order; callers keep
 * the last two (a summarised step row's keys alternate with its fetch row's). It
 * owns the keys it compares by address. */
typedef struct {
    Py_ssize_t n;      /* keys cached; -1: none */
    Py_ssize_t cap;
    PyObject **keys;   /* owned, in dict order */
    PyObject **heads;  /* owned: ',"key":' per dict position */
    Py_ssize_t *perm;  /* sorted rank -> dict position */
} KeyOrder;

#define KEY_ORDERS_INIT {{-1, 0, NULL, NULL, NULL}, {-1, 0, NULL, NULL, NULL}}

static void
key_order_clear(KeyOrder *o)
{
    for (Py_ssize_t j = 0; j < o->n; j++) {
        Py_CLEAR(o->keys[j]);
        Py_CLEAR(o->heads[j]);
    }
    o->n = -1;
}

static void
key_order_free(KeyOrder *o)
{
    key_order_clear(o);
    PyMem_Free(o->keys);
    PyMem_Free(o->heads);
    PyMem_Free(o->perm);
    o->keys = o->heads = NULL;
    o->perm = NULL;
    o->cap = 0;
}

static int
key_order_reserve(KeyOrder *o, Py_ssize_t m)
{
    if (m <= o->cap) {
        return 0;
    }
    if ((size_t)m > PY_SSIZE_T_MAX / sizeof(PyObject *)) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **keys = PyMem_Realloc(o->keys, (size_t)m * sizeof(PyObject *));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->keys = keys;
    PyObject **heads = PyMem_Realloc(o->heads, (size_t)m * sizeof(PyObject *));
    if (heads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->heads = heads;
    Py_ssize_t *perm = PyMem_Realloc(o->perm, (size_t)m * sizeof(Py_ssize_t));
    if (perm == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->perm = perm;
    o->cap = m;
    return 0;
}

static PyObject *
head_for(PyObject *heads, PyObject *head_of, PyObject *key)
{
    /* heads[key], made by head_of when missing; a new reference (key: an exact str) */
    PyObject *head = PyDict_GetItemWithError(heads, key);
    if (head != NULL) {
        return Py_NewRef(head);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    head = PyObject_CallOneArg(head_of, key);
    if (head == NULL) {
        return NULL;
    }
    if (PyDict_SetItem(heads, key, head) < 0) {
        Py_DECREF(head);
        return NULL;
    }
    return head;
}

typedef struct {
    PyObject *key;
    Py_ssize_t pos;
} Ranked;

static int
compare_ranked(const void *a, const void *b)
{
    /* exact str keys, all distinct (keys of one dict): code point order, as sorted() */
    return PyUnicode_Compare(((const Ranked *)a)->key, ((const Ranked *)b)->key);
}

static int
key_order_build(KeyOrder *o, PyObject **ks, Py_ssize_t m, PyObject *heads, PyObject *head_of)
{
    /* the sorted order of the m exact-str keys ks (strong references the caller holds) */
    Ranked *ranked;
    key_order_clear(o);
    if (key_order_reserve(o, m) < 0) {
        return -1;
    }
    ranked = PyMem_Malloc((size_t)m * sizeof(Ranked));
    if (ranked == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        ranked[j].key = ks[j];
        ranked[j].pos = j;
    }
    qsort(ranked, (size_t)m, sizeof(Ranked), compare_ranked); /* runs no Python code */
    for (Py_ssize_t r = 0; r < m; r++) {
        o->perm[r] = ranked[r].pos;
    }
    PyMem_Free(ranked);
    o->n = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *head = head_for(heads, head_of, ks[j]); /* Python code: ks[j] is held */
        if (head == NULL) {
            return -1;
        }
        o->keys[j] = Py_NewRef(ks[j]);
        o->heads[j] = head;
        o->n = j + 1;
    }
    return 0;
}

/* The attributes of one row, appended to b as ',"key":value...' in sorted key
 * order with None values skipped. d is a strong reference the caller holds; o is
 * the caller's two cached key orders (KEY_ORDERS_INIT), the last used first.
 * Returns 0, -1 on error, or 1 when the Python encoder must do the batch (a
 * non-empty mapping that is not a dict, or a key that is not an exact str). */
#define STACK_ITEMS 32

static int
add_attrs(Buf *b, PyObject *d, KeyOrder o[2], PyObject *heads, PyObject *strings,
          PyObject *head_of, PyObject *encode_value)
{
    PyObject *stack[2 * STACK_ITEMS], **items = stack, *k, *v;
    Py_ssize_t m, pos = 0, j = 0;
    int rc = 0, same;
    if (!is_plain_dict(d)) {
        Py_ssize_t size = PyObject_Size(d);
        return size < 0 ? -1 : (size > 0 ? 1 : 0);
    }
    m = PyDict_GET_SIZE(d);
    if (m == 0) {
        return 0;
    }
    if (m > STACK_ITEMS) {
        if ((size_t)m > PY_SSIZE_T_MAX / (2 * sizeof(PyObject *))) {
            PyErr_NoMemory();
            return -1;
        }
        items = PyMem_Malloc((size_t)m * 2 * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    /* the snapshot: keys at items[0..m), values at items[m..2m), all strong. Nothing
     * in this loop runs Python code, so the dict cannot change while it is walked. */
    while (j < m && PyDict_Next(d, &pos, &k, &v)) {
        items[j] = Py_NewRef(k);
        items[m + j] = Py_NewRef(v);
        j++;
    }
    m = j;
    same = o[0].n == m;
    for (j = 0; j < m; j++) {
        if (!PyUnicode_CheckExact(items[j])) {
            rc = 1;
            goto done;
        }
        same = same && o[0].keys[j] == items[j];
    }
    if (!same) { /* the other order (rows alternate between two key sets), or a new one */
        same = o[1].n == m;
        for (j = 0; same && j < m; j++) {
            same = o[1].keys[j] == items[j];
        }
        KeyOrder t = o[0];
        o[0] = o[1];
        o[1] = t; /* the most recent first: a new order replaces the older one */
        if (!same && key_order_build(&o[0], items, m, heads, head_of) < 0) {
            rc = -1;
            goto done;
        }
    }
    o = &o[0];
    for (Py_ssize_t r = 0; r < m; r++) {
        Py_ssize_t at = o->perm[r];
        PyObject *value = items[m + at];
        if (value == Py_None) {
            continue;
        }
        if (buf_add_str(b, o->heads[at]) < 0 || add_value(b, value, strings, encode_value) < 0) {
            rc = -1;
            goto done;
        }
    }
done:
    for (j = 0; j < 2 * m; j++) {
        Py_DECREF(items[j]);
    }
    if (items != stack) {
        PyMem_Free(items);
    }
    return rc;
}

static void
list_replace(PyObject *list, Py_ssize_t i, PyObject *item)
{
    /* list[i] = item (stolen), for a slot that holds None: releasing None runs no code */
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, item);
    Py_DECREF(old);
}

static PyObject *
copy_list(PyObject *seq, const char *what)
{
    /* a private copy of a sequence C walks: Python code that runs meanwhile (a
     * __hash__, a finalizer) cannot change it */
    PyObject *copy = PySequence_List(seq);
    if (copy == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Format(PyExc_TypeError, "Expected a sequence of %s, but received %.100s.", what,
                     Py_TYPE(seq)->tp_name);
    }
    return copy;
}

/* encode_attrs(attrs, heads, strings, head_of, encode_value) -> list[str] | None
 *
 * Each row's attributes as ',"key":value...' in sorted key order, None values
 * skipped: what chrome._attribute_strings writes. heads caches key -> ',"key":'
 * (made by head_of), strings caches str value -> JSON literal. Values that are
 * not exact bool/int/float/str go through encode_value. Returns None when a row
 * needs the Python encoder (see add_attrs).
 */
static PyObject *
encode_attrs(PyObject *module, PyObject *args)
{
    PyObject *attrs, *heads, *strings, *head_of, *encode_value, *rows = NULL, *out = NULL;
    Buf b = {NULL, 0, 0};
    KeyOrder order[2] = KEY_ORDERS_INIT;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:encode_attrs", &PyList_Type, &attrs, &PyDict_Type,
                          &heads, &PyDict_Type, &strings, &head_of, &encode_value)) {
        return NULL;
    }
    rows = copy_list(attrs, "attribute mappings");
    if (rows == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    out = PyList_New(n);
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = Py_NewRef(PyList_GET_ITEM(rows, i)), *row;
        b.len = 0;
        int rc = add_attrs(&b, d, order, heads, strings, head_of, encode_value);
        Py_DECREF(d);
        if (rc < 0) {
            goto fail;
        }
        if (rc > 0) {
            Py_CLEAR(out);
            out = Py_NewRef(Py_None);
            break;
        }
        row = buf_to_str(&b);
        if (row == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, row);
    }
    PyMem_Free(b.data);
    key_order_free(&order[0]);
    key_order_free(&order[1]);
    Py_DECREF(rows);
    return out;
fail:
    PyMem_Free(b.data);
    key_order_free(&order[0]);
    key_order_free(&order[1]);
    Py_XDECREF(rows);
    Py_XDECREF(out);
    return NULL;
}

/* ---- encode_x_events: whole X events, formatted without the GIL -------------------
 *
 * Two phases. While the GIL is held, each row's Python values are read into an XRow
 * (numbers as C integers, strong references to its prefix and status texts, its
 * attributes and error encoded into an arena), and the rows are ordered. Then,
 * with the GIL released for a large batch, the events are formatted straight into
 * bytes objects made beforehand at a size that cannot be exceeded: no Python object
 * is touched and no Python API is called meanwhile. */

typedef struct {
    long long start, end, tid;
    unsigned long long span_id, parent_id;
    PyObject *prefix;         /* owned: the event's start up to "tid": (str) */
    PyObject *status;         /* owned: the status as a JSON literal (str) */
    const char *prefix_s;     /* their UTF-8, alive as long as they are */
    const char *status_s;
    Py_ssize_t prefix_n, status_n;
    Py_ssize_t attrs_at, attrs_n; /* ',"attrs":{...}' in the arena (n 0: none) */
    Py_ssize_t error_at, error_n; /* ',"args":{"error":...}' in the arena (n 0: none) */
} XRow;

typedef struct {
    long long start, end;
    Py_ssize_t i; /* the row's index in the batch: the last key, so the order is stable */
} XKey;

/* a name's prefix, found again by the name's address (the slot owns both) */
typedef struct {
    PyObject *name;
    PyObject *prefix;
    const char *s;
    Py_ssize_t n;
} XName;

#define X_NAME_SLOTS 32

/* where an object's address starts its probes in an identity cache of cap slots (a power
 * of two) */
static inline size_t
address_home(PyObject *p, size_t cap)
{
    return (size_t)(((uintptr_t)p * 0x9E3779B97F4A7C15ULL) >> 40) & (cap - 1);
}

/* the slot of name: where it is, else the first empty one of its four probes, else its
 * home slot, to replace (a step's ten or so names: without the probes, two that shared a
 * slot, as some did in most calls, replaced each other on every row) */
static inline XName *
x_name_slot(XName *names, PyObject *name)
{
    size_t home = address_home(name, X_NAME_SLOTS);
    for (size_t k = 0; k < 4; k++) {
        XName *at = &names[(home + k) & (X_NAME_SLOTS - 1)];
        if (at->name == name || at->name == NULL) {
            return at;
        }
    }
    return &names[home];
}

/* an event's keys, ids and braces: ',"ts":' ',"dur":' ',"span_id":"' 16 hex
 * '","parent_id":"' 16 hex '","status":' and the closing '}' */
#define X_FIXED (6 + 7 + 12 + 16 + 15 + 16 + 11 + 1)
#define X_RELEASE_ROWS 256 /* batches this large are formatted with the GIL released */

static inline int
x_before(const XKey *a, const XKey *b)
{
    /* start ascending, then end descending (a parent before a child that starts at the
     * same ns), then the batch's order */
    if (a->start != b->start) {
        return a->start < b->start;
    }
    if (a->end != b->end) {
        return a->end > b->end;
    }
    return a->i < b->i;
}

static int
x_compare(const void *a, const void *b)
{
    return x_before(a, b) ? -1 : (x_before(b, a) ? 1 : 0);
}

static void
x_sort(XKey *keys, Py_ssize_t n)
{
    /* rows arrive nearly in order (a span ends after its children, so each parent is a
     * few places late): insertion sort, with qsort once the moves exceed a budget. The
     * index breaks ties, so both give the stable order of (start, -end). */
    Py_ssize_t budget = 16 * n + 64, moves = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        XKey k = keys[i];
        Py_ssize_t j = i;
        while (j > 0 && x_before(&k, &keys[j - 1])) {
            keys[j] = keys[j - 1];
            j--;
        }
        keys[j] = k;
        moves += i - j;
        if (moves > budget) {
            qsort(keys, (size_t)n, sizeof(XKey), x_compare);
            return;
        }
    }
}

static inline char *
put_diff_us(char *p, long long hi, long long lo)
{
    /* (hi - lo) ns as exact decimal µs: 1234567 -> "1234.567", -1 -> "-0.001". The
     * magnitude of a difference of two int64 fits in uint64, and unsigned subtraction
     * is defined modulo 2**64, so this cannot overflow. */
    int neg = hi < lo;
    unsigned long long mag = neg ? (unsigned long long)lo - (unsigned long long)hi
                                 : (unsigned long long)hi - (unsigned long long)lo;
    unsigned frac = (unsigned)(mag % 1000ULL);
    if (neg) {
        *p++ = '-';
    }
    p = put_ull(p, mag / 1000ULL);
    p[0] = '.';
    p[1] = (char)('0' + frac / 100);
    memcpy(p + 2, digit_pairs + 2 * (frac % 100), 2);
    return p + 4;
}

static char hex_pairs[513]; /* "000102...ff", filled at module exec */

static void
hex_pairs_init(void)
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 256; i++) {
        hex_pairs[2 * i] = digits[i >> 4];
        hex_pairs[2 * i + 1] = digits[i & 0xF];
    }
}

static inline char *
put_hex16(char *p, unsigned long long v)
{
    for (int i = 14; i >= 0; i -= 2) {
        memcpy(p + i, hex_pairs + 2 * (v & 0xFF), 2);
        v >>= 8;
    }
    return p + 16;
}

static inline char *
put(char *p, const char *s, Py_ssize_t n)
{
    memcpy(p, s, (size_t)n);
    return p + n;
}

#define PUT_LIT(p, s) put((p), (s), (Py_ssize_t)(sizeof(s) - 1))

#if defined(__GNUC__)
#define X_NOINLINE __attribute__((noinline)) /* its own entry in profiles: the GIL-free part */
#else
#define X_NOINLINE
#endif

/* The events of keys[lo..hi) written at out; returns the end. Runs without the GIL:
 * it reads the rows, the arena and the texts' UTF-8, which outlive the call. */
static X_NOINLINE char *
x_format(char *out, const XRow *rows, const XKey *keys, Py_ssize_t lo, Py_ssize_t hi,
         const char *arena, long long origin, int first)
{
    char *p = out;
    for (Py_ssize_t k = lo; k < hi; k++) {
        const XRow *x = &rows[keys[k].i];
        if (k == 0 && first) {
            *p++ = '\n';
        }
        else {
            p = PUT_LIT(p, ",\n");
        }
        p = put(p, x->prefix_s, x->prefix_n);
        p = put_ll(p, x->tid);
        p = PUT_LIT(p, ",\"ts\":");
        p = put_diff_us(p, x->start, origin);
        p = PUT_LIT(p, ",\"dur\":");
        p = put_diff_us(p, x->end > x->start ? x->end : x->start, x->start);
        p = PUT_LIT(p, ",\"span_id\":\"");
        p = put_hex16(p, x->span_id);
        p = PUT_LIT(p, "\",\"parent_id\":\"");
        p = put_hex16(p, x->parent_id);
        p = PUT_LIT(p, "\",\"status\":");
        p = put(p, x->status_s, x->status_n);
        if (x->attrs_n) {
            p = put(p, arena + x->attrs_at, x->attrs_n);
        }
        if (x->error_n) {
            p = put(p, arena + x->error_at, x->error_n);
        }
        *p++ = '}';
    }
    return p;
}

#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h>
#endif
#define FOLD_DIGITS 1
#endif

/* an exact int whose magnitude is below 2**64 (at most three 30-bit digits), read from
 * its digits (CPython before 3.12): 1 with its magnitude and sign, else 0 */
static inline int
fold_digits(PyObject *v, unsigned long long *mag, int *neg)
{
#ifdef FOLD_DIGITS
    Py_ssize_t size = Py_SIZE(v);
    const digit *d = ((PyLongObject *)v)->ob_digit;
    Py_ssize_t n = size < 0 ? -size : size;
    if (n > 3 || (n == 3 && d[2] >= 16)) { /* 16 * 2**60 = 2**64 */
        return 0;
    }
    unsigned long long m = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        m = (m << 30) | d[i];
    }
    *mag = m;
    *neg = size < 0;
    return 1;
#else
    (void)v;
    (void)mag;
    (void)neg;
    return 0;
#endif
}

/* an exact int within int64 / within [0, 2**64), read from its digits: 1, else 0 (not an
 * exact int, out of range, or no digit access: the caller reads it the general way) */
static inline int
read_digits_ll(PyObject *v, long long *out)
{
    unsigned long long mag;
    int neg;
    if (!PyLong_CheckExact(v) || !fold_digits(v, &mag, &neg) ||
        (neg ? mag > (1ULL << 63) : mag > (unsigned long long)LLONG_MAX)) {
        return 0;
    }
    *out = neg ? (long long)(0ULL - mag) : (long long)mag;
    return 1;
}

static inline int
read_digits_ull(PyObject *v, unsigned long long *out)
{
    unsigned long long mag;
    int neg;
    if (!PyLong_CheckExact(v) || !fold_digits(v, &mag, &neg) || (neg && mag)) {
        return 0;
    }
    *out = mag;
    return 1;
}

static int
x_read_ll(PyObject *v, long long *out)
{
    /* an int64 (an object with __index__ runs Python code: its row holds v); an exact
     * int is read from its digits where it can be */
    if (read_digits_ll(v, out)) {
        return 0;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) {
        x = PyLong_AsLongLong(v); /* raises the usual OverflowError */
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_OverflowError, "An int does not fit in int64.");
        }
        return -1;
    }
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = x;
    return 0;
}

static int
x_read_ull(PyObject *v, unsigned long long *out)
{
    /* a uint64 id; PyLong_AsUnsignedLongLong (slow in some versions) only past int64 */
    if (read_digits_ull(v, out)) {
        return 0;
    }
    PyObject *i = PyLong_CheckExact(v) ? Py_NewRef(v) : PyNumber_Index(v);
    if (i == NULL) {
        return -1;
    }
    int overflow = 0, rc = 0;
    long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (!overflow && x >= 0) {
        *out = (unsigned long long)x;
    }
    else if (x == -1 && PyErr_Occurred()) {
        rc = -1;
    }
    else { /* negative (raises) or past int64 */
        *out = PyLong_AsUnsignedLongLong(i);
        rc = (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
    }
    Py_DECREF(i);
    return rc;
}

static PyObject *
x_text(PyObject *cache, PyObject *key, PyObject *make, const char **s, Py_ssize_t *n)
{
    /* cache[key], made by make(key) and stored when missing: a new reference to a str,
     * and its UTF-8. key is held by the caller (its row). */
    PyObject *text = PyDict_GetItemWithError(cache, key);
    if (text != NULL) {
        Py_INCREF(text);
    }
    else {
        if (PyErr_Occurred()) {
            return NULL;
        }
        text = PyObject_CallOneArg(make, key);
        if (text == NULL) {
            return NULL;
        }
        if (PyDict_SetItem(cache, key, text) < 0) {
            Py_DECREF(text);
            return NULL;
        }
    }
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "Expected a str from the encoder, but received %.100s.",
                     Py_TYPE(text)->tp_name);
        Py_DECREF(text);
        return NULL;
    }
    *s = PyUnicode_AsUTF8AndSize(text, n);
    if (*s == NULL) {
        Py_DECREF(text);
        return NULL;
    }
    return text;
}

static int
x_wrap_attrs(Buf *arena, Py_ssize_t at)
{
    /* the attributes written from at as ',"attrs":,"k":v...': the first comma of the
     * list becomes the object's '{'; without any, ',"attrs":' is taken back */
    if (arena->len == at + 9) {
        arena->len = at;
        return 0;
    }
    arena->data[at + 9] = '{';
    return buf_add(arena, "}", 1);
}

/* encode_x_events(rows, prefixes, statuses, attrs, heads, strings, head_of,
 *                 encode_value, origin_ns, quote, prefix_of, first, part_rows)
 *   -> list[bytes] | None
 *
 * The X events of a batch, ordered by (start, longest first; the batch's order
 * among equals), in parts of at most part_rows events: each event preceded by
 * ",\n" ("\n" for the first of the first part when first is true). prefixes maps
 * a name to its event's start (made by prefix_of(name) when missing), statuses a
 * status to its JSON literal (made by quote). attrs is the list of each row's
 * attribute strings (',"key":value...'), or None to encode the rows' attribute
 * dicts here with the caches of encode_attrs; then None is returned when a row
 * needs the Python attribute encoder. A dict that several rows share is encoded
 * once per call: a snapshot, as the Python encoder reads every value before it
 * encodes any. What _encode_columns' Python path writes, byte for byte.
 */
static PyObject *
encode_x_events(PyObject *module, PyObject *args)
{
    PyObject *rows, *prefixes, *statuses, *attrs, *heads, *strings, *head_of, *encode_value;
    PyObject *quote, *prefix_of, *seq = NULL, *texts = NULL, *out = NULL, *row = NULL;
    PyObject *last_attrs = NULL, *last_status_key = NULL, *last_status = NULL;
    PyObject *last_parent = NULL, *last_tid = NULL;
    const char *last_status_s = NULL;
    Py_ssize_t last_status_n = 0, last_at = 0, last_n = 0, part_rows, n = 0, read = 0;
    long long origin;
    int first;
    XRow *xs = NULL;
    XKey *keys = NULL;
    Buf arena = {NULL, 0, 0};
    KeyOrder order[2] = KEY_ORDERS_INIT;
    Py_ssize_t *bounds = NULL; /* per part: the most bytes it can take, then its length */
    char **starts = NULL;
    XName names[X_NAME_SLOTS];
    memset(names, 0, sizeof(names));
    if (!PyArg_ParseTuple(args, "OO!O!OO!O!OOLOOpn:encode_x_events", &rows, &PyDict_Type,
                          &prefixes, &PyDict_Type, &statuses, &attrs, &PyDict_Type, &heads,
                          &PyDict_Type, &strings, &head_of, &encode_value, &origin, &quote,
                          &prefix_of, &first, &part_rows)) {
        return NULL;
    }
    if (part_rows < 1) {
        PyErr_Format(PyExc_ValueError, "Expected a positive part_rows, but received %zd.",
                     part_rows);
        return NULL;
    }
    seq = copy_list(rows, "span rows");
    if (seq == NULL) {
        return NULL;
    }
    n = PyList_GET_SIZE(seq);
    if (attrs != Py_None) {
        if (!PyList_Check(attrs) || PyList_GET_SIZE(attrs) != n) {
            PyErr_Format(PyExc_ValueError, "Expected None or one attribute string per row (%zd).",
                         n);
            goto done;
        }
        texts = copy_list(attrs, "attribute strings");
        if (texts == NULL) {
            goto done;
        }
    }
    if ((size_t)n > PY_SSIZE_T_MAX / sizeof(XRow)) {
        PyErr_NoMemory();
        goto done;
    }
    xs = PyMem_Malloc(((size_t)n + 1) * sizeof(XRow));
    keys = PyMem_Malloc(((size_t)n + 1) * sizeof(XKey));
    if (xs == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* phase 1, the GIL held: every Python value read, each row held while it is read */
    for (Py_ssize_t i = 0; i < n; i++) {
        XRow *x = &xs[i];
        PyObject *name, *st, *d, *error;
        XName *slot;
        row = Py_NewRef(PyList_GET_ITEM(seq, i));
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 10) {
            PyErr_SetString(PyExc_TypeError, "Expected span rows (tuples of 10 fields).");
            goto done;
        }
        x->status = NULL;
        x->attrs_n = x->error_n = 0;
        name = PyTuple_GET_ITEM(row, 0);
        slot = x_name_slot(names, name);
        if (slot->name == name) {
            x->prefix = Py_NewRef(slot->prefix);
            x->prefix_s = slot->s;
            x->prefix_n = slot->n;
        }
        else {
            x->prefix = x_text(prefixes, name, prefix_of, &x->prefix_s, &x->prefix_n);
        }
        read = i + 1; /* xs[0..read) own their texts (the NULL ones are skipped) */
        if (x->prefix == NULL) {
            goto done;
        }
        if (slot->name != name && PyUnicode_CheckExact(name)) { /* an exact str: kept */
            Py_XSETREF(slot->name, Py_NewRef(name));
            Py_XSETREF(slot->prefix, Py_NewRef(x->prefix));
            slot->s = x->prefix_s;
            slot->n = x->prefix_n;
        }
        st = PyTuple_GET_ITEM(row, 8);
        if (st != last_status_key) {
            PyObject *text = x_text(statuses, st, quote, &last_status_s, &last_status_n);
            if (text == NULL) {
                goto done;
            }
            Py_XSETREF(last_status, text);
            Py_XSETREF(last_status_key, Py_NewRef(st)); /* owned: its address stays its own */
        }
        x->status = Py_NewRef(last_status);
        x->status_s = last_status_s;
        x->status_n = last_status_n;
        /* a parent id or thread id that is the row before's object (rows of one step
         * share them) is not read again; those objects are owned while compared */
        PyObject *parent = PyTuple_GET_ITEM(row, 2), *tid = PyTuple_GET_ITEM(row, 6);
        if (x_read_ull(PyTuple_GET_ITEM(row, 1), &x->span_id) < 0 ||
            (parent == last_parent ? (x->parent_id = xs[i - 1].parent_id, 0)
                                   : x_read_ull(parent, &x->parent_id)) < 0 ||
            x_read_ll(PyTuple_GET_ITEM(row, 4), &x->start) < 0 ||
            x_read_ll(PyTuple_GET_ITEM(row, 5), &x->end) < 0 ||
            (tid == last_tid ? (x->tid = xs[i - 1].tid, 0) : x_read_ll(tid, &x->tid)) < 0) {
            goto done;
        }
        if (parent != last_parent) { /* kept when an exact int: read alike each time */
            Py_XSETREF(last_parent, PyLong_CheckExact(parent) ? Py_NewRef(parent) : NULL);
        }
        if (tid != last_tid) {
            Py_XSETREF(last_tid, PyLong_CheckExact(tid) ? Py_NewRef(tid) : NULL);
        }
        d = PyTuple_GET_ITEM(row, 7);
        if (texts != NULL) {
            PyObject *text = Py_NewRef(PyList_GET_ITEM(texts, i));
            Py_ssize_t at = arena.len;
            int rc = buf_add(&arena, ",\"attrs\":", 9) < 0 || buf_add_str(&arena, text) < 0 ||
                     x_wrap_attrs(&arena, at) < 0;
            Py_DECREF(text);
            if (rc) {
                goto done;
            }
            x->attrs_at = at;
            x->attrs_n = arena.len - at;
        }
        else if (d == last_attrs) { /* shared with the row before: encoded once */
            x->attrs_at = last_at;
            x->attrs_n = last_n;
        }
        else {
            Py_ssize_t at = arena.len;
            Py_INCREF(d); /* held by the row too; owned as last_attrs below */
            Py_XSETREF(last_attrs, d);
            if (buf_add(&arena, ",\"attrs\":", 9) < 0) {
                goto done;
            }
            int rc = add_attrs(&arena, d, order, heads, strings, head_of, encode_value);
            if (rc < 0) {
                goto done;
            }
            if (rc > 0) {
                out = Py_NewRef(Py_None); /* not a failure: the attributes go the Python way */
                goto done;
            }
            if (x_wrap_attrs(&arena, at) < 0) {
                goto done;
            }
            x->attrs_at = last_at = at;
            x->attrs_n = last_n = arena.len - at;
        }
        error = PyTuple_GET_ITEM(row, 9);
        if (PyUnicode_Check(error) && PyUnicode_GET_LENGTH(error) > 0) {
            PyObject *quoted = PyObject_CallOneArg(quote, error);
            Py_ssize_t at = arena.len;
            if (quoted == NULL) {
                goto done;
            }
            int rc = buf_add(&arena, ",\"args\":{\"error\":", 17) < 0 ||
                     buf_add_str(&arena, quoted) < 0 || buf_add(&arena, "}", 1) < 0;
            Py_DECREF(quoted);
            if (rc) {
                goto done;
            }
            x->error_at = at;
            x->error_n = arena.len - at;
        }
        keys[i].start = x->start;
        keys[i].end = x->end;
        keys[i].i = i;
        Py_CLEAR(row);
    }
    x_sort(keys, n);
    /* the parts, each made at its largest size (the texts' lengths are known) */
    Py_ssize_t parts = n == 0 ? 0 : (n - 1) / part_rows + 1;
    out = PyList_New(parts);
    bounds = PyMem_Calloc((size_t)parts + 1, sizeof(Py_ssize_t));
    starts = PyMem_Calloc((size_t)parts + 1, sizeof(char *));
    if (out == NULL || bounds == NULL || starts == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* each part's exact size */
        const XRow *x = &xs[keys[k].i];
        Py_ssize_t *b = &bounds[k / part_rows];
        Py_ssize_t texts_n = x->prefix_n + x->status_n + x->attrs_n + x->error_n;
        if (texts_n < 0 || texts_n > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_ssize_t size = (k == 0 && first ? 1 : 2) + X_FIXED + texts_n + len_ll(x->tid) +
                          len_diff_us(x->start, origin) +
                          len_diff_us(x->end > x->start ? x->end : x->start, x->start);
        if (*b > PY_SSIZE_T_MAX - size) {
            PyErr_NoMemory();
            goto fail;
        }
        *b += size;
    }
    for (Py_ssize_t j = 0; j < parts; j++) {
        PyObject *part = PyBytes_FromStringAndSize(NULL, bounds[j]);
        if (part == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, j, part);
        starts[j] = PyBytes_AS_STRING(part);
    }
    /* phase 2: formatting touches no Python object, so a large batch lets go of the GIL */
    {
        int wrong = 0;
        PyThreadState *saved = n >= X_RELEASE_ROWS ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t j = 0; j < parts; j++) {
            Py_ssize_t lo = j * part_rows, hi = lo + part_rows < n ? lo + part_rows : n;
            char *end = x_format(starts[j], xs, keys, lo, hi, arena.data, origin, first);
            wrong |= end - starts[j] != bounds[j];
        }
        if (saved != NULL) {
            PyEval_RestoreThread(saved);
        }
        if (wrong) { /* cannot happen: the sizes are what the put_ functions write */
            PyErr_SetString(PyExc_SystemError, "encode_x_events: a part's size was wrong.");
            goto fail;
        }
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; i < read; i++) {
        Py_XDECREF(xs[i].prefix);
        Py_XDECREF(xs[i].status);
    }
    for (int j = 0; j < X_NAME_SLOTS; j++) {
        Py_XDECREF(names[j].name);
        Py_XDECREF(names[j].prefix);
    }
    PyMem_Free(xs);
    PyMem_Free(keys);
    PyMem_Free(bounds);
    PyMem_Free(starts);
    PyMem_Free(arena.data);
    key_order_free(&order[0]);
    key_order_free(&order[1]);
    Py_XDECREF(row);
    Py_XDECREF(last_attrs);
    Py_XDECREF(last_status);
    Py_XDECREF(last_status_key);
    Py_XDECREF(last_parent);
    Py_XDECREF(last_tid);
    Py_XDECREF(texts);
    Py_XDECREF(seq);
    return out;
}

/* distinct_ints(rows, index) -> list[int] | None
 *
 * The distinct values of field index of the rows (tuples), in the order they first
 * occur: list(dict.fromkeys(row[index] for row in rows)). None when a row is not a
 * tuple that long or a value is not an exact int: the caller's Python code does those.
 * No call in the loop runs Python code (exact ints hash and compare in C), so the
 * list is read in place, its length checked at each step.
 */
static PyObject *
distinct_ints(PyObject *module, PyObject *args)
{
    PyObject *rows, *seen, *out, *last = NULL;
    Py_ssize_t index;
    long long last_value = 0;
    int last_fits = 0; /* last_value holds the value of last */
    if (!PyArg_ParseTuple(args, "O!n:distinct_ints", &PyList_Type, &rows, &index)) {
        return NULL;
    }
    if (index < 0) {
        Py_RETURN_NONE;
    }
    seen = PyDict_New();
    out = PyList_New(0);
    if (seen == NULL || out == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i), *v;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) <= index) {
            goto decline;
        }
        v = PyTuple_GET_ITEM(row, index);
        if (v == last) {
            continue; /* the same object as the row before (held by its row meanwhile) */
        }
        if (!PyLong_CheckExact(v)) {
            goto decline;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(v, &overflow); /* exact: no code */
        if (value == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (last_fits && !overflow && value == last_value) {
            last = v;
            continue; /* equal to the row before's */
        }
        last_value = value;
        last_fits = !overflow;
        int known = PyDict_Contains(seen, v);
        if (known < 0 || (!known && (PyDict_SetItem(seen, v, Py_None) < 0 ||
                                     PyList_Append(out, v) < 0))) {
            goto fail;
        }
        last = v;
    }
    Py_DECREF(seen);
    return out;
decline:
    Py_DECREF(seen);
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(seen);
    Py_XDECREF(out);
    return NULL;
}


/* The numeric fields of a span row (ids as uint64, times and thread id as
 * int64) written at index i of the five bytearrays; -1 with an error set when
 * the row is not a span row. row is a tuple the caller holds. */
static int
row_numbers(PyObject *row, PyObject **arrays, Py_ssize_t i)
{
    static const Py_ssize_t fields[5] = {1, 2, 4, 5, 6};
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 10) {
        PyErr_SetString(PyExc_TypeError, "Expected span rows (tuples of 10 fields).");
        return -1;
    }
    for (int c = 0; c < 5; c++) {
        PyObject *v = PyTuple_GET_ITEM(row, fields[c]);
        char buf[8];
        if (c < 2) {
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                return -1;
            }
            memcpy(buf, &x, 8);
        }
        else {
            long long x = PyLong_AsLongLong(v); /* may run __index__ */
            if (x == -1 && PyErr_Occurred()) {
                return -1;
            }
            memcpy(buf, &x, 8);
        }
        /* the array's address is read after the conversion, which ran Python code */
        memcpy(PyByteArray_AS_STRING(arrays[c]) + i * 8, buf, 8);
    }
    return 0;
}

/* typed_column(attrs, key) -> (kind, data, mask)
 *
 * One attribute key across rows, typed as frame._column would type it:
 *   "i": all present values are exact ints within int64: data = int64 bytes,
 *        mask = missing bytes (1 = missing) or None when none is missing;
 *   "f": exact ints and floats: data = float64 bytes with NaN for missing;
 *   "b": all present values are bools: data = bool bytes, mask = missing bytes;
 *   "o": anything else: data = the list of values (None for missing).
 */
static PyObject *
lookup(PyObject *mapping, PyObject *key)
{
    /* mapping.get(key) as a new reference (Py_None when absent); mapping is held */
    PyObject *v;
    if (is_plain_dict(mapping)) {
        v = PyDict_GetItemWithError(mapping, key);
        if (v == NULL) {
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        return Py_NewRef(v);
    }
    Py_ssize_t size = PyObject_Size(mapping);
    if (size < 0) {
        return NULL;
    }
    if (size == 0) {
        return Py_NewRef(Py_None);
    }
    return PyObject_CallMethod(mapping, "get", "O", key);
}

static PyObject *
strong_get(PyObject *mapping, PyObject *key, int *slow)
{
    /* mapping.get(key) as a new reference for dicts (Py_None when absent); sets *slow
     * for other non-empty mappings, whose values need a real get() */
    if (is_plain_dict(mapping)) {
        return lookup(mapping, key);
    }
    Py_ssize_t size = PyObject_Size(mapping);
    if (size < 0) {
        return NULL;
    }
    if (size > 0) {
        *slow = 1;
    }
    return Py_NewRef(Py_None);
}

static PyObject *
typed_column(PyObject *module, PyObject *args)
{
    PyObject *attrs, *key, *rows = NULL, *values = NULL, *data = NULL, *mask = NULL;
    PyObject *result = NULL;
    int ints = 0, floats = 0, bools = 0, others = 0, missing = 0, slow = 0;
    if (!PyArg_ParseTuple(args, "O!O:typed_column", &PyList_Type, &attrs, &key)) {
        return NULL;
    }
    rows = copy_list(attrs, "attribute mappings");
    if (rows == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    /* pass 1: the kinds of the values (no list is built for numbers) */
    for (Py_ssize_t i = 0; i < n && !slow; i++) {
        PyObject *v = strong_get(PyList_GET_ITEM(rows, i), key, &slow);
        if (v == NULL) {
            goto done;
        }
        if (v == Py_None) {
            missing = 1;
        }
        else if (PyBool_Check(v)) {
            bools = 1;
        }
        else if (PyLong_CheckExact(v)) {
            ints = 1;
        }
        else if (PyFloat_CheckExact(v)) {
            floats = 1;
        }
        else {
            others = 1;
        }
        Py_DECREF(v);
    }
    if (slow || others || !(ints || floats || bools) || (bools && (ints || floats))) {
        goto as_objects;
    }
    data = PyByteArray_FromStringAndSize(NULL, n * 8);
    mask = PyByteArray_FromStringAndSize(NULL, n);
    if (data == NULL || mask == NULL) {
        goto done;
    }
    /* pass 2: the values. A key's __hash__/__eq__ may have changed a row since pass 1:
     * a value of another kind then makes the column objects. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = strong_get(PyList_GET_ITEM(rows, i), key, &slow);
        int ok = 1;
        if (v == NULL) {
            goto done;
        }
        char *d = PyByteArray_AS_STRING(data), *m = PyByteArray_AS_STRING(mask);
        m[i] = (char)(v == Py_None);
        if (bools) {
            ok = v == Py_None || PyBool_Check(v);
            d[i] = (char)(v == Py_True);
        }
        else if (ints && !floats) {
            long long x = 0;
            if (v != Py_None) {
                int overflow = 0;
                ok = PyLong_CheckExact(v);
                x = ok ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
                ok = ok && !overflow && !(x == -1 && PyErr_Occurred());
                PyErr_Clear();
            }
            memcpy(d + i * 8, &x, 8);
        }
        else {
            double x = Py_NAN;
            if (v != Py_None) {
                ok = PyLong_CheckExact(v) || PyFloat_CheckExact(v);
                x = ok ? PyFloat_AsDouble(v) : 0.0; /* exact int or float: no Python code */
                if (x == -1.0 && PyErr_Occurred()) {
                    Py_DECREF(v);
                    goto done;
                }
            }
            memcpy(d + i * 8, &x, 8);
        }
        Py_DECREF(v);
        if (!ok || slow) {
            Py_CLEAR(data);
            Py_CLEAR(mask);
            goto as_objects;
        }
    }
    if (bools) {
        if (PyByteArray_Resize(data, n) < 0) {
            goto done;
        }
        result = Py_BuildValue("(sOO)", "b", data, mask);
    }
    else if (ints && !floats) {
        result = Py_BuildValue("(sOO)", "i", data, missing ? mask : Py_None);
    }
    else {
        result = Py_BuildValue("(sOO)", "f", data, Py_None);
    }
    goto done;
as_objects:
    values = PyList_New(n);
    if (values == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(values, i, Py_NewRef(Py_None));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = lookup(PyList_GET_ITEM(rows, i), key);
        if (v == NULL) {
            goto done;
        }
        list_replace(values, i, v);
    }
    result = Py_BuildValue("(sOO)", "o", values, Py_None);
done:
    Py_XDECREF(values);
    Py_XDECREF(data);
    Py_XDECREF(mask);
    Py_XDECREF(rows);
    return result;
}

/* dict_encode(values) -> (codes, uniques), or None
 *
 * A list of str (exact) or None as int32 codes (bytes, native order; -1 for
 * None) into the list of its distinct strings, in order of first appearance.
 * None when another kind of value is present. What pandas.factorize does for
 * such a list, without building an object array first.
 */
typedef struct {
    PyObject *index; /* str -> code */
    PyObject *uniques;
    PyObject *last; /* the last string seen (kept alive by uniques), and its code */
    int32_t last_code;
} Encoder;

static int
encoder_init(Encoder *e)
{
    e->index = PyDict_New();
    e->uniques = PyList_New(0);
    e->last = NULL;
    e->last_code = -1;
    return (e->index == NULL || e->uniques == NULL) ? -1 : 0;
}

static void
encoder_clear(Encoder *e)
{
    Py_CLEAR(e->index);
    Py_CLEAR(e->uniques);
    e->last = NULL;
}

static int
encoder_code(Encoder *e, PyObject *s, int32_t *out)
{
    /* the code of the exact str (or exact int) s, adding it when new; -1 on error.
     * Hashing and comparing exact str and int runs no Python code. */
    if (s == e->last) {
        *out = e->last_code;
        return 0;
    }
    PyObject *found = PyDict_GetItemWithError(e->index, s);
    long code;
    if (found != NULL) {
        code = PyLong_AsLong(found);
    }
    else {
        if (PyErr_Occurred()) {
            return -1;
        }
        code = (long)PyList_GET_SIZE(e->uniques);
        if (code >= INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "Too many distinct strings to encode.");
            return -1;
        }
        PyObject *boxed = PyLong_FromLong(code);
        if (boxed == NULL) {
            return -1;
        }
        int failed = PyDict_SetItem(e->index, s, boxed) < 0 || PyList_Append(e->uniques, s) < 0;
        Py_DECREF(boxed);
        if (failed) {
            return -1;
        }
    }
    e->last = s; /* kept alive by e->uniques, which we own */
    e->last_code = (int32_t)code;
    *out = (int32_t)code;
    return 0;
}

static PyObject *
dict_encode(PyObject *module, PyObject *arg)
{
    Encoder e;
    PyObject *codes = NULL, *result = NULL;
    memset(&e, 0, sizeof(e));
    if (!PyList_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "Expected a list of strings, but received %.100s.",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    if (encoder_init(&e) < 0) {
        goto done;
    }
    codes = PyByteArray_FromStringAndSize(NULL, n * 4);
    if (codes == NULL) {
        goto done;
    }
    /* No call in this loop can run Python code (exact str only; no GC-tracked object is
     * allocated), so the list cannot change under it; its length is checked anyway. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(arg)) {
            PyErr_SetString(PyExc_RuntimeError, "The list changed while it was encoded.");
            goto done;
        }
        PyObject *v = PyList_GET_ITEM(arg, i);
        int32_t *c = (int32_t *)PyByteArray_AS_STRING(codes);
        if (v == Py_None) {
            c[i] = -1;
        }
        else if (!PyUnicode_CheckExact(v)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        else if (encoder_code(&e, v, &c[i]) < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(2, codes, e.uniques);
done:
    Py_XDECREF(codes);
    encoder_clear(&e);
    return result;
}


/* attr_table(attrs, skip=frozenset()) -> (keys, columns), or None
 *
 * Every attribute key across a list of attribute dicts, in one pass per row
 * instead of one lookup per row and key. keys are in order of first
 * appearance; columns[k] is (kind, data, extra), typed as frame._column
 * would type the values of keys[k] (None or absent = missing):
 *   "i": exact ints within int64: int64 bytes, and missing bytes (1 = missing)
 *        or None when none is missing;
 *   "f": exact ints and floats: float64 bytes with NaN for missing, None;
 *   "b": bools: bool bytes, missing bytes;
 *   "s": exact strs: int32 codes (-1 for missing), the list of distinct strs;
 *   "o": anything else: the list of values (None for missing), None.
 * Keys in skip get no column. None when a row is a non-empty mapping other
 * than a dict, or has a key that is not an exact str (the caller then uses
 * typed_column per key).
 */
enum { K_INT = 1, K_FLOAT = 2, K_BOOL = 4, K_STR = 8, K_OTHER = 16, K_BIG = 32 };

typedef struct {
    int seen;          /* K_* flags of the present values */
    Py_ssize_t present; /* rows with a non-None value */
    int skip;          /* a key the caller does not want */
    char kind;
    PyObject *data, *extra;
    Encoder enc;
} Column;

static int
kind_of(PyObject *v)
{
    if (PyBool_Check(v)) {
        return K_BOOL;
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            return -1;
        }
        return overflow ? (K_INT | K_BIG) : K_INT;
    }
    if (PyFloat_CheckExact(v)) {
        return K_FLOAT;
    }
    if (PyUnicode_CheckExact(v)) {
        return K_STR;
    }
    return K_OTHER;
}

static char
column_kind(const Column *c)
{
    int s = c->seen;
    if (c->present == 0 || (s & K_OTHER)) {
        return 'o';
    }
    if (s == K_STR) {
        return 's';
    }
    if (s & K_STR) {
        return 'o';
    }
    if (s == K_BOOL) {
        return 'b';
    }
    if (s & K_BOOL) {
        return 'o';
    }
    if (!(s & K_FLOAT)) {
        return (s & K_BIG) ? 'o' : 'i';
    }
    return 'f';
}

/* The column of attribute key k, found through a cache of the key seen at the
 * same position of the previous dicts (rows mostly share their key order),
 * else through keymap. -1 with no error set: the key is new. The cache owns
 * its keys, so that a cached address always means the same key. */
#define SLOTS 32

typedef struct {
    PyObject *key[SLOTS]; /* owned */
    Py_ssize_t col[SLOTS];
} SlotCache;

static void
slot_store(SlotCache *cache, Py_ssize_t slot, PyObject *k, Py_ssize_t col)
{
    if (slot < SLOTS) {
        Py_XSETREF(cache->key[slot], Py_NewRef(k)); /* releases an exact str: no code runs */
        cache->col[slot] = col;
    }
}

static Py_ssize_t
slot_lookup(SlotCache *cache, Py_ssize_t slot, PyObject *keymap, PyObject *k)
{
    if (slot < SLOTS && cache->key[slot] == k) {
        return cache->col[slot];
    }
    PyObject *found = PyDict_GetItemWithError(keymap, k); /* k: an exact str */
    if (found == NULL) {
        return -1;
    }
    Py_ssize_t col = PyLong_AsSsize_t(found);
    slot_store(cache, slot, k, col);
    return col;
}

static void
slot_cache_clear(SlotCache *cache)
{
    for (int s = 0; s < SLOTS; s++) {
        Py_CLEAR(cache->key[s]);
    }
}

static PyObject *
attr_table(PyObject *module, PyObject *args)
{
    PyObject *arg, *rows = NULL, *skip = NULL, *keymap = NULL, *keys = NULL, *result = NULL;
    PyObject *columns = NULL, *wanted = NULL, *a = NULL, *k = NULL, *v = NULL;
    Column *cols = NULL;
    Py_ssize_t ncols = 0, cap = 0;
    SlotCache cache;
    memset(&cache, 0, sizeof(cache));
    if (!PyArg_ParseTuple(args, "O!|O!:attr_table", &PyList_Type, &arg, &PyFrozenSet_Type,
                          &skip)) {
        return NULL;
    }
    rows = copy_list(arg, "attribute mappings");
    if (rows == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    keymap = PyDict_New();
    keys = PyList_New(0);
    if (keymap == NULL || keys == NULL) {
        goto done;
    }
    /* pass 1: the keys, and the kinds of their values */
    for (Py_ssize_t i = 0; i < n; i++) {
        a = Py_NewRef(PyList_GET_ITEM(rows, i));
        if (!is_plain_dict(a)) {
            Py_ssize_t size = PyObject_Size(a);
            if (size < 0) {
                goto done;
            }
            if (size > 0) {
                result = Py_NewRef(Py_None);
                goto done;
            }
            Py_CLEAR(a);
            continue;
        }
        Py_ssize_t pos = 0, slot = 0;
        PyObject *bk, *bv;
        while (PyDict_Next(a, &pos, &bk, &bv)) {
            k = Py_NewRef(bk);
            v = Py_NewRef(bv);
            if (!PyUnicode_CheckExact(k)) {
                result = Py_NewRef(Py_None); /* typed per key in Python and typed_column */
                goto done;
            }
            Py_ssize_t col = slot_lookup(&cache, slot, keymap, k);
            if (col < 0) {
                if (PyErr_Occurred()) {
                    goto done;
                }
                col = ncols;
                if (ncols == cap) {
                    Py_ssize_t grown = cap ? cap * 2 : 16;
                    Column *bigger = PyMem_Realloc(cols, (size_t)grown * sizeof(Column));
                    if (bigger == NULL) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    cols = bigger;
                    cap = grown;
                }
                memset(&cols[col], 0, sizeof(Column));
                ncols++;
                if (skip != NULL) {
                    int found_skip = PySet_Contains(skip, k);
                    if (found_skip < 0) {
                        goto done;
                    }
                    cols[col].skip = found_skip;
                }
                PyObject *boxed = PyLong_FromSsize_t(col);
                if (boxed == NULL) {
                    goto done;
                }
                int failed = PyDict_SetItem(keymap, k, boxed) < 0 || PyList_Append(keys, k) < 0;
                Py_DECREF(boxed);
                if (failed) {
                    goto done;
                }
                slot_store(&cache, slot, k, col);
            }
            slot++;
            if (v != Py_None && !cols[col].skip) {
                int kind = kind_of(v);
                if (kind < 0) {
                    goto done;
                }
                cols[col].seen |= kind;
                cols[col].present++;
            }
            Py_CLEAR(k);
            Py_CLEAR(v);
        }
        Py_CLEAR(a);
    }
    /* the columns, filled with "missing" */
    for (Py_ssize_t c = 0; c < ncols; c++) {
        Column *col = &cols[c];
        if (col->skip) {
            continue;
        }
        col->kind = column_kind(col);
        switch (col->kind) {
            case 'i':
                col->data = PyByteArray_FromStringAndSize(NULL, n * 8);
                col->extra = PyByteArray_FromStringAndSize(NULL, n);
                if (col->data && col->extra) {
                    memset(PyByteArray_AS_STRING(col->data), 0, (size_t)n * 8);
                    memset(PyByteArray_AS_STRING(col->extra), 1, (size_t)n);
                }
                break;
            case 'f':
                col->data = PyByteArray_FromStringAndSize(NULL, n * 8);
                if (col->data) {
                    double *d = (double *)PyByteArray_AS_STRING(col->data);
                    for (Py_ssize_t i = 0; i < n; i++) {
                        d[i] = Py_NAN;
                    }
                }
                col->extra = Py_NewRef(Py_None);
                break;
            case 'b':
                col->data = PyByteArray_FromStringAndSize(NULL, n);
                col->extra = PyByteArray_FromStringAndSize(NULL, n);
                if (col->data && col->extra) {
                    memset(PyByteArray_AS_STRING(col->data), 0, (size_t)n);
                    memset(PyByteArray_AS_STRING(col->extra), 1, (size_t)n);
                }
                break;
            case 's':
                col->data = PyByteArray_FromStringAndSize(NULL, n * 4);
                if (col->data) {
                    memset(PyByteArray_AS_STRING(col->data), 0xff, (size_t)n * 4); /* -1 */
                }
                if (encoder_init(&col->enc) < 0) {
                    goto done;
                }
                col->extra = Py_NewRef(col->enc.uniques);
                break;
            default:
                col->data = PyList_New(n);
                if (col->data) {
                    for (Py_ssize_t i = 0; i < n; i++) {
                        PyList_SET_ITEM(col->data, i, Py_NewRef(Py_None));
                    }
                }
                col->extra = Py_NewRef(Py_None);
        }
        if (col->data == NULL || col->extra == NULL) {
            goto done;
        }
    }
    /* pass 2: the values. The allocations above may have run finalizers that changed
     * a row: every value is checked against its column's kind. */
    for (Py_ssize_t i = 0; i < n; i++) {
        a = Py_NewRef(PyList_GET_ITEM(rows, i));
        if (!is_plain_dict(a)) {
            Py_CLEAR(a);
            continue; /* empty */
        }
        Py_ssize_t pos = 0, slot = 0;
        PyObject *bk, *bv;
        while (PyDict_Next(a, &pos, &bk, &bv)) {
            k = Py_NewRef(bk);
            v = Py_NewRef(bv);
            Py_ssize_t c = PyUnicode_CheckExact(k) ? slot_lookup(&cache, slot++, keymap, k) : -1;
            if (c < 0) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_RuntimeError,
                                    "The attributes changed while the frame was built.");
                }
                goto done;
            }
            Column *col = &cols[c];
            if (v == Py_None || col->skip) {
                Py_CLEAR(k);
                Py_CLEAR(v);
                continue;
            }
            int changed = 0;
            switch (col->kind) {
                case 'i': {
                    int overflow = 0;
                    long long x = 0;
                    changed = !PyLong_CheckExact(v);
                    if (!changed) {
                        x = PyLong_AsLongLongAndOverflow(v, &overflow);
                        if (x == -1 && PyErr_Occurred()) {
                            goto done;
                        }
                        changed = overflow;
                    }
                    memcpy(PyByteArray_AS_STRING(col->data) + i * 8, &x, 8);
                    PyByteArray_AS_STRING(col->extra)[i] = 0;
                    break;
                }
                case 'f': {
                    double x = 0.0;
                    changed = !PyLong_CheckExact(v) && !PyFloat_CheckExact(v);
                    if (!changed) {
                        x = PyFloat_AsDouble(v);
                        if (x == -1.0 && PyErr_Occurred()) {
                            goto done;
                        }
                    }
                    memcpy(PyByteArray_AS_STRING(col->data) + i * 8, &x, 8);
                    break;
                }
                case 'b':
                    changed = !PyBool_Check(v);
                    PyByteArray_AS_STRING(col->data)[i] = (char)(v == Py_True);
                    PyByteArray_AS_STRING(col->extra)[i] = 0;
                    break;
                case 's': {
                    int32_t code;
                    changed = !PyUnicode_CheckExact(v);
                    if (!changed) {
                        if (encoder_code(&col->enc, v, &code) < 0) {
                            goto done;
                        }
                        memcpy(PyByteArray_AS_STRING(col->data) + i * 4, &code, 4);
                    }
                    break;
                }
                default:
                    list_replace(col->data, i, Py_NewRef(v));
            }
            if (changed) {
                PyErr_SetString(PyExc_RuntimeError,
                                "The attributes changed while the frame was built.");
                goto done;
            }
            Py_CLEAR(k);
            Py_CLEAR(v);
        }
        Py_CLEAR(a);
    }
    columns = PyList_New(0);
    wanted = PyList_New(0);
    if (columns == NULL || wanted == NULL) {
        goto done;
    }
    for (Py_ssize_t c = 0; c < ncols; c++) {
        Column *col = &cols[c];
        if (col->skip) {
            continue;
        }
        PyObject *extra = col->extra;
        if (col->kind == 'i' && col->present == n) {
            extra = Py_None; /* no value missing */
        }
        PyObject *item = Py_BuildValue("(C O O)", col->kind, col->data, extra);
        if (item == NULL) {
            goto done;
        }
        int failed = PyList_Append(columns, item) < 0 ||
                     PyList_Append(wanted, PyList_GET_ITEM(keys, c)) < 0;
        Py_DECREF(item);
        if (failed) {
            goto done;
        }
    }
    result = PyTuple_Pack(2, wanted, columns);
done:
    Py_XDECREF(a);
    Py_XDECREF(k);
    Py_XDECREF(v);
    slot_cache_clear(&cache);
    for (Py_ssize_t c = 0; c < ncols; c++) {
        Py_XDECREF(cols[c].data);
        Py_XDECREF(cols[c].extra);
        encoder_clear(&cols[c].enc);
    }
    PyMem_Free(cols);
    Py_XDECREF(columns);
    Py_XDECREF(wanted);
    Py_XDECREF(keymap);
    Py_XDECREF(keys);
    Py_XDECREF(rows);
    return result;
}

/* span_columns(rows) -> (names, trace_ids, statuses, errors, attributes,
 *                       span_ids, parent_ids, starts, ends, tids)
 *
 * The columns of a list of SpanRow tuples. Names, trace ids, statuses and errors come
 * dictionary-encoded as (codes, uniques) like dict_encode (trace ids are ints,
 * so their codes index ints), or as a list of the objects when a value is
 * neither an exact str, an exact int nor None. attributes is the list of the
 * rows' attribute mappings; the rest are bytearrays of native uint64 (span and
 * parent ids) and int64 (start, end, thread id) for numpy.frombuffer.
 */
static PyObject *
span_columns(PyObject *module, PyObject *arg)
{
    static const Py_ssize_t coded_fields[4] = {0, 3, 8, 9};
    Encoder enc[4];
    PyObject *codes[4] = {NULL, NULL, NULL, NULL};
    PyObject *coded[4] = {NULL, NULL, NULL, NULL};
    PyObject *arrays[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *rows = NULL, *attrs = NULL, *result = NULL;
    int as_list[4] = {0, 0, 0, 0};
    memset(enc, 0, sizeof(enc));
    if (!PyList_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "Expected a list of span rows, but received %.100s.",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    /* a private copy: a row's __index__ may change the caller's list */
    rows = copy_list(arg, "span rows");
    if (rows == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    attrs = PyList_New(n);
    if (attrs == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(attrs, i, Py_NewRef(Py_None));
    }
    for (int c = 0; c < 4; c++) {
        codes[c] = PyByteArray_FromStringAndSize(NULL, n * 4);
        if (codes[c] == NULL || encoder_init(&enc[c]) < 0) {
            goto done;
        }
    }
    for (int c = 0; c < 5; c++) {
        arrays[c] = PyByteArray_FromStringAndSize(NULL, n * 8);
        if (arrays[c] == NULL) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i); /* owned by our copy; a tuple */
        if (row_numbers(row, arrays, i) < 0) {
            goto done;
        }
        list_replace(attrs, i, Py_NewRef(PyTuple_GET_ITEM(row, 7)));
        for (int c = 0; c < 4; c++) {
            if (as_list[c]) {
                continue;
            }
            PyObject *v = PyTuple_GET_ITEM(row, coded_fields[c]);
            int32_t code = -1;
            if (v == Py_None) {
                code = -1;
            }
            else if (PyUnicode_CheckExact(v) || PyLong_CheckExact(v)) {
                if (encoder_code(&enc[c], v, &code) < 0) {
                    goto done;
                }
            }
            else {
                as_list[c] = 1; /* listed after this loop */
            }
            memcpy(PyByteArray_AS_STRING(codes[c]) + i * 4, &code, 4);
        }
    }
    for (int c = 0; c < 4; c++) {
        if (as_list[c]) {
            coded[c] = PyList_New(n);
            if (coded[c] == NULL) {
                goto done;
            }
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *row = PyList_GET_ITEM(rows, i);
                PyList_SET_ITEM(coded[c], i, Py_NewRef(PyTuple_GET_ITEM(row, coded_fields[c])));
            }
        }
        else {
            coded[c] = PyTuple_Pack(2, codes[c], enc[c].uniques);
            if (coded[c] == NULL) {
                goto done;
            }
        }
    }
    result = PyTuple_Pack(10, coded[0], coded[1], coded[2], coded[3], attrs, arrays[0], arrays[1],
                          arrays[2], arrays[3], arrays[4]);
done:
    for (int c = 0; c < 4; c++) {
        Py_XDECREF(codes[c]);
        Py_XDECREF(coded[c]);
        encoder_clear(&enc[c]);
    }
    for (int c = 0; c < 5; c++) {
        Py_XDECREF(arrays[c]);
    }
    Py_XDECREF(attrs);
    Py_XDECREF(rows);
    return result;
}

/* event_columns(events, fields, attr_index, attr_items) -> tuple | None
 *
 * The columns of a chunk of decoded trace events (exporters/chrome/_parse.TypedEvent
 * structs) for the trace reader: what SpanColumns._add_x (exporters/chrome/_events.py)
 * builds in Python, in one pass. fields are the attribute names to read, in this
 * order: name, pid, tid, ts, dur, span_id, parent_id, status, attrs, args. Returns
 * (names, statuses, ts, dur, pids, tids, span_ids, parent_ids, attr_codes): names and
 * statuses as (int32 codes, uniques) like dict_encode, ts and dur as float64, the
 * others as int64 (ids uint64), in bytearrays for numpy.frombuffer. Each event's raw
 * attrs (any buffer) is looked up as bytes in attr_index (bytes -> int code); a new
 * one gets the next code and is appended to attr_items (codes of events of a chunk
 * that then goes the Python way stay unused, and are dropped at the end).
 *
 * Returns None when an event has another shape (ts or dur not an exact float, pid or
 * tid not an exact int within int64, an id that is not a str of 16 hex digits, a name
 * or status that is not an exact str, args not None): the caller's Python path,
 * which gives the same columns, then takes the whole chunk. Every field is read as a
 * new reference and released after use; nothing read runs Python code (exact
 * float/int/str, bytes hashing, a buffer of msgspec.Raw).
 */
static int
hex16(PyObject *s, unsigned long long *out)
{
    /* an exact str of 16 hex digits (either case) as its value; 0 when it is not one */
    if (!PyUnicode_CheckExact(s) || PyUnicode_GET_LENGTH(s) != 16 ||
        PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND) {
        return 0;
    }
    const Py_UCS1 *c = PyUnicode_1BYTE_DATA(s);
    unsigned long long v = 0;
    for (int i = 0; i < 16; i++) {
        int d;
        if (c[i] >= '0' && c[i] <= '9') {
            d = c[i] - '0';
        }
        else if (c[i] >= 'a' && c[i] <= 'f') {
            d = c[i] - 'a' + 10;
        }
        else if (c[i] >= 'A' && c[i] <= 'F') {
            d = c[i] - 'A' + 10;
        }
        else {
            return 0;
        }
        v = (v << 4) | (unsigned long long)d;
    }
    *out = v;
    return 1;
}

enum { EV_NAME, EV_PID, EV_TID, EV_TS, EV_DUR, EV_SID, EV_PAR, EV_STATUS, EV_ATTRS, EV_ARGS };
#define EV_FIELDS 10

static int
slot_offsets(PyTypeObject *type, PyObject *fields, Py_ssize_t *offsets)
{
    /* Where each field of the struct type lives in its instances: 1 when every field is a
     * plain object slot (a member descriptor, as msgspec makes them), 0 when one is not
     * (then the caller reads fields through getattr), -1 on error. Runs before any event
     * is read. */
    for (int f = 0; f < EV_FIELDS; f++) {
        PyObject *d = PyObject_GetAttr((PyObject *)type, PyTuple_GET_ITEM(fields, f));
        if (d == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                return -1;
            }
            PyErr_Clear(); /* not a class attribute: the instances' getattr will tell */
            return 0;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (ok) {
            offsets[f] = ((PyMemberDescrObject *)d)->d_member->offset;
        }
        Py_DECREF(d);
        if (!ok) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
event_columns(PyObject *module, PyObject *args)
{
    PyObject *events_in, *fields, *attr_index, *attr_items;
    PyObject *events = NULL, *result = NULL, *value[EV_FIELDS];
    PyObject *arrays[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *codes[2] = {NULL, NULL}, *coded[2] = {NULL, NULL};
    Encoder enc[2];
    int shape_ok = 1;
    memset(enc, 0, sizeof(enc));
    for (int f = 0; f < EV_FIELDS; f++) {
        value[f] = NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!:event_columns", &events_in, &PyTuple_Type, &fields,
                          &PyDict_Type, &attr_index, &PyList_Type, &attr_items)) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(fields) != EV_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "Expected the names of the 10 event fields.");
        return NULL;
    }
    events = copy_list(events_in, "trace events");
    if (events == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (n > PY_SSIZE_T_MAX / 8) {
        PyErr_NoMemory();
        goto done;
    }
    for (int c = 0; c < 7; c++) {
        arrays[c] = PyByteArray_FromStringAndSize(NULL, n * 8);
        if (arrays[c] == NULL) {
            goto done;
        }
    }
    for (int c = 0; c < 2; c++) {
        codes[c] = PyByteArray_FromStringAndSize(NULL, n * 4);
        if (codes[c] == NULL || encoder_init(&enc[c]) < 0) {
            goto done;
        }
    }
    double *ts = (double *)PyByteArray_AS_STRING(arrays[0]);
    double *dur = (double *)PyByteArray_AS_STRING(arrays[1]);
    long long *pid = (long long *)PyByteArray_AS_STRING(arrays[2]);
    long long *tid = (long long *)PyByteArray_AS_STRING(arrays[3]);
    unsigned long long *sid = (unsigned long long *)PyByteArray_AS_STRING(arrays[4]);
    unsigned long long *par = (unsigned long long *)PyByteArray_AS_STRING(arrays[5]);
    long long *attr = (long long *)PyByteArray_AS_STRING(arrays[6]);
    /* the fields' slots in the first event's type: read straight from each event of
     * exactly that type (a new reference each, as getattr would give) */
    PyTypeObject *type = n ? Py_TYPE(PyList_GET_ITEM(events, 0)) : NULL;
    Py_ssize_t offsets[EV_FIELDS];
    int slots = type == NULL ? 0 : slot_offsets(type, fields, offsets);
    if (slots < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n && shape_ok; i++) {
        PyObject *event = PyList_GET_ITEM(events, i); /* held by our copy */
        for (int f = 0; f < EV_FIELDS; f++) {
            if (slots && Py_TYPE(event) == type) {
                PyObject *v = *(PyObject **)((char *)event + offsets[f]);
                value[f] = v == NULL ? NULL : Py_NewRef(v);
                if (value[f] == NULL) { /* an unset slot: not an event of the fast shape */
                    shape_ok = 0;
                    break;
                }
            }
            else {
                value[f] = PyObject_GetAttr(event, PyTuple_GET_ITEM(fields, f));
                if (value[f] == NULL) {
                    goto done;
                }
            }
        }
        if (!shape_ok) {
            break;
        }
        int overflow_pid = 0, overflow_tid = 0;
        int32_t name_code = 0, status_code = 0;
        shape_ok = PyFloat_CheckExact(value[EV_TS]) && PyFloat_CheckExact(value[EV_DUR]) &&
                   PyLong_CheckExact(value[EV_PID]) && PyLong_CheckExact(value[EV_TID]) &&
                   PyUnicode_CheckExact(value[EV_NAME]) &&
                   PyUnicode_CheckExact(value[EV_STATUS]) && value[EV_ARGS] == Py_None &&
                   hex16(value[EV_SID], &sid[i]) && hex16(value[EV_PAR], &par[i]);
        if (shape_ok) {
            pid[i] = PyLong_AsLongLongAndOverflow(value[EV_PID], &overflow_pid);
            tid[i] = PyLong_AsLongLongAndOverflow(value[EV_TID], &overflow_tid);
            shape_ok = !overflow_pid && !overflow_tid && !PyErr_Occurred();
        }
        if (shape_ok) {
            ts[i] = PyFloat_AS_DOUBLE(value[EV_TS]);
            dur[i] = PyFloat_AS_DOUBLE(value[EV_DUR]);
            if (encoder_code(&enc[0], value[EV_NAME], &name_code) < 0 ||
                encoder_code(&enc[1], value[EV_STATUS], &status_code) < 0) {
                goto done;
            }
            memcpy(PyByteArray_AS_STRING(codes[0]) + i * 4, &name_code, 4);
            memcpy(PyByteArray_AS_STRING(codes[1]) + i * 4, &status_code, 4);
            Py_buffer view;
            if (PyObject_GetBuffer(value[EV_ATTRS], &view, PyBUF_SIMPLE) < 0) {
                goto done;
            }
            PyObject *key = PyBytes_FromStringAndSize(view.buf, view.len);
            PyBuffer_Release(&view);
            if (key == NULL) {
                goto done;
            }
            PyObject *found = PyDict_GetItemWithError(attr_index, key); /* bytes: no code */
            if (found != NULL) {
                attr[i] = PyLong_AsLongLong(found);
            }
            else if (!PyErr_Occurred()) {
                Py_ssize_t next = PyList_GET_SIZE(attr_items);
                PyObject *boxed = PyLong_FromSsize_t(next);
                int failed = boxed == NULL || PyDict_SetItem(attr_index, key, boxed) < 0 ||
                             PyList_Append(attr_items, key) < 0;
                Py_XDECREF(boxed);
                attr[i] = (long long)next;
                if (failed) {
                    Py_DECREF(key);
                    goto done;
                }
            }
            Py_DECREF(key);
            if (PyErr_Occurred()) {
                goto done;
            }
        }
        for (int f = 0; f < EV_FIELDS; f++) {
            Py_CLEAR(value[f]);
        }
    }
    if (!shape_ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (int c = 0; c < 2; c++) {
        coded[c] = PyTuple_Pack(2, codes[c], enc[c].uniques);
        if (coded[c] == NULL) {
            goto done;
        }
    }
    result = PyTuple_Pack(9, coded[0], coded[1], arrays[0], arrays[1], arrays[2], arrays[3],
                          arrays[4], arrays[5], arrays[6]);
done:
    for (int f = 0; f < EV_FIELDS; f++) {
        Py_XDECREF(value[f]);
    }
    for (int c = 0; c < 7; c++) {
        Py_XDECREF(arrays[c]);
    }
    for (int c = 0; c < 2; c++) {
        Py_XDECREF(codes[c]);
        Py_XDECREF(coded[c]);
        encoder_clear(&enc[c]);
    }
    Py_XDECREF(events);
    return result;
}

/* scan_events(buffer, start, end) -> (names, statuses, ts, dur, pid, tid, span_id,
 *     parent_id, attrs, attr_info, others)
 *
 * The trace reader's line scanner: the lines buffer[start:end] of a file in ppetrace's
 * one-event-per-line layout, read straight into the columns event_columns gives,
 * without an object per event. Its pure-Python twin is the msgspec path (exporters/
 * chrome/_parse.py decodes the lines into TypedEvent structs, exporters/chrome/
 * _events.py takes their columns). attrs holds each row's code (int64) among the
 * call's distinct raw attrs objects; attr_info is those objects taken apart by key,
 * (keys, values, codes) as attr_split gives them (but a key whose values are all
 * integers of at most 18 digits has them as int64 bytes, not raw), or, when one of
 * them cannot be (a key with an escape, or twice), the objects themselves, a list of
 * bytes by code.
 *
 * A line is taken here only when it is exactly an X event as ppetrace writes it:
 *
 *   {"key":value,...},   then optional spaces, tabs or \r, then \n (or the end)
 *
 * with no whitespace between the event's tokens, "ph":"X", "name" and "status" strings
 * without backslashes or control characters (and valid UTF-8), "pid"/"tid" integers of
 * at most 18 digits, "ts"/"dur" finite numbers, "span_id"/"parent_id" 16 hex digits, optional "attrs" (any valid JSON value, kept
 * raw), no "args", no key twice, and any other key's value valid JSON. Every other
 * line (metadata events, an error's args, another layout, anything odd) is handed back
 * as a (start, end) pair in others, for the caller to decode with msgspec; the caller
 * reads the whole block the msgspec way when one of those is an X event. So every line
 * taken here is one that msgspec would decode to a TypedEvent with these same values,
 * which event_columns would take.
 *
 * Numbers: ts and dur of at most 15 digits without an exponent are exact integers
 * divided once by an exact power of ten (correctly rounded, as msgspec's parser);
 * others go through PyOS_string_to_double (correctly rounded too), and a value out of
 * the double range sends the line back.
 *
 * The buffer is held (a Py_buffer export) for the whole call, so it cannot be resized
 * or freed under the scan. The loop makes no Python object: it fills this call's own
 * arrays and C tables that point into the buffer, so a large range is scanned, and its
 * distinct attrs objects taken apart, without the GIL (two threads can scan two halves
 * of a block at once: exporters/chrome/_parse.py). Only a number that needs
 * PyOS_string_to_double takes the GIL back, for that call. After the loop, with the
 * GIL: the names and statuses become str, the keys str and the attribute values bytes;
 * no Python code runs there either.
 */

typedef struct {
    uint64_t hash;
    const char *data; /* in memory that outlives the table (the scanned buffer, or a
                       * str or bytes object that the caller keeps alive) */
    Py_ssize_t len;
    long long code;
} TableEntry;

typedef struct {
    TableEntry *slots;
    Py_ssize_t cap; /* a power of two */
    Py_ssize_t used;
} BytesTable;

static uint64_t
bytes_hash(const char *p, Py_ssize_t n)
{
    /* eight bytes at a time, each word mixed in by a multiply and a rotation */
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) {
        h = (h ^ (unsigned char)p[i]) * 0x100000001B3ULL;
    }
    h ^= h >> 32;
    return h * 0xC4CEB9FE1A85EC53ULL;
}

static int
table_init(BytesTable *t)
{
    /* the raw allocator: tables are also filled without the GIL (scan_events) */
    t->cap = 64;
    t->used = 0;
    t->slots = PyMem_RawCalloc((size_t)t->cap, sizeof(TableEntry));
    if (t->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
table_free(BytesTable *t)
{
    PyMem_RawFree(t->slots);
    t->slots = NULL;
}

static TableEntry *
table_find(BytesTable *t, const char *p, Py_ssize_t n, uint64_t h)
{
    /* the entry of these bytes, or the empty slot where they would go */
    Py_ssize_t mask = t->cap - 1, i = (Py_ssize_t)(h & (uint64_t)mask);
    for (;;) {
        TableEntry *e = &t->slots[i];
        if (e->data == NULL || (e->hash == h && e->len == n && memcmp(e->data, p, n) == 0)) {
            return e;
        }
        i = (i + 1) & mask;
    }
}

static int
table_put(BytesTable *t, TableEntry *slot, const char *p, Py_ssize_t n, uint64_t h,
          long long code)
{
    /* fill the empty slot that table_find gave, growing the table at half full; -1
     * when memory runs out, with no exception set (callable without the GIL) */
    slot->hash = h;
    slot->data = p;
    slot->len = n;
    slot->code = code;
    t->used++;
    if (t->used * 2 < t->cap) {
        return 0;
    }
    if (t->cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(TableEntry)) {
        return -1;
    }
    BytesTable bigger = {PyMem_RawCalloc((size_t)t->cap * 2, sizeof(TableEntry)), t->cap * 2,
                         0};
    if (bigger.slots == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        TableEntry *e = &t->slots[i];
        if (e->data != NULL) {
            *table_find(&bigger, e->data, e->len, e->hash) = *e;
            bigger.used++;
        }
    }
    PyMem_RawFree(t->slots);
    *t = bigger;
    return 0;
}

static int
table_add(BytesTable *t, TableEntry *slot, const char *p, Py_ssize_t n, uint64_t h,
          long long code)
{
    /* table_put, with MemoryError set when it fails (the GIL held) */
    if (table_put(t, slot, p, n, h, code) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A string's code in a chunk's own list of distinct strings, found by its raw bytes;
 * no Python object is made while scanning (the GIL may be let go): each new string's
 * bytes (in the scanned buffer) are kept in order, and raw_strings makes them str. */
typedef struct {
    BytesTable table;
    const char **first; /* the new strings' bytes, by code */
    Py_ssize_t *len;
    Py_ssize_t count, cap;
    const char *last;
    Py_ssize_t last_len;
    int32_t last_code;
} RawEncoder;

static Py_ssize_t
raw_new(RawEncoder *e, TableEntry *slot, const char *p, Py_ssize_t n, uint64_t h)
{
    /* the next code, for these bytes (not in the table: slot is where they go); -1 when
     * memory runs out (no exception set: callable without the GIL) */
    if (e->count == e->cap) {
        Py_ssize_t bigger = e->cap ? e->cap * 2 : 64;
        const char **first = PyMem_RawRealloc(e->first, (size_t)bigger * sizeof(char *));
        if (first == NULL) {
            return -1;
        }
        e->first = first;
        Py_ssize_t *len = PyMem_RawRealloc(e->len, (size_t)bigger * sizeof(Py_ssize_t));
        if (len == NULL) {
            return -1;
        }
        e->len = len;
        e->cap = bigger;
    }
    Py_ssize_t code = e->count++;
    e->first[code] = p;
    e->len[code] = n;
    return table_put(&e->table, slot, p, n, h, code) < 0 ? -1 : code;
}

static int
raw_code(RawEncoder *e, const char *p, Py_ssize_t n, int32_t *out)
{
    /* -1 when memory runs out (no exception set: callable without the GIL) */
    if (e->last != NULL && n == e->last_len && memcmp(p, e->last, n) == 0) {
        *out = e->last_code;
        return 0;
    }
    uint64_t h = bytes_hash(p, n);
    TableEntry *slot = table_find(&e->table, p, n, h);
    if (slot->data == NULL) {
        if (e->count >= INT32_MAX || raw_new(e, slot, p, n, h) < 0) {
            return -1;
        }
        slot = table_find(&e->table, p, n, h);
    }
    e->last = slot->data;
    e->last_len = n;
    e->last_code = (int32_t)slot->code;
    *out = (int32_t)slot->code;
    return 0;
}

static PyObject *
raw_strings(const RawEncoder *e)
{
    /* the encoder's strings as a list of str, by code (each valid UTF-8: checked) */
    PyObject *out = PyList_New(e->count);
    for (Py_ssize_t i = 0; out != NULL && i < e->count; i++) {
        PyObject *str = PyUnicode_DecodeUTF8(e->first[i], e->len[i], "strict");
        if (str == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, str);
    }
    return out;
}

static void
raw_free(RawEncoder *e)
{
    table_free(&e->table);
    PyMem_RawFree(e->first);
    PyMem_RawFree(e->len);
}

/* --- strict JSON, as msgspec reads it; 0 from any of these sends the line back --- */

static const char *
skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t')) {
        p++;
    }
    return p;
}

static int
utf8_valid(const unsigned char *p, const unsigned char *end, const unsigned char **next)
{
    /* one well-formed UTF-8 sequence of two to four bytes (no surrogates, no overlong) */
    unsigned c = p[0];
    int n;
    unsigned min, v;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 1, min = 0x80, v = c & 0x1F;
    }
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 2, min = 0x800, v = c & 0x0F;
    }
    else if (c >= 0xF0 && c <= 0xF4) {
        n = 3, min = 0x10000, v = c & 0x07;
    }
    else {
        return 0;
    }
    if (end - p <= n) {
        return 0;
    }
    for (int i = 1; i <= n; i++) {
        if ((p[i] & 0xC0) != 0x80) {
            return 0;
        }
        v = (v << 6) | (p[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        return 0;
    }
    *next = p + n + 1;
    return 1;
}

/* the bytes a JSON string's fast loop stops at: '"', '\\', control characters, non-ASCII */
static unsigned char string_stop[256];
/* each hex digit's value, -1 for any other byte */
static signed char hex_value[256];

static void
scan_tables_init(void)
{
    for (int c = 0; c < 256; c++) {
        string_stop[c] = c < 0x20 || c == '"' || c == '\\' || c >= 0x80;
        hex_value[c] = (signed char)(c >= '0' && c <= '9'   ? c - '0'
                                     : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                     : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                            : -1);
    }
}

static const char *
scan_string(const char *p, const char *end, int escapes)
{
    /* p after the opening quote; returns the closing quote, or NULL. Escapes are taken
     * only when escapes is set (and then no escaped surrogate); control characters and
     * malformed UTF-8 never. */
    const unsigned char *q = (const unsigned char *)p, *e = (const unsigned char *)end;
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    for (;;) {
        /* eight plain bytes at a time: none below 0x20 or above 0x7f, no '"' or '\\' */
        while (e - q >= 8) {
            uint64_t w;
            memcpy(&w, q, 8);
            uint64_t quote = w ^ (ones * '"'), slash = w ^ (ones * '\\');
            uint64_t stop = ((w - ones * 0x20) | ((quote - ones) & ~quote) |
                             ((slash - ones) & ~slash) | w) & highs;
            if (stop) { /* the lowest flagged byte is a true stop: no borrow reaches it */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                q += __builtin_ctzll(stop) >> 3;
#endif
                break;
            }
            q += 8;
        }
        while (q < e && !string_stop[*q]) {
            q++;
        }
        if (q >= e) {
            return NULL;
        }
        unsigned c = *q;
        if (c == '"') {
            return (const char *)q;
        }
        if (c < 0x20) {
            return NULL;
        }
        if (c == '\\') {
            if (!escapes || e - q < 2) {
                return NULL;
            }
            c = q[1];
            if (c == 'u') {
                if (e - q < 6) {
                    return NULL;
                }
                unsigned v = 0;
                for (int i = 2; i < 6; i++) {
                    int d = hex_value[q[i]];
                    if (d < 0) {
                        return NULL;
                    }
                    v = (v << 4) | (unsigned)d;
                }
                if (v >= 0xD800 && v <= 0xDFFF) {
                    return NULL;
                }
                q += 6;
                continue;
            }
            if (c == 0 || !strchr("\"\\/bfnrt", (int)c)) {
                return NULL;
            }
            q += 2;
            continue;
        }
        if (!utf8_valid(q, e, &q)) { /* c >= 0x80 */
            return NULL;
        }
    }
}

static const char *
scan_number(const char *p, const char *end, int *is_int)
{
    /* a JSON number at p: where it ends, or NULL */
    const char *q = p;
    *is_int = 1;
    if (q < end && *q == '-') {
        q++;
    }
    if (q >= end) {
        return NULL;
    }
    if (*q == '0') {
        q++;
    }
    else if (*q >= '1' && *q <= '9') {
        while (q < end && *q >= '0' && *q <= '9') {
            q++;
        }
    }
    else {
        return NULL;
    }
    if (q < end && *q == '.') {
        *is_int = 0;
        q++;
        const char *digits = q;
        while (q < end && *q >= '0' && *q <= '9') {
            q++;
        }
        if (q == digits) {
            return NULL;
        }
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        *is_int = 0;
        q++;
        if (q < end && (*q == '+' || *q == '-')) {
            q++;
        }
        const char *digits = q;
        while (q < end && *q >= '0' && *q <= '9') {
            q++;
        }
        if (q == digits) {
            return NULL;
        }
    }
    return q;
}

static const char *
scan_value(const char *p, const char *end, int depth)
{
    /* any valid JSON value at p (spaces and tabs between tokens): where it ends, or NULL */
    if (p >= end || depth > 64) {
        return NULL;
    }
    int is_int;
    switch (*p) {
    case '"': {
        const char *q = scan_string(p + 1, end, 1);
        return q == NULL ? NULL : q + 1;
    }
    case '{':
    case '[': {
        char close = *p == '{' ? '}' : ']';
        p = skip_ws(p + 1, end);
        if (p < end && *p == close) {
            return p + 1;
        }
        for (;;) {
            if (close == '}') {
                if (p >= end || *p != '"') {
                    return NULL;
                }
                p = scan_string(p + 1, end, 1);
                if (p == NULL) {
                    return NULL;
                }
                p = skip_ws(p + 1, end);
                if (p >= end || *p != ':') {
                    return NULL;
                }
                p = skip_ws(p + 1, end);
            }
            p = scan_value(p, end, depth + 1);
            if (p == NULL) {
                return NULL;
            }
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            if (p < end && *p == close) {
                return p + 1;
            }
            return NULL;
        }
    }
    case 't':
        return end - p >= 4 && memcmp(p, "true", 4) == 0 ? p + 4 : NULL;
    case 'f':
        return end - p >= 5 && memcmp(p, "false", 5) == 0 ? p + 5 : NULL;
    case 'n':
        return end - p >= 4 && memcmp(p, "null", 4) == 0 ? p + 4 : NULL;
    default:
        return scan_number(p, end, &is_int);
    }
}

/* The thread state that scan_events let go of while it scans without the GIL (NULL
 * while the GIL is held): scan_double takes the GIL back through it for a number that
 * needs PyOS_string_to_double. One per thread, as each scan runs on one thread. */
static _Thread_local PyThreadState *scan_released = NULL;

static const double exact_pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static const char *
scan_double(const char *p, const char *end, double *out)
{
    /* a finite JSON number as a correctly rounded double, or NULL */
    const char *r = p;
    int negative = r < end && *r == '-';
    r += negative;
    unsigned long long m = 0; /* wraps past 19 digits, which take the slow path */
    int digits = 0, fraction = 0;
    if (r < end && *r == '0') {
        r++;
        digits = 1;
    }
    else {
        while (r < end && (unsigned)(*r - '0') < 10) {
            m = m * 10 + (unsigned long long)(*r++ - '0');
            digits++;
        }
        if (digits == 0) {
            return NULL;
        }
    }
    if (r < end && *r == '.') {
        const char *first = ++r;
        while (r < end && (unsigned)(*r - '0') < 10) {
            m = m * 10 + (unsigned long long)(*r++ - '0');
        }
        fraction = (int)(r - first);
        if (fraction == 0) {
            return NULL;
        }
        digits += fraction;
    }
    int exponent = r < end && (*r == 'e' || *r == 'E');
    if (!exponent && digits <= 15) { /* m < 2**53 and 10**fraction exact: one rounding */
        double v = (double)m;
        if (fraction > 0) {
            v /= exact_pow10[fraction];
        }
        /* an integer is read as an int and then made a float, as msgspec does: "-0" is 0.0 */
        *out = negative && (fraction > 0 || m != 0) ? -v : v;
        return r;
    }
    int is_int;
    const char *q = scan_number(p, end, &is_int);
    if (q == NULL) {
        return NULL;
    }
    char text[64];
    if (q - p >= (Py_ssize_t)sizeof(text)) {
        return NULL;
    }
    memcpy(text, p, (size_t)(q - p));
    text[q - p] = '\0';
    char *stop = NULL;
    PyThreadState *released = scan_released;
    if (released != NULL) { /* a scan without the GIL: taken back for this rare number */
        PyEval_RestoreThread(released);
    }
    double v = PyOS_string_to_double(text, &stop, NULL); /* no Python code runs */
    int failed = v == -1.0 && PyErr_Occurred();
    if (failed) {
        PyErr_Clear();
    }
    if (released != NULL) {
        scan_released = PyEval_SaveThread();
    }
    if (failed) {
        return NULL;
    }
    if (stop != text + (q - p) || !isfinite(v)) {
        return NULL;
    }
    *out = v;
    return q;
}

static const char *
scan_int(const char *p, const char *end, long long *out)
{
    /* a JSON integer of at most 18 digits, or NULL */
    const char *r = p;
    int negative = r < end && *r == '-';
    r += negative;
    const char *first = r;
    long long v = 0;
    while (r < end && (unsigned)(*r - '0') < 10 && r - first < 18) { /* < 10**18 */
        v = v * 10 + (*r++ - '0');
    }
    Py_ssize_t digits = r - first;
    if (digits == 0 || (digits > 1 && *first == '0')) {
        return NULL;
    }
    if (r < end && ((unsigned)(*r - '0') < 10 || *r == '.' || *r == 'e' || *r == 'E')) {
        return NULL; /* more digits, or a float (which msgspec refuses for an int field) */
    }
    *out = negative ? -v : v;
    return r;
}

static const char *
scan_hex16(const char *p, const char *end, unsigned long long *out)
{
    /* "16 hex digits" (either case), or NULL */
    if (end - p < 18 || p[0] != '"' || p[17] != '"') {
        return NULL;
    }
    const unsigned char *h = (const unsigned char *)p + 1;
    int bad = 0;
    unsigned long long v = 0;
#define HEX4(i)                                                                            \
    do {                                                                                   \
        int d0 = hex_value[h[i]], d1 = hex_value[h[i + 1]], d2 = hex_value[h[i + 2]],      \
            d3 = hex_value[h[i + 3]];                                                      \
        bad |= d0 | d1 | d2 | d3;                                                          \
        v = (v << 16) | (unsigned long long)(((d0 & 15) << 12) | ((d1 & 15) << 8) |        \
                                             ((d2 & 15) << 4) | (d3 & 15));                \
    } while (0)
    HEX4(0);
    HEX4(4);
    HEX4(8);
    HEX4(12);
#undef HEX4
    if (bad < 0) {
        return NULL;
    }
    *out = v;
    return p + 18;
}

typedef struct {
    const char *name, *status, *attrs;
    Py_ssize_t name_len, status_len, attrs_len;
    double ts, dur;
    long long pid, tid;
    unsigned long long sid, par;
    int attrs_hashed; /* attrs_hash is the hash of the attrs (of attrs_len bytes) */
    uint64_t attrs_hash;
    TableEntry *attrs_seen; /* the same attrs seen before in this call, or NULL */
} ScannedEvent;

enum {
    SK_PH = 1,
    SK_NAME = 2,
    SK_PID = 4,
    SK_TID = 8,
    SK_TS = 16,
    SK_DUR = 32,
    SK_SID = 64,
    SK_PAR = 128,
    SK_STATUS = 256,
    SK_ATTRS = 512,
    SK_OTHER = 1024,
    SK_ARGS = 2048,
};
#define SK_REQUIRED 511

#define KEY_IS(literal) (end - p >= (Py_ssize_t)sizeof(literal) - 1 && \
                       memcmp(p, literal, sizeof(literal) - 1) == 0 && \
                       (*next = p + sizeof(literal) - 1))

static int
known_key(const char *p, const char *end, const char **next)
{
    /* the field of the "key": at p when it is one of ours (*next after the colon), or 0
     * (memcmp of a constant length: inlined) */
    switch (end - p >= 2 ? p[1] : 0) {
    case 'p':
        return KEY_IS("\"ph\":")          ? SK_PH
               : KEY_IS("\"pid\":")       ? SK_PID
               : KEY_IS("\"parent_id\":") ? SK_PAR
                                          : 0;
    case 'n':
        return KEY_IS("\"name\":") ? SK_NAME : 0;
    case 't':
        return KEY_IS("\"tid\":") ? SK_TID : KEY_IS("\"ts\":") ? SK_TS : 0;
    case 'd':
        return KEY_IS("\"dur\":") ? SK_DUR : 0;
    case 's':
        return KEY_IS("\"span_id\":") ? SK_SID : KEY_IS("\"status\":") ? SK_STATUS : 0;
    case 'a':
        return KEY_IS("\"attrs\":") ? SK_ATTRS : KEY_IS("\"args\":") ? SK_ARGS : 0;
    case 'c':
        return KEY_IS("\"cat\":") ? SK_OTHER : 0; /* a key we skip, found fast */
    default:
        return 0;
    }
}
#undef KEY_IS

static const char *
scan_attrs(const char *p, const char *end, ScannedEvent *ev, BytesTable *seen)
{
    /* the raw attrs value at p: where it ends, or NULL. ppetrace writes attrs last, so
     * its line ends with "}},": the bytes up to there, when they are attrs met before in
     * this call (a valid JSON value, which a parse from p takes whole), are not checked
     * again. */
    const char *tail = end;
    ev->attrs = p;
    ev->attrs_hashed = 0;
    ev->attrs_seen = NULL;
    while (tail > p && (tail[-1] == ' ' || tail[-1] == '\t' || tail[-1] == '\r')) {
        tail--;
    }
    if (tail - p >= 3 && tail[-1] == ',' && tail[-2] == '}') {
        Py_ssize_t n = tail - 2 - p;
        ev->attrs_hash = bytes_hash(p, n);
        ev->attrs_hashed = 1;
        ev->attrs_len = n;
        TableEntry *e = table_find(seen, p, n, ev->attrs_hash);
        if (e->data != NULL) {
            ev->attrs_seen = e;
            return p + n;
        }
    }
    const char *q = scan_value(p, end, 0);
    if (q == NULL) {
        return NULL;
    }
    if (ev->attrs_hashed && q - p != ev->attrs_len) {
        ev->attrs_hashed = 0;
    }
    ev->attrs_len = q - p;
    return q;
}

static const char *
scan_event(const char *p, const char *end, ScannedEvent *ev, BytesTable *seen_attrs)
{
    /* the X event of the line at p ('{'), up to and including its ",": where the event
     * ends, or NULL when the line is not one that this scanner takes */
    int seen = 0;
    ev->attrs_hashed = 0;
    ev->attrs_seen = NULL;
    p++;
    for (;;) {
        if (p >= end || *p != '"') {
            return NULL;
        }
        const char *q;
        int field = known_key(p, end, &q);
        if (field == 0) { /* another key: any string without escapes */
            q = scan_string(p + 1, end, 0);
            if (q == NULL || q + 1 >= end || q[1] != ':') {
                return NULL;
            }
            field = SK_OTHER;
            q += 2;
        }
        p = q;
        if (p >= end) {
            return NULL;
        }
        if (field == SK_ARGS) {
            return NULL; /* an error's args: the Python path */
        }
        if (field != SK_OTHER && (seen & field)) {
            return NULL; /* a key twice */
        }
        seen |= field;
        switch (field) {
        case SK_PH:
            if (end - p < 4 || memcmp(p, "\"X\"", 3) != 0) {
                return NULL;
            }
            p += 3;
            break;
        case SK_NAME:
        case SK_STATUS:
            if (*p != '"' || (q = scan_string(p + 1, end, 0)) == NULL) {
                return NULL;
            }
            if (field == SK_NAME) {
                ev->name = p + 1, ev->name_len = q - p - 1;
            }
            else {
                ev->status = p + 1, ev->status_len = q - p - 1;
            }
            p = q + 1;
            break;
        case SK_PID:
            p = scan_int(p, end, &ev->pid);
            break;
        case SK_TID:
            p = scan_int(p, end, &ev->tid);
            break;
        case SK_TS:
            p = scan_double(p, end, &ev->ts);
            break;
        case SK_DUR:
            p = scan_double(p, end, &ev->dur);
            break;
        case SK_SID:
            p = scan_hex16(p, end, &ev->sid);
            break;
        case SK_PAR:
            p = scan_hex16(p, end, &ev->par);
            break;
        case SK_ATTRS:
            p = scan_attrs(p, end, ev, seen_attrs);
            break;
        default:
            p = scan_value(p, end, 0);
        }
        if (p == NULL || p >= end) {
            return NULL;
        }
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p != '}') {
            return NULL;
        }
        p++;
        break;
    }
    if ((seen & SK_REQUIRED) != SK_REQUIRED || p >= end || *p != ',') {
        return NULL;
    }
    if (!(seen & SK_ATTRS)) {
        ev->attrs = p, ev->attrs_len = 0; /* no attrs: the empty raw value */
        ev->attrs_hashed = 0;
    }
    return p + 1;
}

static int
attr_code(RawEncoder *e, const ScannedEvent *ev, long long *out)
{
    /* the event's raw attrs' code among the distinct attrs of this call (added when
     * new); -1 when memory runs out (no exception set: callable without the GIL) */
    if (ev->attrs_seen != NULL) {
        *out = ev->attrs_seen->code;
        return 0;
    }
    const char *p = ev->attrs;
    Py_ssize_t n = ev->attrs_len;
    uint64_t h = ev->attrs_hashed ? ev->attrs_hash : bytes_hash(p, n);
    TableEntry *slot = table_find(&e->table, p, n, h);
    if (slot->data == NULL) {
        Py_ssize_t code = raw_new(e, slot, p, n, h);
        *out = code;
        return code < 0 ? -1 : 0;
    }
    *out = slot->code;
    return 0;
}

/* The call's distinct attrs objects taken apart by key (attr_split's work, done here
 * without the GIL and without a bytes object per distinct object): for each key (in
 * order of first appearance), its distinct raw values and, per distinct attrs object,
 * the code of its value (-1 where the object lacks the key). Everything points into
 * the scanned buffer, which the call holds. */
#define SPLIT_SLOTS 16 /* the keys at the first positions of the previous object */

typedef struct {
    const char *name; /* the key's bytes, in the buffer */
    Py_ssize_t name_len;
    RawEncoder values;
    int32_t *codes; /* per distinct attrs object */
    Py_ssize_t last_item;
} ScanKey;

typedef struct {
    ScanKey *keys;
    Py_ssize_t count, cap;
    BytesTable table; /* key bytes -> index into keys */
} ScanSplit;

static int
raw_table_init(BytesTable *t)
{
    /* table_init without the GIL: -1 with no exception set */
    t->cap = 64;
    t->used = 0;
    t->slots = PyMem_RawCalloc((size_t)t->cap, sizeof(TableEntry));
    return t->slots == NULL ? -1 : 0;
}

static void
scan_split_free(ScanSplit *s)
{
    for (Py_ssize_t k = 0; k < s->count; k++) {
        raw_free(&s->keys[k].values);
        PyMem_RawFree(s->keys[k].codes);
    }
    PyMem_RawFree(s->keys);
    table_free(&s->table);
    memset(s, 0, sizeof(*s));
}

static Py_ssize_t
scan_split_key(ScanSplit *s, const char *key, Py_ssize_t klen, Py_ssize_t items)
{
    /* the index of the key's column, added when new; -1 when memory runs out */
    uint64_t h = bytes_hash(key, klen);
    TableEntry *slot = table_find(&s->table, key, klen, h);
    if (slot->data != NULL) {
        return (Py_ssize_t)slot->code;
    }
    if (s->count == s->cap) {
        Py_ssize_t bigger = s->cap ? s->cap * 2 : 16;
        ScanKey *grown = PyMem_RawRealloc(s->keys, (size_t)bigger * sizeof(ScanKey));
        if (grown == NULL) {
            return -1;
        }
        s->keys = grown, s->cap = bigger;
    }
    ScanKey *k = &s->keys[s->count];
    memset(k, 0, sizeof(*k));
    k->name = key;
    k->name_len = klen;
    k->last_item = -1;
    k->codes = PyMem_RawMalloc((size_t)(items ? items : 1) * sizeof(int32_t));
    if (k->codes == NULL || raw_table_init(&k->values.table) < 0) {
        PyMem_RawFree(k->codes);
        table_free(&k->values.table);
        return -1;
    }
    memset(k->codes, 0xFF, (size_t)items * sizeof(int32_t)); /* -1: without the key */
    s->count++;
    return table_put(&s->table, slot, key, klen, h, s->count - 1) < 0 ? -1 : s->count - 1;
}

static int
scan_split(const RawEncoder *attrs, ScanSplit *s)
{
    /* 1 when every distinct attrs object was taken apart; 0 when one has a key with an
     * escape, or a key twice (attr_split declines the same: the caller keeps the objects
     * whole); -1 when memory runs out. No exception is set: callable without the GIL.
     * The objects are valid JSON values (scan_attrs checked them). */
    Py_ssize_t n = attrs->count;
    if (raw_table_init(&s->table) < 0) {
        return -1;
    }
    Py_ssize_t at_slot[SPLIT_SLOTS];
    for (int j = 0; j < SPLIT_SLOTS; j++) {
        at_slot[j] = -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *p = attrs->first[i], *end = p + attrs->len[i];
        if (p == end || *p != '{') {
            continue; /* no attrs, or a value that is no object: no keys */
        }
        p = skip_ws(p + 1, end);
        if (p < end && *p == '}') {
            continue;
        }
        for (int member = 0;; member++) {
            const char *q;
            if (p >= end || *p != '"' || (q = scan_string(p + 1, end, 0)) == NULL) {
                return 0;
            }
            const char *key = p + 1;
            Py_ssize_t klen = q - key;
            p = skip_ws(q + 1, end);
            if (p >= end || *p != ':') {
                return 0;
            }
            const char *value = skip_ws(p + 1, end);
            p = scan_value(value, end, 0);
            if (p == NULL) {
                return 0;
            }
            Py_ssize_t kc = -1;
            if (member < SPLIT_SLOTS && at_slot[member] >= 0) {
                ScanKey *guess = &s->keys[at_slot[member]];
                if (guess->name_len == klen && memcmp(guess->name, key, (size_t)klen) == 0) {
                    kc = at_slot[member];
                }
            }
            if (kc < 0 && (kc = scan_split_key(s, key, klen, n)) < 0) {
                return -1;
            }
            if (member < SPLIT_SLOTS) {
                at_slot[member] = kc;
            }
            ScanKey *k = &s->keys[kc];
            if (k->last_item == i) {
                return 0; /* a key twice in one object */
            }
            k->last_item = i;
            if (k->values.count >= INT32_MAX ||
                raw_code(&k->values, value, p - value, &k->codes[i]) < 0) {
                return -1;
            }
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            if (p >= end || *p != '}') {
                return 0;
            }
            break;
        }
    }
    return 1;
}

static PyObject *
raw_bytes(const RawEncoder *e)
{
    /* the encoder's raw values as a list of bytes, by code */
    PyObject *out = PyList_New(e->count);
    for (Py_ssize_t i = 0; out != NULL && i < e->count; i++) {
        PyObject *raw = PyBytes_FromStringAndSize(e->first[i], e->len[i]);
        if (raw == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, raw);
    }
    return out;
}

static int
raw_small_int(const char *p, Py_ssize_t n, long long *out)
{
    /* 1 when the raw JSON value (valid: scan_value took it) is an integer of at most 18
     * digits (so it fits int64), its value in *out; 0 otherwise */
    Py_ssize_t i = n > 0 && p[0] == '-';
    if (i >= n || n - i > 18) {
        return 0;
    }
    long long v = 0;
    for (; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') {
            return 0;
        }
        v = v * 10 + (p[i] - '0');
    }
    *out = p[0] == '-' ? -v : v;
    return 1;
}

static PyObject *
raw_values(const RawEncoder *e)
{
    /* the encoder's raw values by code: as int64 bytes (a bytearray) when every one is
     * a small JSON integer (what they decode to, exactly), else as a list of bytes */
    PyObject *ints = PyByteArray_FromStringAndSize(NULL, e->count * (Py_ssize_t)8);
    if (ints == NULL) {
        return NULL;
    }
    long long *v = (long long *)PyByteArray_AS_STRING(ints);
    for (Py_ssize_t i = 0; i < e->count; i++) {
        if (!raw_small_int(e->first[i], e->len[i], &v[i])) {
            Py_DECREF(ints);
            return raw_bytes(e);
        }
    }
    return ints;
}

static PyObject *
scan_split_result(const ScanSplit *s, Py_ssize_t items)
{
    /* (keys: list of str, values: per key, its raw values (raw_values: int64 bytes, or a
     * list of bytes), codes: list of bytearrays of int32, one per distinct attrs object) */
    PyObject *keys = PyList_New(s->count), *values = PyList_New(s->count);
    PyObject *codes = PyList_New(s->count), *result = NULL;
    if (keys == NULL || values == NULL || codes == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < s->count; k++) {
        const ScanKey *key = &s->keys[k];
        PyObject *name = PyUnicode_DecodeUTF8(key->name, key->name_len, "strict");
        if (name == NULL) {
            goto done;
        }
        PyList_SET_ITEM(keys, k, name);
        PyObject *raws = raw_values(&key->values);
        if (raws == NULL) {
            goto done;
        }
        PyList_SET_ITEM(values, k, raws);
        PyObject *c = PyByteArray_FromStringAndSize((const char *)key->codes,
                                                    items * (Py_ssize_t)sizeof(int32_t));
        if (c == NULL) {
            goto done;
        }
        PyList_SET_ITEM(codes, k, c);
    }
    result = PyTuple_Pack(3, keys, values, codes);
done:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(codes);
    return result;
}

#define SCAN_RELEASE_BYTES (1 << 16) /* a scan of this many bytes lets go of the GIL */

static PyObject *
scan_events(PyObject *module, PyObject *args)
{
    PyObject *source;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn:scan_events", &source, &start, &stop)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *others = NULL;
    PyObject *arrays[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *codes[2] = {NULL, NULL}, *coded[2] = {NULL, NULL}, *uniques[2] = {NULL, NULL};
    PyObject *attr_info = NULL;
    RawEncoder enc[2], attrs_enc;
    ScanSplit split;
    int split_ok = 0;
    memset(enc, 0, sizeof(enc));
    memset(&attrs_enc, 0, sizeof(attrs_enc));
    memset(&split, 0, sizeof(split));
    Py_ssize_t *spans = NULL, n_spans = 0, cap_spans = 0;
    if (start < 0 || stop > view.len || start > stop) {
        PyErr_SetString(PyExc_ValueError, "Expected 0 <= start <= end <= len(buffer).");
        goto done;
    }
    const char *base = view.buf, *p = base + start, *end = base + stop;
    Py_ssize_t lines = 1;
    for (const char *q = p; (q = memchr(q, '\n', (size_t)(end - q))) != NULL; q++) {
        lines++;
    }
    if (lines > PY_SSIZE_T_MAX / 8) {
        PyErr_NoMemory();
        goto done;
    }
    for (int c = 0; c < 7; c++) {
        arrays[c] = PyByteArray_FromStringAndSize(NULL, lines * 8);
        if (arrays[c] == NULL) {
            goto done;
        }
    }
    for (int c = 0; c < 2; c++) {
        codes[c] = PyByteArray_FromStringAndSize(NULL, lines * 4);
        if (codes[c] == NULL || table_init(&enc[c].table) < 0) {
            goto done;
        }
    }
    if (table_init(&attrs_enc.table) < 0) {
        goto done;
    }
    double *ts = (double *)PyByteArray_AS_STRING(arrays[0]);
    double *dur = (double *)PyByteArray_AS_STRING(arrays[1]);
    long long *pid = (long long *)PyByteArray_AS_STRING(arrays[2]);
    long long *tid = (long long *)PyByteArray_AS_STRING(arrays[3]);
    unsigned long long *sid = (unsigned long long *)PyByteArray_AS_STRING(arrays[4]);
    unsigned long long *par = (unsigned long long *)PyByteArray_AS_STRING(arrays[5]);
    long long *attr = (long long *)PyByteArray_AS_STRING(arrays[6]);
    int32_t *name_codes = (int32_t *)PyByteArray_AS_STRING(codes[0]);
    int32_t *status_codes = (int32_t *)PyByteArray_AS_STRING(codes[1]);
    Py_ssize_t n = 0;
    int nomem = 0;
    /* the scan touches no Python object: the buffer is exported (it cannot change size
     * or go away), the arrays are this call's own, and the tables are C memory that
     * points into the buffer; so a large one runs without the GIL */
    if (stop - start >= SCAN_RELEASE_BYTES) {
        scan_released = PyEval_SaveThread();
    }
    while (p < end) {
        if (*p == '\n' || *p == ' ' || *p == '\t' || *p == '\r') {
            p++;
            continue;
        }
        const char *line_end = memchr(p, '\n', (size_t)(end - p));
        if (line_end == NULL) {
            line_end = end;
        }
        ScannedEvent ev;
        const char *q = *p == '{' ? scan_event(p, line_end, &ev, &attrs_enc.table) : NULL;
        if (q != NULL) {
            q = skip_ws(q, line_end);
            while (q < line_end && *q == '\r') {
                q = skip_ws(q + 1, line_end);
            }
        }
        if (q == NULL || q != line_end) { /* not taken here: the caller decodes it */
            if (n_spans + 2 > cap_spans) {
                Py_ssize_t bigger = cap_spans ? cap_spans * 2 : 64;
                Py_ssize_t *grown =
                    PyMem_RawRealloc(spans, (size_t)bigger * sizeof(Py_ssize_t));
                if (grown == NULL) {
                    nomem = 1;
                    break;
                }
                spans = grown, cap_spans = bigger;
            }
            spans[n_spans++] = p - base;
            spans[n_spans++] = line_end - base;
            p = line_end;
            continue;
        }
        ts[n] = ev.ts;
        dur[n] = ev.dur;
        pid[n] = ev.pid;
        tid[n] = ev.tid;
        sid[n] = ev.sid;
        par[n] = ev.par;
        if (raw_code(&enc[0], ev.name, ev.name_len, &name_codes[n]) < 0 ||
            raw_code(&enc[1], ev.status, ev.status_len, &status_codes[n]) < 0 ||
            attr_code(&attrs_enc, &ev, &attr[n]) < 0) {
            nomem = 1;
            break;
        }
        n++;
        p = line_end;
    }
    if (!nomem) {
        split_ok = scan_split(&attrs_enc, &split);
        nomem = split_ok < 0;
    }
    if (scan_released != NULL) {
        PyEval_RestoreThread(scan_released);
        scan_released = NULL;
    }
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    attr_info = split_ok ? scan_split_result(&split, attrs_enc.count) : raw_bytes(&attrs_enc);
    if (attr_info == NULL) {
        goto done;
    }
    for (int c = 0; c < 7; c++) {
        if (PyByteArray_Resize(arrays[c], n * 8) < 0) {
            goto done;
        }
    }
    for (int c = 0; c < 2; c++) {
        if (PyByteArray_Resize(codes[c], n * 4) < 0) {
            goto done;
        }
        uniques[c] = raw_strings(&enc[c]);
        if (uniques[c] == NULL) {
            goto done;
        }
        coded[c] = PyTuple_Pack(2, codes[c], uniques[c]);
        if (coded[c] == NULL) {
            goto done;
        }
    }
    others = PyList_New(n_spans);
    if (others == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_spans; i++) {
        PyObject *at = PyLong_FromSsize_t(spans[i]);
        if (at == NULL) {
            goto done;
        }
        PyList_SET_ITEM(others, i, at);
    }
    result = PyTuple_Pack(11, coded[0], coded[1], arrays[0], arrays[1], arrays[2], arrays[3],
                          arrays[4], arrays[5], arrays[6], attr_info, others);
done:
    PyBuffer_Release(&view);
    for (int c = 0; c < 7; c++) {
        Py_XDECREF(arrays[c]);
    }
    for (int c = 0; c < 2; c++) {
        Py_XDECREF(codes[c]);
        Py_XDECREF(coded[c]);
        Py_XDECREF(uniques[c]);
        raw_free(&enc[c]);
    }
    raw_free(&attrs_enc);
    scan_split_free(&split);
    Py_XDECREF(attr_info);
    Py_XDECREF(others);
    PyMem_RawFree(spans);
    return result;
}

/* attr_split(items) -> (keys, codes, values), or None
 *
 * The distinct raw attrs of a trace (bytes: JSON objects, as scan_events and msgspec
 * keep them) taken apart by key, so that each distinct value of a key is decoded once
 * rather than each distinct object: keys[k] is a key (str, in order of first
 * appearance), codes[k] the int32 bytes, one per item, of its value among values[k]
 * (the distinct raw values of that key, bytes), -1 where the item lacks the key. An
 * item that is not a JSON object (b"" included) has no keys. None when an item is not
 * valid JSON as scan_events checks it, has a key with an escape, or has a key twice:
 * the caller then decodes the items whole (exporters/chrome/_events.py, the reference).
 *
 * The items are copied into a list that this call owns; nothing in the loop runs Python
 * code (it makes bytes, str and int objects, and appends to lists), and the tables point
 * only into bytes and str objects that lists owned here keep alive.
 */
typedef struct {
    BytesTable table; /* raw value -> code */
    PyObject *values; /* the distinct raw values */
    PyObject *codes;  /* bytearray: int32 per item */
    Py_ssize_t last_item;
    const char *name; /* the key's raw bytes (in an item that the call's copy holds) */
    Py_ssize_t name_len;
    const char *last; /* the last value taken (in a bytes object of values), its code */
    Py_ssize_t last_len;
    int32_t last_code;
} SplitKey;


static PyObject *
attr_split(PyObject *module, PyObject *arg)
{
    PyObject *items = copy_list(arg, "raw attributes"), *result = NULL, *key_list = NULL;
    SplitKey *keys = NULL;
    Py_ssize_t nkeys = 0, cap = 0;
    BytesTable key_table = {NULL, 0, 0};
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    key_list = PyList_New(0);
    if (key_list == NULL || table_init(&key_table) < 0 || n > PY_SSIZE_T_MAX / 4) {
        goto done;
    }
    Py_ssize_t at_slot[SPLIT_SLOTS];
    for (int j = 0; j < SPLIT_SLOTS; j++) {
        at_slot[j] = -1;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *item = PyList_GET_ITEM(items, i); /* held by our copy */
        if (!PyBytes_CheckExact(item)) {
            ok = 0;
            break;
        }
        const char *p = PyBytes_AS_STRING(item), *end = p + PyBytes_GET_SIZE(item);
        if (p == end) {
            continue;
        }
        if (*p != '{') {
            ok = scan_value(p, end, 0) == end;
            continue;
        }
        p = skip_ws(p + 1, end);
        if (p < end && *p == '}') {
            ok = p + 1 == end;
            continue;
        }
        int member = 0;
        for (;;) {
            const char *q;
            if (p >= end || *p != '"' || (q = scan_string(p + 1, end, 0)) == NULL) {
                ok = 0;
                break;
            }
            const char *key = p + 1;
            Py_ssize_t klen = q - key;
            p = skip_ws(q + 1, end);
            if (p >= end || *p != ':') {
                ok = 0;
                break;
            }
            const char *value = skip_ws(p + 1, end);
            p = scan_value(value, end, 0);
            if (p == NULL) {
                ok = 0;
                break;
            }
            Py_ssize_t vlen = p - value;
            /* the key's column: the one at this position in the previous object, or
             * through the table */
            Py_ssize_t kc = -1;
            if (member < SPLIT_SLOTS && at_slot[member] >= 0) {
                SplitKey *guess = &keys[at_slot[member]];
                if (guess->name_len == klen && memcmp(guess->name, key, (size_t)klen) == 0) {
                    kc = at_slot[member];
                }
            }
            uint64_t h = kc < 0 ? bytes_hash(key, klen) : 0;
            TableEntry *slot = kc < 0 ? table_find(&key_table, key, klen, h) : NULL;
            if (slot != NULL && slot->data != NULL) {
                kc = (Py_ssize_t)slot->code;
            }
            if (kc < 0) {
                if (nkeys == cap) {
                    Py_ssize_t bigger = cap ? cap * 2 : 16;
                    SplitKey *grown = PyMem_Realloc(keys, (size_t)bigger * sizeof(SplitKey));
                    if (grown == NULL) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    keys = grown, cap = bigger;
                }
                SplitKey *k = &keys[nkeys];
                memset(k, 0, sizeof(*k));
                nkeys++;
                k->last_item = -1;
                k->name = key;
                k->name_len = klen;
                k->values = PyList_New(0);
                k->codes = PyByteArray_FromStringAndSize(NULL, n * 4);
                if (k->values == NULL || k->codes == NULL || table_init(&k->table) < 0) {
                    goto done;
                }
                memset(PyByteArray_AS_STRING(k->codes), 0xFF, (size_t)(n * 4)); /* -1 */
                PyObject *name = PyUnicode_DecodeUTF8(key, klen, "strict"); /* checked */
                if (name == NULL) {
                    goto done;
                }
                int failed = PyList_Append(key_list, name);
                Py_DECREF(name);
                if (failed) {
                    goto done;
                }
                /* the table points into the item's bytes, which our copy keeps */
                if (table_add(&key_table, slot, key, klen, h, nkeys - 1) < 0) {
                    goto done;
                }
                kc = nkeys - 1;
            }
            if (member < SPLIT_SLOTS) {
                at_slot[member] = kc;
            }
            member++;
            SplitKey *k = &keys[kc];
            if (k->last_item == i) {
                ok = 0; /* a key twice in one object */
                break;
            }
            k->last_item = i;
            /* the value's code among the key's distinct values: the last one's, or
             * through the key's table */
            int32_t code;
            if (k->last != NULL && k->last_len == vlen && memcmp(k->last, value, (size_t)vlen) == 0) {
                code = k->last_code;
                memcpy(PyByteArray_AS_STRING(k->codes) + i * 4, &code, 4);
                goto next_member;
            }
            uint64_t vh = bytes_hash(value, vlen);
            TableEntry *vslot = table_find(&k->table, value, vlen, vh);
            if (vslot->data == NULL) {
                Py_ssize_t next = PyList_GET_SIZE(k->values);
                if (next >= INT32_MAX) {
                    PyErr_SetString(PyExc_OverflowError, "Too many distinct values to encode.");
                    goto done;
                }
                PyObject *raw = PyBytes_FromStringAndSize(value, vlen);
                if (raw == NULL) {
                    goto done;
                }
                int failed = PyList_Append(k->values, raw);
                Py_DECREF(raw); /* k->values holds it, and the table points into it */
                if (failed || table_add(&k->table, vslot, PyBytes_AS_STRING(raw), vlen, vh,
                                        next) < 0) {
                    goto done;
                }
                code = (int32_t)next;
                k->last = PyBytes_AS_STRING(raw);
            }
            else {
                code = (int32_t)vslot->code;
                k->last = vslot->data;
            }
            k->last_len = vlen;
            k->last_code = code;
            memcpy(PyByteArray_AS_STRING(k->codes) + i * 4, &code, 4);
        next_member:
            p = skip_ws(p, end);
            if (p < end && *p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            ok = p < end && *p == '}' && skip_ws(p + 1, end) == end;
            break;
        }
    }
    if (!ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *codes = PyList_New(nkeys), *values = PyList_New(nkeys);
    if (codes == NULL || values == NULL) {
        Py_XDECREF(codes);
        Py_XDECREF(values);
        goto done;
    }
    for (Py_ssize_t c = 0; c < nkeys; c++) {
        PyList_SET_ITEM(codes, c, Py_NewRef(keys[c].codes));
        PyList_SET_ITEM(values, c, Py_NewRef(keys[c].values));
    }
    result = PyTuple_Pack(3, key_list, codes, values);
    Py_DECREF(codes);
    Py_DECREF(values);
done:
    for (Py_ssize_t c = 0; c < nkeys; c++) {
        Py_XDECREF(keys[c].values);
        Py_XDECREF(keys[c].codes);
        table_free(&keys[c].table);
    }
    PyMem_Free(keys);
    table_free(&key_table);
    Py_XDECREF(key_list);
    Py_DECREF(items);
    return result;
}

/* parse_hooks(hooks) -> (entry_row, pos, total, own, count, malformed) | None
 *
 * The entries of each summarised step's ppetrace.hooks text (exporters/_aggregates.py:
 * _parse_entries is the twin and says the format): per entry present, its row, its
 * position in the row, total, self and count (int64 bytes each); per row, whether it
 * is malformed (bool bytes). The entries of a malformed row are left out (the caller
 * uses none of them). A text with a character other than digits, '-', ';' and '/'
 * (non-ASCII and '\n' included) is malformed. None when an item is not an exact str.
 * The loop makes no Python object but the outputs; the list is a private copy. */
static PyObject *
parse_hooks(PyObject *module, PyObject *arg)
{
    PyObject *items = copy_list(arg, "ppetrace.hooks texts"), *result = NULL;
    PyObject *cols[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t m = PyList_GET_SIZE(items), entries = 0;
    for (Py_ssize_t i = 0; i < m; i++) { /* an upper bound: one entry per ';', plus one */
        PyObject *h = PyList_GET_ITEM(items, i);
        if (!PyUnicode_CheckExact(h)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (PyUnicode_IS_ASCII(h)) {
            const char *t = (const char *)PyUnicode_DATA(h);
            Py_ssize_t n = PyUnicode_GET_LENGTH(h);
            entries += 1;
            for (const char *q = t; (q = memchr(q, ';', (size_t)(t + n - q))) != NULL; q++) {
                entries++;
            }
        }
    }
    if (entries > PY_SSIZE_T_MAX / 8) {
        PyErr_NoMemory();
        goto done;
    }
    for (int c = 0; c < 5; c++) {
        cols[c] = PyByteArray_FromStringAndSize(NULL, entries * 8);
        if (cols[c] == NULL) {
            goto done;
        }
    }
    cols[5] = PyByteArray_FromStringAndSize(NULL, m);
    if (cols[5] == NULL) {
        goto done;
    }
    long long *row_of = (long long *)PyByteArray_AS_STRING(cols[0]);
    long long *pos_of = (long long *)PyByteArray_AS_STRING(cols[1]);
    long long *total_of = (long long *)PyByteArray_AS_STRING(cols[2]);
    long long *own_of = (long long *)PyByteArray_AS_STRING(cols[3]);
    long long *count_of = (long long *)PyByteArray_AS_STRING(cols[4]);
    char *malformed = PyByteArray_AS_STRING(cols[5]);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *h = PyList_GET_ITEM(items, i);
        malformed[i] = 1;
        if (!PyUnicode_IS_ASCII(h)) {
            continue;
        }
        const char *p = (const char *)PyUnicode_DATA(h), *end = p + PyUnicode_GET_LENGTH(h);
        Py_ssize_t k0 = k, pos = 0;
        int bad = 0;
        for (;;) { /* an entry: up to ';' or the end */
            long long v[3] = {0, 0, 0};
            Py_ssize_t len0 = 0;
            int width = 0;
            for (;;) { /* a token: up to '/', ';' or the end */
                int neg = p < end && *p == '-';
                const char *d = p + neg, *q = d;
                long long x = 0;
                while (q < end && *q >= '0' && *q <= '9') {
                    if (q - d < 18) {
                        x = x * 10 + (*q - '0');
                    }
                    q++;
                }
                Py_ssize_t len = q - p, digits = q - d;
                if (q < end && *q != '/' && *q != ';') {
                    bad = 1; /* a '-' inside a number, or a character with no place here */
                    break;
                }
                if ((neg && digits == 0) || digits > 18) {
                    bad = 1;
                }
                if (width < 3) {
                    v[width] = neg ? -x : x;
                }
                if (width == 0) {
                    len0 = len;
                }
                width++;
                if (len == 0 && (width > 1 || (q < end && *q == '/'))) {
                    bad = 1; /* an empty number inside an entry */
                }
                p = q;
                if (p < end && *p == '/') {
                    p++;
                    continue;
                }
                break;
            }
            if (bad) {
                break;
            }
            if (width > 3) {
                bad = 1;
                break;
            }
            if (len0 > 0) { /* present */
                long long total = v[0], own = width > 1 ? v[1] : v[0];
                long long count = width > 2 ? v[2] : 1;
                if (count < 1 || total < 0) {
                    bad = 1;
                    break;
                }
                row_of[k] = i, pos_of[k] = pos, total_of[k] = total;
                own_of[k] = own, count_of[k] = count;
                k++;
            }
            pos++;
            if (p < end && *p == ';') {
                p++;
                continue;
            }
            break;
        }
        if (bad) {
            k = k0; /* none of a malformed row's entries */
            continue;
        }
        malformed[i] = 0;
    }
    for (int c = 0; c < 5; c++) {
        if (PyByteArray_Resize(cols[c], k * 8) < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(6, cols[0], cols[1], cols[2], cols[3], cols[4], cols[5]);
done:
    for (int c = 0; c < 6; c++) {
        Py_XDECREF(cols[c]);
    }
    Py_DECREF(items);
    return result;
}

static PyObject *
register_frozen_type(PyObject *module, PyObject *type)
{
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &PyDict_Type)) {
        PyErr_SetString(PyExc_TypeError, "Expected a dict subclass for the frozen mapping type.");
        return NULL;
    }
    Py_XSETREF(frozen_type, Py_NewRef(type));
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------
 * The detail filter's fold (exporters/chrome/_detail.py, DetailFilter._take_lane and
 * _close, with _entries: the pure-Python twin; exporters/chrome/_fold.py calls this).
 *
 * one_thread(rows) -> int | None
 *   The thread id of a list of rows that all have one thread id (an exact int within
 *   int64); None for any other.
 *
 * fold_lane(group, starts, cur, announce, lane, names, index, step_name, step_level,
 *           enclosing, max_held, base, hooks_key, row_type) -> tuple | None
 *   One thread's rows (group) taken as DetailFilter._take_lane takes them, for the
 *   common case; None, having changed nothing, for everything else (the loop then
 *   takes them): a group not in end order (the later start first at equal ends), a row that is not a tuple of 10 fields with an exact str
 *   name, exact int times within int64 and exact int ids within [0, 2**64), a hook
 *   row whose status is not an exact str, a step row whose attributes are not a dict
 *   (or FrozenAttributes) with exact str keys, a step whose row cannot come any more (the
 *   loop gives its rows back), an interval that would hold more than max_held rows, a
 *   duration or sum beyond int64. starts is a list of the published starts (exact ints
 *   within int64), cur None or (start, held rows, inner) of the open interval (not a
 *   full one), lane the object the summaries name, names/index the lane's names list
 *   and its index (only exact str keys), step_level/enclosing frozensets of exact str,
 *   base the length of the caller's output list, hooks_key the attribute that takes
 *   the aggregates, row_type the type of the rows made (SpanRow: a tuple subclass
 *   without a __dict__). Returns (rows, spots, popped, announce, nxt, folded, steps):
 *   the rows to write, in which each summarised step is the tuple (step row with
 *   {**attributes, hooks_key: hooks}, lane, count, announce), and spots their
 *   indices plus base; popped the published starts it used; nxt None or (start, rows, inner) of
 *   the interval left open; folded/steps the rows and steps folded. The new names of
 *   the steps' aggregates are appended to names and index (escaped in names) just
 *   before it returns.
 *
 * The rows are read from private copies of the lists (tuples: immutable), and every
 * name compared is an exact str looked up in dicts and frozensets whose keys are
 * exact str, so no call in the walk runs Python code but the allocation of result
 * objects (a collection may run finalizers): across those, only rows and names owned
 * by the private copies are held.
 * --------------------------------------------------------------------------------- */

enum { FK_HOOK = 0, FK_FULL = 1, FK_STEP = 2, FK_ENCLOSING = 3 };

typedef struct {
    PyObject *row;  /* owned by a private copy */
    PyObject *name; /* owned by the row */
    long long start, end;
    unsigned long long span, parent;
    int kind, error;
} FoldRow;

typedef struct {
    long long start, end;
    unsigned long long parent;
    long long dur;
} FoldInner;

typedef struct {
    unsigned long long key;
    long long sum;
    unsigned int stamp;
} ChildSlot;

typedef struct {
    long long total, own, count;
    unsigned int stamp; /* the step that touched it last (FoldState.astamp) */
} FoldAgg;

typedef struct {
    /* growable arrays */
    Py_ssize_t *held;
    Py_ssize_t nheld, capheld;
    FoldInner *inner;
    Py_ssize_t ninner, capinner;
    ChildSlot *children;
    Py_ssize_t capchildren; /* a power of two */
    unsigned int stamp;
    FoldAgg *agg; /* by name index; zeroed when it grows */
    Py_ssize_t capagg;
    unsigned int astamp;
    /* name -> its index in the names list, by address (names owned by the private
     * copies' rows; an index, once known, stays right for the whole call) */
    PyObject *iname[64];
    Py_ssize_t iat[64];
    Buf hooks; /* the ppetrace.hooks text being made, reused from step to step */
} FoldState;

static int
fold_grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size)
{
    if (need <= *cap) {
        return 0;
    }
    Py_ssize_t cap2 = *cap ? *cap : 16;
    while (cap2 < need) {
        if (cap2 > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)size) {
            PyErr_NoMemory();
            return -1;
        }
        cap2 *= 2;
    }
    void *q = PyMem_Realloc(*p, (size_t)cap2 * size);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    *cap = cap2;
    return 0;
}

static void
fold_state_free(FoldState *s)
{
    PyMem_Free(s->held);
    PyMem_Free(s->inner);
    PyMem_Free(s->children);
    PyMem_Free(s->agg);
    PyMem_Free(s->hooks.data);
}

/* an exact int within int64 / within [0, 2**64): 1, else 0 (no error left set) */
static int
fold_ll(PyObject *v, long long *out)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
    if (read_digits_ll(v, out)) {
        return 1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = x;
    return 1;
}

static int
fold_ull(PyObject *v, unsigned long long *out)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
    if (read_digits_ull(v, out)) {
        return 1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (!overflow) {
        if (x < 0) {
            return 0;
        }
        *out = (unsigned long long)x;
        return 1;
    }
    if (overflow < 0) {
        return 0;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = u;
    return 1;
}

/* whether every element of s is an exact str: a lookup then runs no Python code */
static int
fold_exact_set(PyObject *s)
{
    if (!PyFrozenSet_CheckExact(s)) {
        return 0;
    }
    /* iterating a frozenset runs no Python code */
    PyObject *it = PyObject_GetIter(s), *key;
    if (it == NULL) {
        PyErr_Clear();
        return 0;
    }
    int exact = 1;
    while (exact && (key = PyIter_Next(it)) != NULL) {
        exact = PyUnicode_CheckExact(key);
        Py_DECREF(key);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return exact;
}

/* the kinds of the names seen in one call, by address (the names are owned by the rows
 * of the private copies, alive for the whole call) */
#define FOLD_KIND_CACHE 64

/* the slot of name in an identity cache of cap slots (a power of two, zeroed at the start
 * of the call, never emptied during it): where name is, else the first empty slot of its
 * four probes, else its home slot, to overwrite. Without the probes, two of a step's few
 * names that shared a slot (about one call in three) evicted each other on every row. */
static inline size_t
fold_cache_slot(PyObject *name, PyObject *const *names, size_t cap)
{
    size_t home = address_home(name, cap);
    for (size_t k = 0; k < 4; k++) {
        size_t at = (home + k) & (cap - 1);
        if (names[at] == name || names[at] == NULL) {
            return at;
        }
    }
    return home;
}
typedef struct {
    PyObject *name[FOLD_KIND_CACHE];
    int kind[FOLD_KIND_CACHE];
} FoldKinds;

/* whether a step row's attributes can be copied and extended in C without running
 * Python code: a plain dict (or FrozenAttributes) with exact str keys */
static int
fold_plain_attrs(PyObject *attrs)
{
    if (!is_plain_dict(attrs)) {
        return 0;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) {
            return 0;
        }
    }
    return 1;
}

/* a row read into r: 1, 0 when the loop must take the batch, -1 on error */
static int
fold_read(PyObject *row, FoldRow *r, PyObject *step_name, PyObject *step_level,
          PyObject *enclosing, FoldKinds *kinds)
{
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 10) {
        return 0;
    }
    PyObject *name = PyTuple_GET_ITEM(row, 0);
    if (!PyUnicode_CheckExact(name) || !fold_ll(PyTuple_GET_ITEM(row, 4), &r->start) ||
        !fold_ll(PyTuple_GET_ITEM(row, 5), &r->end) ||
        !fold_ull(PyTuple_GET_ITEM(row, 1), &r->span) ||
        !fold_ull(PyTuple_GET_ITEM(row, 2), &r->parent)) {
        return 0;
    }
    r->row = row;
    r->name = name;
    size_t slot = fold_cache_slot(name, kinds->name, FOLD_KIND_CACHE);
    if (kinds->name[slot] == name) {
        r->kind = kinds->kind[slot];
    }
    else if (PyUnicode_Compare(name, step_name) == 0) { /* exact str: no Python code */
        r->kind = FK_STEP;
    }
    else if (PyErr_Occurred()) {
        return -1;
    }
    else {
        int in = PySet_Contains(enclosing, name);
        if (in < 0) {
            return -1;
        }
        if (in) {
            r->kind = FK_ENCLOSING;
        }
        else {
            in = PySet_Contains(step_level, name);
            if (in < 0) {
                return -1;
            }
            r->kind = in ? FK_FULL : FK_HOOK;
        }
    }
    kinds->name[slot] = name;
    kinds->kind[slot] = r->kind;
    if (r->kind == FK_STEP && !fold_plain_attrs(PyTuple_GET_ITEM(row, 7))) {
        return 0;
    }
    r->error = 0;
    if (r->kind == FK_HOOK) {
        PyObject *status = PyTuple_GET_ITEM(row, 8);
        if (!PyUnicode_CheckExact(status)) {
            return 0;
        }
        /* most rows are "UNSET": a compact ASCII status not starting with 'E' is not
         * "ERROR", without the comparison */
        r->error = !(PyUnicode_IS_COMPACT_ASCII(status) &&
                     (PyUnicode_GET_LENGTH(status) != 5 ||
                      PyUnicode_1BYTE_DATA(status)[0] != 'E')) &&
                   PyUnicode_CompareWithASCIIString(status, "ERROR") == 0;
    }
    return 1;
}

static int
fold_child_add(FoldState *s, unsigned long long key, long long dur, int *decline)
{
    Py_ssize_t mask = s->capchildren - 1;
    Py_ssize_t i = (Py_ssize_t)((key * 0x9E3779B97F4A7C15ULL) >> 20) & mask;
    while (s->children[i].stamp == s->stamp && s->children[i].key != key) {
        i = (i + 1) & mask;
    }
    ChildSlot *slot = &s->children[i];
    if (slot->stamp != s->stamp) {
        slot->stamp = s->stamp;
        slot->key = key;
        slot->sum = 0;
    }
    if (__builtin_add_overflow(slot->sum, dur, &slot->sum)) {
        *decline = 1;
        return -1;
    }
    return 0;
}

static long long
fold_child_get(FoldState *s, unsigned long long key)
{
    Py_ssize_t mask = s->capchildren - 1;
    Py_ssize_t i = (Py_ssize_t)((key * 0x9E3779B97F4A7C15ULL) >> 20) & mask;
    while (s->children[i].stamp == s->stamp) {
        if (s->children[i].key == key) {
            return s->children[i].sum;
        }
        i = (i + 1) & mask;
    }
    return 0;
}

static int
fold_children_reset(FoldState *s, Py_ssize_t keys)
{
    /* a table for up to keys parents, at most half full */
    Py_ssize_t need = 16;
    while (need < 2 * keys) {
        if (need > PY_SSIZE_T_MAX / 4 / (Py_ssize_t)sizeof(ChildSlot)) {
            PyErr_NoMemory();
            return -1;
        }
        need *= 2;
    }
    if (need > s->capchildren || s->stamp == UINT_MAX) {
        PyMem_Free(s->children);
        s->children = PyMem_Calloc((size_t)need, sizeof(ChildSlot));
        if (s->children == NULL) {
            s->capchildren = 0;
            PyErr_NoMemory();
            return -1;
        }
        s->capchildren = need;
        s->stamp = 0;
    }
    s->stamp++;
    return 0;
}

/* the index of a step's event name in the lane's names (index) or among the names new
 * in this call (added, in the order they came): -1 on error */
static Py_ssize_t
fold_name_index(PyObject *index, PyObject *added, Py_ssize_t base, PyObject *name,
                int *decline)
{
    PyObject *at = PyDict_GetItemWithError(index, name); /* exact str keys only */
    if (at == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (at == NULL) {
        at = PyDict_GetItemWithError(added, name);
        if (at == NULL && PyErr_Occurred()) {
            return -1;
        }
    }
    if (at != NULL) {
        if (!PyLong_CheckExact(at)) {
            *decline = 1;
            return -1;
        }
        Py_ssize_t i = PyLong_AsSsize_t(at); /* read before anything else runs */
        if (i < 0) {
            if (PyErr_Occurred()) {
                PyErr_Clear();
            }
            *decline = 1;
            return -1;
        }
        return i;
    }
    Py_ssize_t i = base + PyDict_GET_SIZE(added);
    PyObject *boxed = PyLong_FromSsize_t(i);
    if (boxed == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(added, name, boxed);
    Py_DECREF(boxed);
    return rc < 0 ? -1 : i;
}

static int
fold_entry(Buf *b, const FoldAgg *a)
{
    if (buf_add_ll(b, a->total) < 0) {
        return -1;
    }
    if (a->count != 1 || a->own != a->total) {
        if (buf_add(b, "/", 1) < 0 || buf_add_ll(b, a->own) < 0) {
            return -1;
        }
        if (a->count != 1 && (buf_add(b, "/", 1) < 0 || buf_add_ll(b, a->count) < 0)) {
            return -1;
        }
    }
    return 0;
}

/* The summary of the interval closed by the step row at rows[p]: the late rows go to
 * out, then the summary tuple. 0, or -1 with *decline set (the loop's case) or an
 * error set. */
static PyObject *
fold_step_row(PyObject *row, PyObject *row_type, PyObject *hooks_key, PyObject *hooks)
{
    /* row_type(*row[:7], {**row[7], hooks_key: hooks}, row[8], row[9]); row[7] is a
     * plain dict with exact str keys (checked by fold_read) */
    PyObject *attrs = PyDict_Copy(PyTuple_GET_ITEM(row, 7)); /* a dict, in the same order */
    if (attrs == NULL) {
        return NULL;
    }
    if (PyDict_SetItem(attrs, hooks_key, hooks) < 0) {
        Py_DECREF(attrs);
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)row_type;
    PyObject *done = type->tp_alloc(type, 10); /* as tuple.__new__(row_type, ...) */
    if (done == NULL) {
        Py_DECREF(attrs);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < 10; k++) {
        PyTuple_SET_ITEM(done, k, k == 7 ? attrs : Py_NewRef(PyTuple_GET_ITEM(row, k)));
    }
    /* Neither is tracked by the cycle collector: both are new, and nothing they hold
     * (the row's fields, made before them, and the hooks text) can lead back to them,
     * so no cycle can run through either. Tracked, each summarised step added two
     * objects that every young collection walked until the batch was written. */
    PyObject_GC_UnTrack(attrs);
    PyObject_GC_UnTrack(done);
    return done;
}

static int fold_emit(FoldState *s, PyObject *step_row, unsigned int stamp, Py_ssize_t top,
                     PyObject *out, PyObject *spots, Py_ssize_t base, PyObject *lane,
                     PyObject *added, Py_ssize_t names0, int announce, PyObject *row_type,
                     PyObject *hooks_key);

static int
fold_close(FoldState *s, FoldRow *rows, Py_ssize_t p, PyObject *out, PyObject *spots,
           Py_ssize_t base, PyObject *lane, PyObject *index, PyObject *added,
           Py_ssize_t names0, int announce, Py_ssize_t *folded, int *decline,
           PyObject *row_type, PyObject *hooks_key)
{
    long long end = rows[p].end;
    if (fold_children_reset(s, s->nheld + s->ninner) < 0) {
        return -1;
    }
    Py_ssize_t nfold = 0;
    for (Py_ssize_t k = 0; k < s->nheld; k++) {
        FoldRow *r = &rows[s->held[k]];
        if (r->end <= end) {
            long long dur;
            if (__builtin_sub_overflow(r->end, r->start, &dur)) {
                *decline = 1;
                return -1;
            }
            if (fold_child_add(s, r->parent, dur > 0 ? dur : 0, decline) < 0) {
                return -1;
            }
            s->held[nfold++] = s->held[k]; /* the folded rows, kept in order */
        }
        else if (PyList_Append(out, r->row) < 0) { /* ended after the step: in full */
            return -1;
        }
    }
    for (Py_ssize_t k = 0; k < s->ninner; k++) {
        if (s->inner[k].end <= end &&
            fold_child_add(s, s->inner[k].parent, s->inner[k].dur, decline) < 0) {
            return -1;
        }
    }
    Py_ssize_t top = -1;
    if (s->astamp == UINT_MAX) { /* never in practice: 4e9 steps in one call */
        *decline = 1;
        return -1;
    }
    unsigned int stamp = ++s->astamp;
    for (Py_ssize_t k = 0; k < nfold; k++) {
        FoldRow *r = &rows[s->held[k]];
        long long dur = r->end - r->start; /* checked above */
        if (dur < 0) {
            dur = 0;
        }
        long long own = dur - fold_child_get(s, r->span); /* both >= 0: no overflow */
        size_t slot = fold_cache_slot(r->name, s->iname, 64);
        Py_ssize_t at;
        if (s->iname[slot] == r->name) {
            at = s->iat[slot];
        }
        else {
            at = fold_name_index(index, added, names0, r->name, decline);
            if (at < 0) {
                return -1;
            }
            s->iname[slot] = r->name;
            s->iat[slot] = at;
        }
        if (at >= s->capagg) {
            Py_ssize_t old = s->capagg;
            if (fold_grow((void **)&s->agg, &s->capagg, at + 1, sizeof(FoldAgg)) < 0) {
                return -1;
            }
            memset(s->agg + old, 0, (size_t)(s->capagg - old) * sizeof(FoldAgg));
        }
        FoldAgg *a = &s->agg[at];
        if (a->stamp != stamp) {
            a->stamp = stamp;
            a->total = dur;
            a->own = own;
            a->count = 1;
            if (at > top) {
                top = at;
            }
        }
        else if (__builtin_add_overflow(a->total, dur, &a->total) ||
                 __builtin_add_overflow(a->own, own, &a->own)) {
            *decline = 1;
            return -1;
        }
        else {
            a->count++;
        }
    }
    *folded += nfold;
    return fold_emit(s, rows[p].row, stamp, top, out, spots, base, lane, added, names0,
                     announce, row_type, hooks_key);
}

/* the summary of step_row from the aggregates of s stamped stamp (names up to top),
 * appended to out (its index plus base to spots) */
static int
fold_emit(FoldState *s, PyObject *step_row, unsigned int stamp, Py_ssize_t top, PyObject *out,
          PyObject *spots, Py_ssize_t base, PyObject *lane, PyObject *added, Py_ssize_t names0,
          int announce, PyObject *row_type, PyObject *hooks_key)
{
    /* the hooks text: one entry per name up to the last present one */
    Buf *b = &s->hooks;
    PyObject *hooks = NULL;
    int failed = 0;
    b->len = 0;
    for (Py_ssize_t at = 0; at <= top && !failed; at++) {
        int present = s->agg[at].stamp == stamp;
        if (at > 0 && buf_add(b, ";", 1) < 0) {
            failed = 1;
        }
        else if (present && fold_entry(b, &s->agg[at]) < 0) {
            failed = 1;
        }
    }
    if (!failed) {
        hooks = b->len ? buf_to_str(b) : PyUnicode_New(0, 127);
    }
    if (hooks == NULL) {
        return -1;
    }
    PyObject *count = PyLong_FromSsize_t(names0 + PyDict_GET_SIZE(added));
    PyObject *spot = PyLong_FromSsize_t(base + PyList_GET_SIZE(out));
    PyObject *done = NULL, *summary = NULL;
    if (count != NULL && spot != NULL) {
        done = fold_step_row(step_row, row_type, hooks_key, hooks);
    }
    if (done != NULL) {
        summary = PyTuple_Pack(4, done, lane, count, announce ? Py_True : Py_False);
    }
    int rc = -1;
    if (summary != NULL && PyList_Append(spots, spot) == 0 && PyList_Append(out, summary) == 0) {
        rc = 0;
    }
    Py_XDECREF(summary);
    Py_XDECREF(done);
    Py_XDECREF(spot);
    Py_XDECREF(count);
    Py_DECREF(hooks);
    return rc;
}

static PyObject *
one_thread(PyObject *module, PyObject *rows)
{
    if (!PyList_Check(rows) || PyList_GET_SIZE(rows) == 0) {
        Py_RETURN_NONE;
    }
    /* no call in this loop runs Python code (exact ints only), so the list cannot change
     * under it; its length is read on each pass anyway */
    PyObject *first = NULL;
    long long tid0 = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 10) {
            Py_RETURN_NONE;
        }
        PyObject *v = PyTuple_GET_ITEM(row, 6);
        long long tid;
        if (v == first) {
            continue; /* the same int object */
        }
        if (!fold_ll(v, &tid) || (first != NULL && tid != tid0)) {
            Py_RETURN_NONE;
        }
        if (first == NULL) {
            tid0 = tid;
        }
        first = v; /* compared by address only, while the row holds it */
    }
    return PyLong_FromLongLong(tid0);
}

static int
fold_commit_names(PyObject *names, PyObject *index, PyObject *added)
{
    /* the new names, in the order they came: escaped into names, as they are into index */
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int rc = 0;
    PyObject *items = PyDict_Items(added); /* a snapshot holding strong references */
    if (items == NULL) {
        return -1;
    }
    for (pos = 0; pos < PyList_GET_SIZE(items) && rc == 0; pos++) {
        PyObject *pair = PyList_GET_ITEM(items, pos);
        key = PyTuple_GET_ITEM(pair, 0);
        value = PyTuple_GET_ITEM(pair, 1);
        PyObject *shown = Py_NewRef(key);
        Py_ssize_t len = PyUnicode_GET_LENGTH(key);
        static const char *from[2] = {"%", ";"}, *to[2] = {"%25", "%3B"};
        for (int k = 0; k < 2 && shown != NULL; k++) {
            Py_ssize_t found = PyUnicode_FindChar(shown, from[k][0], 0, len, 1);
            if (found == -2) {
                Py_CLEAR(shown);
            }
            else if (found >= 0) {
                PyObject *a = PyUnicode_FromString(from[k]), *b = PyUnicode_FromString(to[k]);
                PyObject *r = (a && b) ? PyUnicode_Replace(shown, a, b, -1) : NULL;
                Py_XDECREF(a);
                Py_XDECREF(b);
                Py_SETREF(shown, r);
                if (shown != NULL) {
                    len = PyUnicode_GET_LENGTH(shown);
                }
            }
        }
        if (shown == NULL || PyList_Append(names, shown) < 0 ||
            PyDict_SetItem(index, key, value) < 0) {
            rc = -1;
        }
        Py_XDECREF(shown);
    }
    Py_DECREF(items);
    return rc;
}

/* light_lane(group, light, announce, lane, names, index, step_name, hooks_key, row_type,
 *            base) -> (rows, spots, popped, announce, spans, steps, lost) | None
 *
 * The C twin of DetailFilter._take_lane for a lane with only light steps published
 * (no start published, no open interval): group one thread's rows, light the list of
 * published (start, aggregates) pairs, aggregates (name, total, self, count, ...) with
 * exact str names and exact ints. A trainer.step row (exactly step_name) whose start is
 * the first pair's becomes the summary (step row with {**attributes, hooks_key: hooks},
 * lane, count, announce) of that pair's aggregates; pairs that start before it are
 * dropped (their spans counted in lost); every other row is taken as it is, a step row
 * that matches no pair as a detailed step. Returns None, having changed nothing, for
 * anything else. Objects walked are owned by private copies of the lists.
 */
static PyObject *
light_lane(PyObject *module, PyObject *args)
{
    PyObject *group, *light_arg, *lane, *names, *index, *step_name, *hooks_key, *row_type;
    int announce;
    Py_ssize_t base;
    if (!PyArg_ParseTuple(args, "OOpOOOOOOn:light_lane", &group, &light_arg, &announce, &lane,
                          &names, &index, &step_name, &hooks_key, &row_type, &base)) {
        return NULL;
    }
    PyTypeObject *rt = PyType_Check(row_type) ? (PyTypeObject *)row_type : NULL;
    if (rt == NULL || !PyType_IsSubtype(rt, &PyTuple_Type) ||
        rt->tp_basicsize != PyTuple_Type.tp_basicsize ||
        rt->tp_itemsize != PyTuple_Type.tp_itemsize || rt->tp_dictoffset != 0 ||
        !PyUnicode_CheckExact(hooks_key) || !PyList_Check(group) || !PyList_Check(light_arg) ||
        !PyList_CheckExact(names) || !PyDict_CheckExact(index) ||
        !PyUnicode_CheckExact(step_name)) {
        Py_RETURN_NONE;
    }
    FoldState s;
    memset(&s, 0, sizeof(s));
    PyObject *grp = NULL, *pairs = NULL, *out = NULL, *spots = NULL, *added = NULL;
    PyObject *result = NULL;
    int decline = 0;
    Py_ssize_t names0 = PyList_GET_SIZE(names), c = 0, spans = 0, steps = 0, lost = 0;
    grp = PySequence_List(group);
    pairs = grp != NULL ? PySequence_List(light_arg) : NULL;
    out = PyList_New(0);
    spots = PyList_New(0);
    added = PyDict_New();
    if (pairs == NULL || out == NULL || spots == NULL || added == NULL) {
        goto done;
    }
    PyObject_GC_UnTrack(grp);
    PyObject_GC_UnTrack(pairs);
    /* check every pair first: its start and its aggregates' types */
    Py_ssize_t m = PyList_GET_SIZE(pairs);
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *pair = PyList_GET_ITEM(pairs, k), *agg;
        long long v;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !fold_ll(PyTuple_GET_ITEM(pair, 0), &v) ||
            !PyTuple_CheckExact(agg = PyTuple_GET_ITEM(pair, 1)) ||
            PyTuple_GET_SIZE(agg) % 4 != 0) {
            decline = 1;
            goto done;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(agg); j += 4) {
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(agg, j)) ||
                !fold_ll(PyTuple_GET_ITEM(agg, j + 1), &v) || v < 0 ||
                !fold_ll(PyTuple_GET_ITEM(agg, j + 2), &v) || v < 0 ||
                !fold_ll(PyTuple_GET_ITEM(agg, j + 3), &v) || v < 1) {
                decline = 1;
                goto done;
            }
        }
    }
    Py_ssize_t g = PyList_GET_SIZE(grp);
    long long prev_end = LLONG_MIN, prev_start = LLONG_MIN;
    for (Py_ssize_t i = 0; i < g; i++) {
        PyObject *row = PyList_GET_ITEM(grp, i);
        long long r_start, r_end;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 10 ||
            !fold_ll(PyTuple_GET_ITEM(row, 4), &r_start) ||
            !fold_ll(PyTuple_GET_ITEM(row, 5), &r_end) || r_end < prev_end ||
            (r_end == prev_end && r_start > prev_start)) {
            decline = 1; /* not in end order (the later start first at equal ends) */
            goto done;
        }
        prev_end = r_end;
        prev_start = r_start;
        PyObject *name = PyTuple_GET_ITEM(row, 0);
        int is_step = name == step_name;
        if (!is_step && PyUnicode_CheckExact(name)) {
            is_step = PyUnicode_Compare(name, step_name) == 0; /* exact str: no code */
        }
        else if (!is_step) {
            decline = 1; /* a name that is not an exact str: the loop */
            goto done;
        }
        if (!is_step || c == m) {
            announce = announce || is_step; /* a detailed step */
            if (PyList_Append(out, row) < 0) {
                goto done;
            }
            continue;
        }
        long long start = r_start;
        if (!fold_plain_attrs(PyTuple_GET_ITEM(row, 7))) {
            decline = 1;
            goto done;
        }
        long long at0;
        PyObject *agg = NULL;
        while (c < m) {
            PyObject *pair = PyList_GET_ITEM(pairs, c);
            fold_ll(PyTuple_GET_ITEM(pair, 0), &at0); /* checked above */
            if (at0 >= start) {
                break;
            }
            PyObject *old = PyTuple_GET_ITEM(pair, 1); /* a step whose row never came */
            for (Py_ssize_t j = 3; j < PyTuple_GET_SIZE(old); j += 4) {
                long long n;
                fold_ll(PyTuple_GET_ITEM(old, j), &n);
                lost += (Py_ssize_t)n;
            }
            c++;
        }
        if (c < m && at0 == start) {
            agg = PyTuple_GET_ITEM(PyList_GET_ITEM(pairs, c), 1);
        }
        if (agg == NULL) {
            announce = 1; /* a detailed step */
            if (PyList_Append(out, row) < 0) {
                goto done;
            }
            continue;
        }
        c++;
        if (s.astamp == UINT_MAX) {
            decline = 1;
            goto done;
        }
        unsigned int stamp = ++s.astamp;
        Py_ssize_t top = -1;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(agg); j += 4) {
            PyObject *nm = PyTuple_GET_ITEM(agg, j);
            long long total, own, count;
            fold_ll(PyTuple_GET_ITEM(agg, j + 1), &total); /* checked above */
            fold_ll(PyTuple_GET_ITEM(agg, j + 2), &own);
            fold_ll(PyTuple_GET_ITEM(agg, j + 3), &count);
            size_t slot = fold_cache_slot(nm, s.iname, 64);
            Py_ssize_t ix;
            if (s.iname[slot] == nm) {
                ix = s.iat[slot];
            }
            else {
                ix = fold_name_index(index, added, names0, nm, &decline);
                if (ix < 0) {
                    goto done;
                }
                s.iname[slot] = nm;
                s.iat[slot] = ix;
            }
            if (ix >= s.capagg) {
                Py_ssize_t was = s.capagg;
                if (fold_grow((void **)&s.agg, &s.capagg, ix + 1, sizeof(FoldAgg)) < 0) {
                    goto done;
                }
                memset(s.agg + was, 0, (size_t)(s.capagg - was) * sizeof(FoldAgg));
            }
            FoldAgg *a = &s.agg[ix];
            if (a->stamp == stamp) { /* a name twice in one step's aggregates: the loop */
                decline = 1;
                goto done;
            }
            a->stamp = stamp;
            a->total = total;
            a->own = own;
            a->count = count;
            if (ix > top) {
                top = ix;
            }
            spans += (Py_ssize_t)count;
        }
        if (fold_emit(&s, row, stamp, top, out, spots, base, lane, added, names0, announce,
                      row_type, hooks_key) < 0) {
            goto done;
        }
        announce = 0;
        steps++;
    }
    if (PyList_GET_SIZE(names) != names0) { /* changed meanwhile (a finalizer): the loop */
        decline = 1;
        goto done;
    }
    result = Py_BuildValue("(OOnOnnn)", out, spots, c, announce ? Py_True : Py_False, spans,
                           steps, lost);
    if (result != NULL && PyDict_GET_SIZE(added) && fold_commit_names(names, index, added) < 0) {
        Py_CLEAR(result);
    }
done:
    fold_state_free(&s);
    Py_XDECREF(grp);
    Py_XDECREF(pairs);
    Py_XDECREF(out);
    Py_XDECREF(spots);
    Py_XDECREF(added);
    if (result == NULL && decline) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *
fold_lane(PyObject *module, PyObject *args)
{
    PyObject *group, *starts_arg, *cur, *lane, *names, *index, *step_name, *step_level,
        *enclosing, *hooks_key, *row_type;
    int announce;
    Py_ssize_t max_held, base;
    if (!PyArg_ParseTuple(args, "OOOpOOOOOOnnOO:fold_lane", &group, &starts_arg, &cur,
                          &announce, &lane, &names, &index, &step_name, &step_level, &enclosing,
                          &max_held, &base, &hooks_key, &row_type)) {
        return NULL;
    }
    PyTypeObject *rt = PyType_Check(row_type) ? (PyTypeObject *)row_type : NULL;
    if (rt == NULL || !PyType_IsSubtype(rt, &PyTuple_Type) ||
        rt->tp_basicsize != PyTuple_Type.tp_basicsize ||
        rt->tp_itemsize != PyTuple_Type.tp_itemsize || rt->tp_dictoffset != 0 ||
        !PyUnicode_CheckExact(hooks_key) || !PyList_Check(group) || !PyList_Check(starts_arg) ||
        !PyList_CheckExact(names) || !PyDict_CheckExact(index) ||
        !PyUnicode_CheckExact(step_name) ||
        !fold_exact_set(step_level) || !fold_exact_set(enclosing) ||
        (cur != Py_None && (!PyTuple_CheckExact(cur) || PyTuple_GET_SIZE(cur) != 3 ||
                            !PyList_Check(PyTuple_GET_ITEM(cur, 1)) ||
                            !PyList_Check(PyTuple_GET_ITEM(cur, 2))))) {
        Py_RETURN_NONE;
    }
    FoldState s;
    memset(&s, 0, sizeof(s));
    FoldKinds kinds;
    memset(&kinds, 0, sizeof(kinds));
    FoldRow *rows = NULL;
    long long *st = NULL;
    PyObject *grp = NULL, *held0 = NULL, *inner0 = NULL, *out = NULL, *spots = NULL,
             *added = NULL, *nxt = NULL, *result = NULL;
    int decline = 0;
    int has_cur = cur != Py_None;
    long long cur_start = 0;
    Py_ssize_t names0 = PyList_GET_SIZE(names);
    /* private copies of the lists walked, not tracked by the cycle collector: nothing
     * but this call refers to them, and each result object made below may start a young
     * collection, which would walk every row of a tracked copy again */
    grp = PySequence_List(group);
    if (grp == NULL) {
        goto done;
    }
    PyObject_GC_UnTrack(grp);
    if (has_cur) {
        if (!fold_ll(PyTuple_GET_ITEM(cur, 0), &cur_start)) {
            decline = 1;
            goto done;
        }
        held0 = PySequence_List(PyTuple_GET_ITEM(cur, 1));
        inner0 = held0 ? PySequence_List(PyTuple_GET_ITEM(cur, 2)) : NULL;
        if (inner0 == NULL) {
            goto done;
        }
        PyObject_GC_UnTrack(held0);
        PyObject_GC_UnTrack(inner0);
    }
    Py_ssize_t h = held0 ? PyList_GET_SIZE(held0) : 0, g = PyList_GET_SIZE(grp), n = h + g;
    Py_ssize_t m = PyList_GET_SIZE(starts_arg);
    st = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(long long));
    rows = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(FoldRow));
    if (st == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < m; k++) { /* exact ints: nothing runs; length re-read */
        if (k >= PyList_GET_SIZE(starts_arg) ||
            !fold_ll(PyList_GET_ITEM(starts_arg, k), &st[k])) {
            decline = 1;
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *row = k < h ? PyList_GET_ITEM(held0, k) : PyList_GET_ITEM(grp, k - h);
        int rc = fold_read(row, &rows[k], step_name, step_level, enclosing, &kinds);
        if (rc <= 0) {
            decline = rc == 0;
            goto done;
        }
        /* the group in end order, the later start first at equal ends */
        if (k > h && (rows[k].end < rows[k - 1].end ||
                      (rows[k].end == rows[k - 1].end && rows[k].start > rows[k - 1].start))) {
            decline = 1;
            goto done;
        }
    }
    if (fold_grow((void **)&s.held, &s.capheld, h + 1, sizeof(Py_ssize_t)) < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < h; k++) {
        s.held[k] = k;
    }
    s.nheld = h;
    if (has_cur) {
        Py_ssize_t ni = PyList_GET_SIZE(inner0);
        if (fold_grow((void **)&s.inner, &s.capinner, ni + 1, sizeof(FoldInner)) < 0) {
            goto done;
        }
        for (Py_ssize_t k = 0; k < ni; k++) {
            PyObject *t = PyList_GET_ITEM(inner0, k);
            FoldInner *x = &s.inner[k];
            if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 4 ||
                !fold_ll(PyTuple_GET_ITEM(t, 0), &x->start) ||
                !fold_ll(PyTuple_GET_ITEM(t, 1), &x->end) ||
                !fold_ull(PyTuple_GET_ITEM(t, 2), &x->parent) ||
                !fold_ll(PyTuple_GET_ITEM(t, 3), &x->dur) || x->dur < 0) {
                decline = 1;
                goto done;
            }
        }
        s.ninner = ni;
    }
    out = PyList_New(0);
    spots = PyList_New(0);
    added = PyDict_New();
    if (out == NULL || spots == NULL || added == NULL) {
        goto done;
    }
    Py_ssize_t c = 0, folded = 0, steps = 0;
    for (Py_ssize_t i = h; i < n; i++) {
        FoldRow *r = &rows[i];
        long long start;
        if (has_cur) {
            start = cur_start;
        }
        else if (c < m) {
            start = st[c];
        }
        else {
            if (r->kind == FK_STEP) {
                announce = 1; /* a detailed step */
            }
            if (PyList_Append(out, r->row) < 0) {
                goto done;
            }
            continue;
        }
        if (r->kind == FK_HOOK && !r->error) {
            if (r->start >= start) {
                if (!has_cur) {
                    has_cur = 1;
                    cur_start = start;
                    s.nheld = s.ninner = 0;
                }
                if (s.nheld >= max_held) { /* it would hold more: the loop gives them back */
                    decline = 1;
                    goto done;
                }
                if (fold_grow((void **)&s.held, &s.capheld, s.nheld + 1, sizeof(Py_ssize_t)) <
                    0) {
                    goto done;
                }
                s.held[s.nheld++] = i;
            }
            else if (PyList_Append(out, r->row) < 0) {
                goto done;
            }
            continue;
        }
        if (r->kind == FK_STEP) {
            if (r->end < start || (r->end == start && r->start < start)) {
                announce = 1; /* an earlier step, in full */
                if (PyList_Append(out, r->row) < 0) {
                    goto done;
                }
                continue;
            }
            if (r->start <= start) { /* the step row of this interval */
                c++;
                if (!has_cur) {
                    s.nheld = s.ninner = 0;
                }
                has_cur = 0;
                if (fold_close(&s, rows, i, out, spots, base, lane, index, added, names0,
                               announce, &folded, &decline, row_type, hooks_key) < 0) {
                    goto done;
                }
                announce = 0;
                steps++;
                s.nheld = s.ninner = 0;
                continue;
            }
        }
        else if (r->start >= start) { /* in the step, written in full */
            if (!has_cur) {
                has_cur = 1;
                cur_start = start;
                s.nheld = s.ninner = 0;
            }
            long long dur;
            if (__builtin_sub_overflow(r->end, r->start, &dur)) {
                decline = 1;
                goto done;
            }
            if (fold_grow((void **)&s.inner, &s.capinner, s.ninner + 1, sizeof(FoldInner)) < 0) {
                goto done;
            }
            s.inner[s.ninner++] = (FoldInner){r->start, r->end, r->parent, dur > 0 ? dur : 0};
            if (PyList_Append(out, r->row) < 0) {
                goto done;
            }
            continue;
        }
        else if (!(r->kind == FK_ENCLOSING && start < r->end)) {
            if (PyList_Append(out, r->row) < 0) {
                goto done;
            }
            continue;
        }
        /* the interval's step row can no longer come: the loop gives its rows back */
        decline = 1;
        goto done;
    }
    if (has_cur) {
        PyObject *kept = PyList_New(s.nheld), *inner = PyList_New(s.ninner);
        PyObject *at = PyLong_FromLongLong(cur_start);
        if (kept == NULL || inner == NULL || at == NULL) {
            Py_XDECREF(kept);
            Py_XDECREF(inner);
            Py_XDECREF(at);
            goto done;
        }
        for (Py_ssize_t k = 0; k < s.nheld; k++) {
            PyList_SET_ITEM(kept, k, Py_NewRef(rows[s.held[k]].row));
        }
        for (Py_ssize_t k = 0; k < s.ninner; k++) {
            FoldInner *x = &s.inner[k];
            PyObject *t = Py_BuildValue("(LLKL)", x->start, x->end, x->parent, x->dur);
            if (t == NULL) {
                Py_DECREF(kept);
                Py_DECREF(inner);
                Py_DECREF(at);
                goto done;
            }
            PyList_SET_ITEM(inner, k, t);
        }
        nxt = PyTuple_Pack(3, at, kept, inner);
        Py_DECREF(at);
        Py_DECREF(kept);
        Py_DECREF(inner);
        if (nxt == NULL) {
            goto done;
        }
    }
    else {
        nxt = Py_NewRef(Py_None);
    }
    if (PyList_GET_SIZE(names) != names0) { /* changed meanwhile (a finalizer): the loop */
        decline = 1;
        goto done;
    }
    result = Py_BuildValue("(OOnOOnn)", out, spots, c, announce ? Py_True : Py_False, nxt,
                           folded, steps);
    if (result != NULL && PyDict_GET_SIZE(added) && fold_commit_names(names, index, added) < 0) {
        Py_CLEAR(result);
    }
done:
    fold_state_free(&s);
    PyMem_Free(rows);
    PyMem_Free(st);
    Py_XDECREF(grp);
    Py_XDECREF(held0);
    Py_XDECREF(inner0);
    Py_XDECREF(out);
    Py_XDECREF(spots);
    Py_XDECREF(added);
    Py_XDECREF(nxt);
    if (result == NULL && decline) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    return result;
}

/* Frame-wide index work on int64/uint64 columns: the frame's parent positions and the
 * innermost enclosing span per thread. Both read and write numpy buffers that the
 * caller passes (C-contiguous, 8-byte items, checked here) and hold no Python object
 * while they work: the buffers are held by the views, so the GIL is released. */

static int
get_words(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (view->len % 8 != 0 || view->itemsize != 8) {
        PyErr_Format(PyExc_ValueError,
                     "Expected %s as a contiguous array of 8-byte integers, but its items "
                     "are %zd bytes; pass numpy int64 or uint64 arrays.",
                     what, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
separate(const Py_buffer *out, const Py_buffer *in)
{
    /* 0 with ValueError set when out shares memory with in: the loops read their inputs
     * while they write out, and an input overwritten could send them out of bounds */
    const char *a = out->buf, *b = in->buf;
    if (out->len && in->len && a < b + in->len && b < a + out->len) {
        PyErr_SetString(PyExc_ValueError,
                        "Expected out to be an array of its own, but it shares memory with "
                        "an input; pass a new array (numpy.empty).");
        return 0;
    }
    return 1;
}

static void
release_views(Py_buffer *views, int k)
{
    for (int c = 0; c < k; c++) {
        PyBuffer_Release(&views[c]);
    }
}

/* The k arrays of an index helper, objs (named what), into views: out, the last, is
 * writable; each holds *n items (out's count) of sizes[c] bytes (8: integer words,
 * checked by get_words; 1: one byte per row); out shares memory with no input.
 * 0 with every view held (release_views), or -1 with an error set and none held. */
static int
take_views(PyObject *const *objs, const char *const *what, const int *sizes, int k,
           Py_buffer *views, Py_ssize_t *n)
{
    int got = 0;
    for (; got < k; got++) {
        int rc = sizes[got] == 8
                     ? get_words(objs[got], &views[got], got == k - 1, what[got])
                     : PyObject_GetBuffer(objs[got], &views[got], PyBUF_C_CONTIGUOUS);
        if (rc < 0) {
            goto fail;
        }
    }
    *n = views[k - 1].len / 8;
    for (int c = 0; c < k - 1; c++) {
        if (views[c].len != *n * sizes[c]) {
            PyErr_Format(PyExc_ValueError,
                         "Expected %s and out of one length (one item per row), but %s holds "
                         "%zd items and out %zd.",
                         what[c], what[c], views[c].len / sizes[c], *n);
            goto fail;
        }
        if (!separate(&views[k - 1], &views[c])) {
            goto fail;
        }
    }
    return 0;
fail:
    release_views(views, got);
    return -1;
}

/* parent_positions(span_ids, parent_ids, out) -> bool
 *
 * out[i] = the position of the row whose span id is parent_ids[i], or -1 where no row
 * has it or parent_ids[i] is 0 (a root): exporters/frame.py's _parent_positions with
 * unique span ids (pd.Index.get_indexer), its twin. False, out unspecified, when a span
 * id occurs twice, or ids collide past ID_PROBES slots: the caller then takes the
 * pandas path, which handles both.
 * An open-addressing table of (id, position + 1), sized to at most half full. */
typedef struct {
    uint64_t key;
    int64_t pos1; /* position + 1; 0 for an empty slot */
} IdSlot;

static inline size_t
id_hash(uint64_t key, size_t mask)
{
    /* the high bits folded into the low ones, which stay in order: ids that count up
     * (ppetrace's) land in neighbouring slots, so the passes walk the table in order;
     * ids that only differ above the mask still spread. A long probe (ids that collide
     * anyway) ends the C path: the caller's pandas path does not degrade. */
    return (size_t)(key ^ (key >> 23) ^ (key >> 41)) & mask;
}

#define ID_PROBES 64 /* the longest probe before parent_positions declines */

static PyObject *
parent_positions(PyObject *module, PyObject *args)
{
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO:parent_positions", &objs[0], &objs[1], &objs[2])) {
        return NULL;
    }
    static const char *const what[3] = {"span_ids", "parent_ids", "out"};
    static const int sizes[3] = {8, 8, 8};
    Py_buffer v[3];
    Py_ssize_t n;
    if (take_views(objs, what, sizes, 3, v, &n) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t size = 16;
    while (size < (size_t)n * 2) {
        size <<= 1;
    }
    IdSlot *table = PyMem_RawCalloc(size, sizeof(IdSlot));
    if (table == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint64_t *sid = v[0].buf, *par = v[1].buf;
    int64_t *out = v[2].buf;
    int unique = 1;
    size_t mask = size - 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && unique; i++) {
        size_t h = id_hash(sid[i], mask);
        int probes = 0;
        while (table[h].pos1 != 0) {
            if (table[h].key == sid[i] || ++probes > ID_PROBES) {
                unique = 0;
                break;
            }
            h = (h + 1) & mask;
        }
        table[h].key = sid[i];
        table[h].pos1 = (int64_t)i + 1;
    }
    for (Py_ssize_t i = 0; i < n && unique; i++) {
        int64_t found = -1;
        if (par[i] != 0) { /* every id sits within ID_PROBES slots of its own: so far */
            size_t h = id_hash(par[i], mask);
            for (int probes = 0; probes <= ID_PROBES && table[h].pos1 != 0; probes++) {
                if (table[h].key == par[i]) {
                    found = table[h].pos1 - 1;
                    break;
                }
                h = (h + 1) & mask;
            }
        }
        out[i] = found;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(table);
    result = PyBool_FromLong(unique);
done:
    release_views(v, 3);
    return result;
}

/* enclosing_sorted(order, end, thread, out) -> None
 *
 * For the rows in order (sorted by thread, start and longest first: _nesting's order),
 * out[order[j]] = order[k] for the nearest k < j on the same thread with
 * end[order[k]] >= end[order[j]], else -1, in one pass with a stack: all nearest
 * larger-or-equal values, which exporters/_nesting.py's _enclosing_py, its twin, finds
 * by pointer jumping in numpy. */
static PyObject *
enclosing_sorted(PyObject *module, PyObject *args)
{
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO:enclosing_sorted", &objs[0], &objs[1], &objs[2],
                          &objs[3])) {
        return NULL;
    }
    static const char *const what[4] = {"order", "end", "thread", "out"};
    static const int sizes[4] = {8, 8, 8, 8};
    Py_buffer views[4];
    Py_ssize_t n;
    if (take_views(objs, what, sizes, 4, views, &n) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *order = views[0].buf, *end = views[1].buf, *thread = views[2].buf;
    int64_t *out = views[3].buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (order[j] < 0 || order[j] >= n) {
            PyErr_Format(PyExc_ValueError,
                         "Expected order to hold row positions below %zd, but it holds %lld.",
                         n, (long long)order[j]);
            goto done;
        }
    }
    int64_t *stack = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (stack == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t top = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t row = order[j];
        if (top && thread[stack[top - 1]] != thread[row]) {
            top = 0; /* a new thread: nothing before it encloses */
        }
        while (top && end[stack[top - 1]] < end[row]) {
            top--;
        }
        out[row] = top ? stack[top - 1] : -1;
        stack[top++] = row;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(stack);
    result = Py_NewRef(Py_None);
done:
    release_views(views, 4);
    return result;
}

static int64_t *
walk_path(const int64_t *ppos, Py_ssize_t n)
{
    /* room for a walk up through the parent positions ppos, once they are checked to
     * lie in -1..n-1; NULL with ValueError or MemoryError set */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ppos[i] < -1 || ppos[i] >= n) {
            PyErr_Format(PyExc_ValueError,
                         "Expected parent positions from -1 to %zd, but one is %lld.", n - 1,
                         (long long)ppos[i]);
            return NULL;
        }
    }
    int64_t *path = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (path == NULL) {
        PyErr_NoMemory();
    }
    return path;
}

/* nearest_valued(missing, ppos, out) -> None
 *
 * out[i] = i where missing[i] is 0, else the position of the nearest ancestor (through
 * the parent positions ppos, -1 for none) whose missing is 0, else i again (no such
 * ancestor, or a cycle of missing rows): the source of each row's value in
 * exporters/frame.py's _inherit_masked (values[out], missing[out]), whose numpy walk
 * is the twin. Each row's answer is found once: a walk up stops at the first row
 * already answered, and answers every row it passed. */
static PyObject *
nearest_valued(PyObject *module, PyObject *args)
{
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO:nearest_valued", &objs[0], &objs[1], &objs[2])) {
        return NULL;
    }
    static const char *const what[3] = {"missing", "ppos", "out"};
    static const int sizes[3] = {1, 8, 8}; /* missing: one byte per row */
    Py_buffer v[3];
    Py_ssize_t n;
    if (take_views(objs, what, sizes, 3, v, &n) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const unsigned char *missing = v[0].buf;
    const int64_t *ppos = v[1].buf;
    int64_t *out = v[2].buf;
    int64_t *path = walk_path(ppos, n);
    if (path == NULL) {
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    enum { UNKNOWN = -2, WALKING = -3 };
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = missing[i] ? UNKNOWN : (int64_t)i;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (out[i] != UNKNOWN) {
            continue;
        }
        Py_ssize_t len = 0;
        int64_t a = (int64_t)i;
        while (a >= 0 && out[a] == UNKNOWN) {
            out[a] = WALKING;
            path[len++] = a;
            a = ppos[a];
        }
        /* a root passed, an answer met (a source, or a row without one: itself, missing),
         * or a row of this walk again (a cycle) */
        int64_t found = a < 0 || out[a] < 0 || missing[out[a]] ? -1 : out[a];
        for (Py_ssize_t j = 0; j < len; j++) {
            out[path[j]] = found < 0 ? path[j] : found;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(path);
    release_views(v, 3);
    return result;
}

/* depths(ppos, out) -> None
 *
 * out[i] = the number of ancestors of row i through the parent positions ppos (-1 for
 * none), or n + 1 where the chain up meets a cycle: exporters/frame.py's _depth, whose
 * numpy walk (a level at a time, at most n + 1 levels) is the twin. Each row's depth
 * is found once: a walk up stops at the first row already known. */
static PyObject *
depths(PyObject *module, PyObject *args)
{
    PyObject *objs[2];
    if (!PyArg_ParseTuple(args, "OO:depths", &objs[0], &objs[1])) {
        return NULL;
    }
    static const char *const what[2] = {"ppos", "out"};
    static const int sizes[2] = {8, 8};
    Py_buffer v[2];
    Py_ssize_t n;
    if (take_views(objs, what, sizes, 2, v, &n) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *ppos = v[0].buf;
    int64_t *out = v[1].buf;
    int64_t *path = walk_path(ppos, n);
    if (path == NULL) {
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    enum { UNKNOWN = -1, WALKING = -2 };
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = UNKNOWN;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = 0;
        int64_t a = (int64_t)i;
        while (a >= 0 && out[a] == UNKNOWN) {
            out[a] = WALKING;
            path[len++] = a;
            a = ppos[a];
        }
        /* a root passed (depth -1 above it), a known depth met, or a row of this walk
         * again: a cycle, whose rows and every row below them get n + 1 */
        int64_t above = a < 0 ? -1 : out[a] == WALKING ? (int64_t)n : out[a];
        for (Py_ssize_t j = len - 1; j >= 0; j--) {
            above = above >= (int64_t)n ? (int64_t)n + 1 : above + 1;
            out[path[j]] = above;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(path);
    release_views(v, 2);
    return result;
}

static PyMethodDef module_methods[] = {
    {"typed_column", typed_column, METH_VARARGS, "One attribute key across rows, typed."},
    {"attr_table", attr_table, METH_VARARGS,
     "Every attribute key across rows (but those in skip), typed, in one pass."},
    {"span_columns", span_columns, METH_O, "The columns of a list of span rows, strings encoded."},
    {"dict_encode", dict_encode, METH_O, "A list of str or None as int32 codes and uniques."},
    {"event_columns", event_columns, METH_VARARGS,
     "The span columns of a chunk of decoded trace events (the reader's fast path)."},
    {"scan_events", scan_events, METH_VARARGS,
     "The span columns of lines of X events, read straight from the file's bytes."},
    {"parse_hooks", parse_hooks, METH_O,
     "Every summarised step's ppetrace.hooks entries (exporters._aggregates' C twin)."},
    {"attr_split", attr_split, METH_O,
     "Distinct raw attribute objects taken apart by key: each key's distinct raw values."},
    {"encode_attrs", encode_attrs, METH_VARARGS,
     "Each row's attributes as ',\"key\":value...' (sorted keys, None skipped)."},
    {"encode_x_events", encode_x_events, METH_VARARGS,
     "A batch of Chrome X events, ordered, in parts of bytes (formatted without the GIL)."},
    {"distinct_ints", distinct_ints, METH_VARARGS,
     "The distinct ints of one field of the rows, in the order they first occur."},
    {"one_thread", one_thread, METH_O,
     "The thread id of a batch of one thread's rows in the detail filter's order, or None."},
    {"light_lane", light_lane, METH_VARARGS,
     "The light steps of one thread's rows (see the C comment)."},
    {"fold_lane", fold_lane, METH_VARARGS,
     "One thread's rows through the detail filter (DetailFilter._take_lane's C twin)."},
    {"parent_positions", parent_positions, METH_VARARGS,
     "Each row's parent position by span id (frame._parent_positions' C twin)."},
    {"depths", depths, METH_VARARGS,
     "Each row's number of ancestors (frame._depth's C twin)."},
    {"nearest_valued", nearest_valued, METH_VARARGS,
     "Each row's nearest ancestor-or-self with a value (frame._inherit_masked's C twin)."},
    {"enclosing_sorted", enclosing_sorted, METH_VARARGS,
     "The innermost enclosing span of each row on its thread (_nesting._enclosing's C twin)."},
    {"register_frozen_type", register_frozen_type, METH_O,
     "Treat this dict subclass (exporters.FrozenAttributes) like a dict."},
    {NULL, NULL, 0, NULL},
};

static int
speedups_exec(PyObject *m)
{
    scan_tables_init();
    hex_pairs_init();
    PyInterpreterState *interp = PyInterpreterState_Get();
    if (owner_interp != NULL && owner_interp != interp) {
        PyErr_SetString(PyExc_ImportError,
                        "exporters._speedups keeps process-wide state and loads in one "
                        "interpreter per process only; this one uses the pure-Python paths.");
        return -1;
    }
    owner_interp = interp;
    return 0;
}

static PyModuleDef_Slot speedups_slots[] = {
    {Py_mod_exec, speedups_exec},
    {0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "exporters._speedups",
    .m_doc = "The exporters' per-row work in C: Chrome events and frame columns.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = speedups_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
