/*
 * The hot path of ppetrace.trace in C: entering and leaving a traced block.
 *
 * ppetrace/tracing/_recorder.py holds the reference implementation in pure
 * Python and uses this module when it was built (see setup.py; the build is
 * optional). Both do the same work, in the same order:
 *
 *   enter: take a snapshot of the arg as the span's attributes (a copy of a
 *          dict, the shared empty mapping for None, a FrozenAttributes as it
 *          is, anything else through the Python callback), read the
 *          OpenTelemetry context (a ContextVar holding a dict), take the parent
 *          span from it, give the block the next span id, set a copy of the
 *          context with the block as the current span, read the monotonic
 *          clock (the clock of time.perf_counter_ns).
 *   exit:  read the clock, reset the context, turn the finished span into an
 *          exporters.SpanRow (epoch times, thread id, attributes, status and
 *          the exception text if the block raised), append it to its thread's
 *          record list and call the recorder back when that list is full.
 *
 * Everything else (flushing, exporters, the OpenTelemetry span API of the
 * object) stays in Python.
 *
 * THE RULE, followed throughout this file:
 *   - No borrowed reference is held across any call that can run Python code.
 *     That includes calls into Python callbacks, __hash__/__eq__/__repr__/
 *     __index__ of user objects, and any allocation of a GC-tracked object
 *     (a collection runs finalizers, and a finalizer can do anything, even
 *     fork). Such a reference is made strong first (Py_INCREF, released
 *     after) or fetched again after the call.
 *   - Input containers that C walks are copied, or their length is checked
 *     on each access.
 *   - Integer arithmetic on times is checked: monotonic + offset is computed
 *     with __builtin_add_overflow, and where it overflows the row gets the
 *     exact sum as a Python int, which is what the pure-Python path computes.
 *
 * Module state (the callbacks, the run's trace id, the capacity) is
 * process-global. The module refuses to load in a second interpreter of the
 * process (ImportError); ppetrace then uses its pure-Python path there. Until
 * install() has run, SpanBase refuses to be used (RuntimeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *arg;      /* as given to __init__ */
    PyObject *attrs;    /* the snapshot taken at __enter__: the row's attributes */
    PyObject *trace_id; /* NULL until the span was entered while tracing was enabled */
    PyObject *error;
    PyObject *token;
    PyObject *ctx_from; /* a reused span: the context it was last entered in ... */
    PyObject *ctx_made; /* ... and the one it made there (both NULL, or both set) */
    int reused;         /* again() has handed this object back for another block */
    int lmode;          /* light steps: 1 an open light span, 2 a full span in a fold */
    int lslot;          /* a light span's place in its fold's names */
    unsigned long long span_id;
    unsigned long long parent_id;
    long long start_ns;
    long long end_ns;
} SpanBase;

static PyTypeObject SpanBaseType;

/* Recorder state, set from Python by install() and set_state(). */
static int installed = 0;
static int enabled = 1;
static Py_ssize_t capacity = 65536;
static unsigned long long next_id = 1;
static PyObject *run_trace_id = NULL;      /* int */
static PyObject *ctxvar = NULL;            /* the OpenTelemetry ContextVar */
static PyObject *span_key = NULL;          /* str: OpenTelemetry's current-span key */
static PyObject *tls_key = NULL;           /* str: key in the thread-state dict */
static PyObject *new_buffer_cb = NULL;     /* () -> list */
static PyObject *on_full_cb = NULL;        /* (list) -> None */
static PyObject *foreign_parent_cb = NULL; /* (span) -> (trace_id, parent_id) | None */
static PyObject *snapshot_cb = NULL;       /* (arg) -> Mapping: the attributes of any other arg */
static PyObject *error_text_cb = NULL;     /* (exc) -> str */
static PyObject *row_type = NULL;          /* exporters.SpanRow, a tuple subclass */
static PyObject *frozen_type = NULL;       /* exporters.FrozenAttributes: kept without a copy */
static PyObject *empty_attrs = NULL;       /* the shared empty Mapping for arg None */
static PyObject *str_unset = NULL, *str_error = NULL, *str_empty = NULL;
static long long offset_ns = 0;            /* monotonic ns -> epoch ns */
static PyInterpreterState *owner_interp = NULL;

static inline long long
now_monotonic_ns(void)
{
    /* CLOCK_MONOTONIC counts from boot: tv_sec * 1e9 overflows int64 only after 292
     * years of uptime. Checked all the same; it saturates there. */
    struct timespec ts;
    long long ns;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (__builtin_mul_overflow((long long)ts.tv_sec, 1000000000LL, &ns) ||
        __builtin_add_overflow(ns, (long long)ts.tv_nsec, &ns)) {
        return LLONG_MAX;
    }
    return ns;
}

/* The calling thread's native id, read once per thread: the read is a system call
 * (gettid), about 130 ns here, and every row carries it. A forked child's one thread
 * has a new id: the fork handler forgets the copy it inherited. */
static __thread unsigned long native_tid = 0;

/* Light steps (see "light steps" below): the calling thread's fold, or NULL. */
typedef struct Light Light;
static __thread Light *light = NULL;
/* The last fold of the thread, kept for its next one with its names and its set of full
 * names (a step each: no allocation, and the names are found by address). A thread that
 * ends leaves its one block and the references it holds. */
static __thread Light *light_spare = NULL;
static int light_enter(SpanBase *self);
static void light_enter_full(SpanBase *self);

static void
forget_thread_state(void)
{
    /* in a forked child: the parent's thread id, and its folds (the open one's step ends
     * in the parent; the copies are left, not freed: freeing would release objects
     * here), as the pure-Python twin's thread-local state is replaced */
    native_tid = 0;
    light = NULL;
    light_spare = NULL;
}

static inline unsigned long
current_native_tid(void)
{
    if (native_tid == 0) {
        native_tid = PyThread_get_thread_native_id();
    }
    return native_tid;
}

static inline int
is_primitive(PyObject *v)
{
    return PyUnicode_CheckExact(v) || PyLong_CheckExact(v) || PyBool_Check(v) ||
           PyFloat_CheckExact(v);
}

static int
check_installed(void)
{
    if (!installed) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Expected ppetrace.tracing._speedups to be installed by "
                        "ppetrace.tracing._recorder, but install() has not run. Use ppetrace.trace, "
                        "not SpanBase directly.");
        return -1;
    }
    return 0;
}

static int
Span_init(SpanBase *self, PyObject *args, PyObject *kwds)
{
    PyObject *name = NULL, *arg = Py_None;
    static char *kwlist[] = {"event_name", "arg", NULL};
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (kwds == NULL && (n == 1 || n == 2)) {
        name = PyTuple_GET_ITEM(args, 0);
        if (n == 2) {
            arg = PyTuple_GET_ITEM(args, 1);
        }
    }
    else if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:trace", kwlist, &name, &arg)) {
        return -1;
    }
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError,
                     "Expected a str for event_name, but received %.100s. Pass the event name "
                     "first, as in ppetrace.trace(\"data.load\", arg) or "
                     "@ppetrace.trace(\"data.load\").",
                     Py_TYPE(name)->tp_name);
        return -1;
    }
    /* args owns name and arg until we return: no Python code runs before they are ours */
    Py_INCREF(name);
    Py_INCREF(arg);
    Py_XSETREF(self->name, name);
    Py_XSETREF(self->arg, arg);
    return 0;
}

static PyObject *
snapshot(PyObject *arg)
{
    /* The attributes of a span whose arg is arg, as they are now (a new reference):
     * None -> the shared empty mapping; a dict -> a copy (values that are not None,
     * str, int, float or bool make the callback reduce the copy); a FrozenAttributes
     * -> itself; anything else -> the callback's mapping. */
    PyObject *copy, *key, *value, *res;
    Py_ssize_t pos = 0;
    if (arg == Py_None) {
        return Py_NewRef(empty_attrs);
    }
    if (PyDict_CheckExact(arg)) {
        copy = PyDict_Copy(arg);
        if (copy == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                return NULL;
            }
            PyErr_Clear(); /* e.g. changed during the copy: the callback says what it can */
            return PyObject_CallOneArg(snapshot_cb, arg);
        }
        /* the copy is ours alone: no Python code runs while it is walked */
        while (PyDict_Next(copy, &pos, &key, &value)) {
            if (value != Py_None && !is_primitive(value)) {
                res = PyObject_CallOneArg(snapshot_cb, copy);
                Py_DECREF(copy);
                return res;
            }
        }
        return copy;
    }
    if ((PyObject *)Py_TYPE(arg) == frozen_type) {
        return Py_NewRef(arg);
    }
    return PyObject_CallOneArg(snapshot_cb, arg);
}

static int
span_start(SpanBase *self, int current)
{
    /* the start of a recorded block: the attribute snapshot, the parent (the current
     * span), the ids, with current the block made the current span, then the clock.
     * 0, or -1 with an error set. */
    PyObject *ctx = NULL, *parent = NULL, *new_ctx, *token, *attrs;
    attrs = snapshot(self->arg != NULL ? self->arg : Py_None);
    if (attrs == NULL) {
        return -1;
    }
    Py_XSETREF(self->attrs, attrs);
    if (PyContextVar_Get(ctxvar, NULL, &ctx) < 0) {
        return -1;
    }
    if (ctx != NULL) {
        if (!PyDict_Check(ctx)) {
            Py_DECREF(ctx);
            PyErr_SetString(PyExc_TypeError,
                            "ppetrace expected the OpenTelemetry context to be a dict.");
            return -1;
        }
        parent = PyDict_GetItemWithError(ctx, span_key);
        if (parent == NULL && PyErr_Occurred()) {
            Py_DECREF(ctx);
            return -1;
        }
        Py_XINCREF(parent); /* strong: the callback below runs Python code */
    }
    if (parent != NULL && PyObject_TypeCheck(parent, &SpanBaseType) &&
        ((SpanBase *)parent)->trace_id == NULL) {
        /* a ppetrace span that was never recorded (never entered, or entered while
         * tracing was disabled) has no ids: the block is a root, as with no parent */
        Py_CLEAR(parent);
    }
    if (parent == NULL) {
        Py_INCREF(run_trace_id);
        Py_XSETREF(self->trace_id, run_trace_id);
        self->parent_id = 0;
    }
    else if (PyObject_TypeCheck(parent, &SpanBaseType)) {
        SpanBase *p = (SpanBase *)parent;
        Py_INCREF(p->trace_id);
        Py_XSETREF(self->trace_id, p->trace_id);
        self->parent_id = p->span_id;
    }
    else {
        PyObject *res = PyObject_CallOneArg(foreign_parent_cb, parent);
        if (res == NULL) {
            Py_DECREF(parent);
            Py_DECREF(ctx);
            return -1;
        }
        if (res == Py_None) {
            Py_INCREF(run_trace_id);
            Py_XSETREF(self->trace_id, run_trace_id);
            self->parent_id = 0;
        }
        else if (PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 2) {
            PyObject *tid = PyTuple_GET_ITEM(res, 0); /* res owns it */
            unsigned long long pid = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(res, 1));
            if (pid == (unsigned long long)-1 && PyErr_Occurred()) {
                Py_DECREF(res);
                Py_DECREF(parent);
                Py_DECREF(ctx);
                return -1;
            }
            Py_INCREF(tid);
            Py_XSETREF(self->trace_id, tid);
            self->parent_id = pid;
        }
        else {
            Py_DECREF(res);
            Py_DECREF(parent);
            Py_DECREF(ctx);
            PyErr_SetString(PyExc_TypeError,
                            "ppetrace expected (trace_id, parent_id) or None from the "
                            "foreign-parent callback.");
            return -1;
        }
        Py_DECREF(res);
    }
    Py_XDECREF(parent);
    self->span_id = next_id++;
    if (!current) { /* an empty block: nothing runs inside it that could see it */
        Py_XDECREF(ctx);
        self->start_ns = now_monotonic_ns();
        return 0;
    }
    if (ctx != NULL && ctx == self->ctx_from) {
        /* a reused span entered again in the context it was last entered in: the one it
         * made there is still right (contexts are not changed once made: OpenTelemetry's
         * refuse it, and ppetrace's are never exposed to be changed but as the current
         * context), so it is set again instead of copied again */
        new_ctx = Py_NewRef(self->ctx_made);
        Py_DECREF(ctx);
    }
    else {
        new_ctx = ctx != NULL ? PyDict_Copy(ctx) : PyDict_New();
        if (new_ctx == NULL || PyDict_SetItem(new_ctx, span_key, (PyObject *)self) < 0) {
            Py_XDECREF(new_ctx);
            Py_XDECREF(ctx);
            return -1;
        }
        if (self->reused && ctx != NULL) {
            /* kept for the next block (only for reused spans: the context holds the span,
             * a cycle that the collector frees, and a span entered once needs no cache) */
            PyObject *old_from = self->ctx_from, *old_made = self->ctx_made;
            self->ctx_from = ctx; /* the reference taken above */
            self->ctx_made = Py_NewRef(new_ctx);
            Py_XDECREF(old_from); /* can run code: nothing is borrowed across it */
            Py_XDECREF(old_made);
        }
        else {
            Py_XDECREF(ctx);
        }
    }
    token = PyContextVar_Set(ctxvar, new_ctx);
    Py_DECREF(new_ctx);
    if (token == NULL) {
        return -1;
    }
    Py_XSETREF(self->token, token);
    self->start_ns = now_monotonic_ns();
    return 0;
}

static int
check_span(SpanBase *self)
{
    if (check_installed() < 0) {
        return -1;
    }
    if (self->name == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Expected an initialised ppetrace.trace, but __init__ was not run. A "
                        "subclass's __init__ must call super().__init__(event_name, arg).");
        return -1;
    }
    return 0;
}

static PyObject *
Span_enter(SpanBase *self, PyObject *Py_UNUSED(ignored))
{
    if (check_span(self) < 0) {
        return NULL;
    }
    if (self->token != NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Expected a ppetrace.trace instance that is not already entered, but "
                        "this one is open. Create one per block: with ppetrace.trace(name): ...");
        return NULL;
    }
    Py_CLEAR(self->error);
    if (enabled) {
        if (light != NULL) {
            int taken = light_enter(self);
            if (taken != 0) {
                return taken < 0 ? NULL : Py_NewRef(self);
            }
        }
        if (span_start(self, 1) < 0) {
            return NULL;
        }
        if (light != NULL) {
            light_enter_full(self);
        }
    }
    return Py_NewRef(self);
}

static PyObject *
thread_records(void)
{
    /* the calling thread's record list (a new reference), made on first use */
    PyObject *tsdict = PyThreadState_GetDict();
    PyObject *records;
    if (tsdict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ppetrace found no thread state dict.");
        return NULL;
    }
    records = PyDict_GetItemWithError(tsdict, tls_key);
    if (records != NULL) {
        return Py_NewRef(records);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    records = PyObject_CallNoArgs(new_buffer_cb);
    if (records == NULL) {
        return NULL;
    }
    if (!PyList_CheckExact(records)) {
        Py_DECREF(records);
        PyErr_SetString(PyExc_TypeError, "ppetrace expected a list from new_buffer().");
        return NULL;
    }
    tsdict = PyThreadState_GetDict(); /* the callback ran Python code: fetched again */
    if (tsdict == NULL || PyDict_SetItem(tsdict, tls_key, records) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "ppetrace found no thread state dict.");
        }
        Py_DECREF(records);
        return NULL;
    }
    return records;
}

/* The ints of the last two parent ids and the last thread id that rows carried (a
 * step's hook spans share their parent, the step and the fetch theirs, and a buffer its
 * thread): a row takes the int object again instead of a new one. Read and replaced
 * with the GIL held; releasing an int runs no Python code. */
static PyObject *parent_ints[2] = {NULL, NULL};
static unsigned long long parent_vals[2];
static int parent_next = 0;
static PyObject *tid_int = NULL;
static unsigned long tid_val;

static PyObject *
parent_int(unsigned long long v)
{
    for (int k = 0; k < 2; k++) {
        if (parent_ints[k] != NULL && parent_vals[k] == v) {
            return Py_NewRef(parent_ints[k]);
        }
    }
    PyObject *made = PyLong_FromUnsignedLongLong(v);
    if (made != NULL) {
        int k = parent_next;
        parent_next = 1 - k;
        parent_vals[k] = v;
        Py_XSETREF(parent_ints[k], Py_NewRef(made));
    }
    return made;
}

static PyObject *
thread_int(void)
{
    unsigned long v = current_native_tid();
    if (tid_int != NULL && tid_val == v) {
        return Py_NewRef(tid_int);
    }
    PyObject *made = PyLong_FromUnsignedLong(v);
    if (made != NULL) {
        tid_val = v;
        Py_XSETREF(tid_int, Py_NewRef(made));
    }
    return made;
}

static PyObject *
epoch_ns(long long monotonic)
{
    /* monotonic + offset_ns, exactly: a Python int beyond int64 where the sum overflows
     * (the pure-Python path adds Python ints) */
    long long sum;
    PyObject *a, *b, *res;
    if (!__builtin_add_overflow(monotonic, offset_ns, &sum)) {
        return PyLong_FromLongLong(sum);
    }
    a = PyLong_FromLongLong(monotonic);
    b = PyLong_FromLongLong(offset_ns);
    res = (a != NULL && b != NULL) ? PyNumber_Add(a, b) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return res;
}

static PyObject *
make_row(SpanBase *self)
{
    /* exporters.SpanRow(name, span_id, parent_id, trace_id, start_ns, end_ns, tid,
     *                   attributes, status, error). Every field is taken (strong, or by
     * value) before the row is allocated: the allocation can run a collection. */
    PyTypeObject *type = (PyTypeObject *)row_type;
    PyObject *fields[10] = {NULL};
    PyObject *row;
    if (self->name == NULL || self->trace_id == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ppetrace found a span without a name or trace id.");
        return NULL;
    }
    fields[0] = Py_NewRef(self->name);
    fields[3] = Py_NewRef(self->trace_id);
    fields[7] = Py_NewRef(self->attrs != NULL ? self->attrs : empty_attrs);
    if (self->error != NULL && self->error != Py_None) {
        fields[8] = Py_NewRef(str_error);
        fields[9] = Py_NewRef(self->error);
    }
    else {
        fields[8] = Py_NewRef(str_unset);
        fields[9] = Py_NewRef(str_empty);
    }
    fields[1] = PyLong_FromUnsignedLongLong(self->span_id);
    fields[2] = parent_int(self->parent_id);
    fields[4] = epoch_ns(self->start_ns);
    fields[5] = epoch_ns(self->end_ns);
    fields[6] = thread_int();
    row = NULL;
    for (int i = 0; i < 10; i++) {
        if (fields[i] == NULL) {
            goto done;
        }
    }
    row = type->tp_alloc(type, 10);
    if (row == NULL) {
        goto done;
    }
    for (int i = 0; i < 10; i++) {
        PyTuple_SET_ITEM(row, i, fields[i]);
        fields[i] = NULL;
    }
    /* Not tracked by the cycle collector: a row holds ints, strs and its attributes (a
     * snapshot of plain values, or a FrozenAttributes of them), all made before it, so no
     * cycle runs through it, and refcounting frees it.
     * Tracked, every row waiting in a buffer is walked by each young collection until
     * the flush: about 560 instructions per span on the tiny step (bench_instructions). */
    PyObject_GC_UnTrack(row);
done:
    for (int i = 0; i < 10; i++) {
        Py_XDECREF(fields[i]);
    }
    return row;
}

static PyObject *
Span_again(SpanBase *self, PyObject *arg)
{
    /* this span with arg in place of its arg, to be entered again; a new span of the same
     * type, name and arg while this one is open (see _SpanAPI.again) */
    if (check_span(self) < 0) {
        return NULL;
    }
    if (self->token != NULL) {
        /* the call runs Python code (a subclass's __init__): name and arg are held */
        PyObject *stack[2] = {Py_NewRef(self->name), Py_NewRef(arg)};
        PyObject *res = PyObject_Vectorcall((PyObject *)Py_TYPE(self), stack, 2, NULL);
        Py_DECREF(stack[0]);
        Py_DECREF(stack[1]);
        return res;
    }
    self->reused = 1;
    Py_INCREF(arg);
    Py_XSETREF(self->arg, arg); /* releasing the old arg can run code: nothing is borrowed */
    return Py_NewRef(self);
}

static void
record(SpanBase *self)
{
    /* the finished span's row, appended to the calling thread's buffer; a failure is
     * reported as unraisable (telemetry never breaks training) */
    PyObject *records, *row;
    int rc;
    /* the row first: making it can run Python code (a finalizer, even a fork whose
     * child drops this thread's list), so the list is fetched afterwards, and held */
    row = make_row(self);
    if (row == NULL) {
        goto lost;
    }
    records = thread_records();
    if (records == NULL) {
        Py_DECREF(row);
        goto lost;
    }
    rc = PyList_Append(records, row);
    Py_DECREF(row);
    if (rc < 0) {
        Py_DECREF(records);
        goto lost;
    }
    if (PyList_GET_SIZE(records) >= capacity) {
        PyObject *res = PyObject_CallOneArg(on_full_cb, records);
        Py_DECREF(records);
        if (res == NULL) {
            goto lost;
        }
        Py_DECREF(res);
    }
    else {
        Py_DECREF(records);
    }
    return;
lost:
    PyErr_WriteUnraisable((PyObject *)self);
}

/* the text of the exception exc as the span's error: 0, or -1 with an error set (the
 * callback's own failure is cleared: it never replaces the block's exception) */
static int
set_error_text(SpanBase *self, PyObject *exc)
{
    PyObject *text = PyObject_CallOneArg(error_text_cb, exc);
    if (text == NULL) {
        PyErr_Clear();
        text = PyUnicode_FromFormat("%.200s: <unprintable>", Py_TYPE(exc)->tp_name);
        if (text == NULL) {
            return -1;
        }
    }
    Py_XSETREF(self->error, text); /* nothing is borrowed across the release */
    return 0;
}

/* ---- light steps: a step's spans as aggregates, without rows -------------------------
 *
 * light_begin(owner, publish, full) starts a fold on the calling thread: until the span
 * owner (an entered span: a summarised trainer.step) ends, every span entered on this
 * thread whose name is not in the frozenset full is *light*. A light span reads the
 * clock when it starts and ends, and nothing else: no attribute snapshot, no ids, no
 * context (spans inside it see the span around it as their parent), no row. Its
 * duration goes into the fold's count, total and self time for its name; its self time
 * is its duration less those of the spans that ran directly inside it (light or not:
 * each open span of the fold has a frame on the fold's stack). When owner ends, before
 * its own row is made, publish((start_ns, aggregates)) is called, with one pair: the
 * epoch start of owner, and a tuple (name, total, self, count, name, ...) with one entry
 * per name that
 * occurred, in the order the thread's folds first met them (a fold keeps the names of
 * the thread's last fold that had the same set full).
 *
 * A light span whose block raises, or that ends after its fold (a generator left open),
 * is recorded in full instead, as a span that started then: ids, attributes and parent
 * (the current span) are taken when it ends. A span too deep for the stack, or with a
 * name past the table, is recorded in full. The pure-Python twin is ppetrace.tracing._light.
 * ------------------------------------------------------------------------------------- */

#define LIGHT_DEPTH 64
#define LIGHT_NAMES 64

struct Light {
    PyObject *owner;   /* strong */
    PyObject *publish; /* strong */
    PyObject *full;    /* strong: a frozenset of exact str */
    Py_ssize_t depth;
    struct {
        uintptr_t span; /* compared, never followed */
        long long child;
    } frames[LIGHT_DEPTH];
    int nnames;
    PyObject *names[LIGHT_NAMES]; /* strong */
    long long total[LIGHT_NAMES], own[LIGHT_NAMES], count[LIGHT_NAMES];
};


static void
release_names(PyObject *full, PyObject **names, int n)
{
    Py_XDECREF(full);
    for (int i = 0; i < n; i++) {
        Py_DECREF(names[i]);
    }
}

static void
light_free(Light *L)
{
    /* releasing can run code: the fold is unlinked from the thread first (by the caller),
     * and each object is taken out of it before any is released */
    PyObject *owner = L->owner, *publish = L->publish;
    L->owner = L->publish = NULL;
    if (light_spare == NULL) {
        light_spare = L; /* consistent as it is: a fold begun meanwhile may take it */
        Py_XDECREF(owner);
        Py_XDECREF(publish);
        return;
    }
    PyObject *full = L->full, *names[LIGHT_NAMES];
    int n = L->nnames;
    memcpy(names, L->names, sizeof(PyObject *) * (size_t)n);
    PyMem_Free(L);
    Py_XDECREF(owner);
    Py_XDECREF(publish);
    release_names(full, names, n);
}

/* the slot of the span's name in L (added when new): >= 0; -1 when the span is to be
 * recorded in full (a name that is not an exact str, one in L->full, a full table);
 * -2 with an error set. No call here runs Python code (exact str only). */
static int
light_slot(Light *L, PyObject *name)
{
    if (!PyUnicode_CheckExact(name)) {
        return -1;
    }
    for (int i = 0; i < L->nnames; i++) {
        if (L->names[i] == name) {
            return i;
        }
    }
    for (int i = 0; i < L->nnames; i++) {
        int eq = PyUnicode_Compare(L->names[i], name);
        if (eq == 0) {
            /* an equal str, another object: keep this one, which the next spans of this
               name are likely to share (the old one's release runs no code: exact str) */
            Py_SETREF(L->names[i], Py_NewRef(name));
            return i;
        }
        if (eq == -1 && PyErr_Occurred()) {
            return -2;
        }
    }
    int in = PySet_Contains(L->full, name);
    if (in != 0) {
        return in < 0 ? -2 : -1;
    }
    if (L->nnames == LIGHT_NAMES) {
        return -1;
    }
    int at = L->nnames++;
    L->names[at] = Py_NewRef(name);
    L->total[at] = L->own[at] = L->count[at] = 0;
    return at;
}

/* *a += b, saturating at LLONG_MAX (b >= 0) */
static inline void
sat_add(long long *a, long long b)
{
    if (__builtin_add_overflow(*a, b, a)) {
        *a = LLONG_MAX;
    }
}

/* the frame of span in L, or -1 */
static Py_ssize_t
light_frame(Light *L, SpanBase *span)
{
    for (Py_ssize_t d = L->depth - 1; d >= 0; d--) {
        if (L->frames[d].span == (uintptr_t)span) {
            return d;
        }
    }
    return -1;
}

/* pop the frame of span (and any left open above it): its direct children's time, or -1
 * when it has none */
static long long
light_pop(Light *L, SpanBase *span, long long dur)
{
    Py_ssize_t d = light_frame(L, span);
    if (d < 0) {
        return -1;
    }
    long long child = L->frames[d].child;
    L->depth = d;
    if (d > 0) {
        sat_add(&L->frames[d - 1].child, dur);
    }
    return child;
}

static inline long long
light_dur(long long start, long long end)
{
    long long dur;
    if (__builtin_sub_overflow(end, start, &dur) || dur < 0) {
        return 0;
    }
    return dur;
}

static void
light_add(Light *L, int at, long long dur, long long child)
{
    sat_add(&L->total[at], dur);
    sat_add(&L->own[at], dur - (child < dur ? child : dur));
    L->count[at]++;
}

/* 1: span entered as a light span of the thread's fold; 0: record it as usual; -1 error */
static int
light_enter(SpanBase *self)
{
    Light *L = light;
    if (L == NULL || (PyObject *)self == L->owner || L->depth == LIGHT_DEPTH) {
        return 0;
    }
    int at = light_slot(L, self->name);
    if (at < 0) {
        return at == -2 ? -1 : 0;
    }
    self->lmode = 1;
    self->lslot = at;
    Py_XSETREF(self->token, Py_NewRef(Py_None)); /* open; None: no context was set */
    Py_CLEAR(self->trace_id); /* no ids: its span context is invalid, as when disabled */
    L->frames[L->depth].span = (uintptr_t)self;
    L->frames[L->depth].child = 0;
    L->depth++;
    self->start_ns = now_monotonic_ns();
    return 1;
}

/* after a span entered in full: its frame, when the thread has a fold */
static void
light_enter_full(SpanBase *self)
{
    Light *L = light;
    if (L != NULL && (PyObject *)self != L->owner && L->depth < LIGHT_DEPTH) {
        self->lmode = 2;
        L->frames[L->depth].span = (uintptr_t)self;
        L->frames[L->depth].child = 0;
        L->depth++;
    }
}

/* a light span recorded in full: started at self->start_ns, ended at end, in the
 * current context (its parent is the current span). 0, or -1 with an error set. */
static int
light_record_full(SpanBase *self, long long end, PyObject *exc)
{
    long long start = self->start_ns;
    if (span_start(self, 0) < 0) {
        return -1;
    }
    self->start_ns = start;
    self->end_ns = end;
    if (exc != Py_None && set_error_text(self, exc) < 0) {
        return -1;
    }
    record(self);
    return 0;
}

/* the end of a light span (self->lmode == 1): into the fold, or in full */
static void
light_exit(SpanBase *self, long long end, PyObject *exc)
{
    Light *L = light;
    long long dur = light_dur(self->start_ns, end);
    self->lmode = 0;
    Py_CLEAR(self->token);
    long long child = L != NULL ? light_pop(L, self, dur) : -1;
    if (child >= 0 && exc == Py_None && self->lslot < L->nnames) {
        light_add(L, self->lslot, dur, child);
        return;
    }
    if (light_record_full(self, end, exc) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
}

/* the end of a full span entered in a fold (self->lmode == 2) */
static void
light_exit_full(SpanBase *self, long long end)
{
    Light *L = light;
    self->lmode = 0;
    if (L != NULL) {
        light_pop(L, self, light_dur(self->start_ns, end));
    }
}

/* an empty block's span (mark) in the fold: 1, 0 to record it as usual, -1 error */
static int
light_mark(SpanBase *span)
{
    Light *L = light;
    if ((PyObject *)span == L->owner) {
        return 0;
    }
    int at = light_slot(L, span->name);
    if (at < 0) {
        return at == -2 ? -1 : 0;
    }
    long long t0 = now_monotonic_ns(), dur = light_dur(t0, now_monotonic_ns());
    if (L->depth > 0) {
        sat_add(&L->frames[L->depth - 1].child, dur);
    }
    light_add(L, at, dur, 0);
    return 1;
}

/* the fold's owner ends: publish the aggregates, free the fold. 0, or -1 with an error. */
static int
light_finish(void)
{
    Light *L = light;
    light = NULL;
    PyObject *start = epoch_ns(((SpanBase *)L->owner)->start_ns);
    int n = 0;
    for (int i = 0; i < L->nnames; i++) {
        n += L->count[i] > 0;
    }
    PyObject *agg = start != NULL ? PyTuple_New(4 * (Py_ssize_t)n) : NULL;
    int rc = agg != NULL ? 0 : -1;
    for (int i = 0, k = 0; rc == 0 && i < L->nnames; i++) {
        if (L->count[i] == 0) {
            continue;
        }
        PyObject *v[3] = {PyLong_FromLongLong(L->total[i]), PyLong_FromLongLong(L->own[i]),
                          PyLong_FromLongLong(L->count[i])};
        PyTuple_SET_ITEM(agg, k, Py_NewRef(L->names[i]));
        for (int j = 0; j < 3; j++) {
            if (v[j] == NULL) {
                rc = -1;
                Py_INCREF(Py_None);
                v[j] = Py_None;
            }
            PyTuple_SET_ITEM(agg, k + 1 + j, v[j]);
        }
        k += 4;
    }
    if (rc == 0) {
        /* names and ints only: no cycle can go through it, so the collector need not
           walk it while the step waits for its row (each young collection did) */
        PyObject_GC_UnTrack(agg);
    }
    PyObject *publish = Py_NewRef(L->publish);
    light_free(L); /* can run code: the fold is unlinked, nothing is borrowed */
    if (rc == 0) {
        /* one pair, so that publish can be a C callable such as deque.append */
        PyObject *pair = PyTuple_Pack(2, start, agg);
        PyObject *res = pair != NULL ? PyObject_CallOneArg(publish, pair) : NULL;
        rc = res != NULL ? 0 : -1;
        Py_XDECREF(res);
        Py_XDECREF(pair);
    }
    Py_DECREF(publish);
    Py_XDECREF(agg);
    Py_XDECREF(start);
    return rc;
}

/* whether every element of the frozenset s is an exact str (1), else 0 with TypeError */
static int
exact_str_set(PyObject *s)
{
    PyObject *it = PyObject_GetIter(s), *key;
    if (it == NULL) {
        return 0;
    }
    while ((key = PyIter_Next(it)) != NULL) { /* iterating a frozenset runs no code */
        int exact = PyUnicode_CheckExact(key);
        if (!exact) {
            PyErr_Format(PyExc_TypeError,
                         "Expected a frozenset of str for full, but it holds a %.100s.",
                         Py_TYPE(key)->tp_name);
        }
        Py_DECREF(key);
        if (!exact) {
            Py_DECREF(it);
            return 0;
        }
    }
    Py_DECREF(it);
    return !PyErr_Occurred();
}

static PyObject *
light_begin(PyObject *module, PyObject *args)
{
    PyObject *owner, *publish, *full;
    if (!PyArg_ParseTuple(args, "O!OO!:light_begin", &SpanBaseType, &owner, &publish,
                          &PyFrozenSet_Type, &full)) {
        return NULL;
    }
    SpanBase *o = (SpanBase *)owner;
    if (!enabled || o->token == NULL || o->lmode != 0 || light != NULL ||
        !PyCallable_Check(publish)) {
        Py_RETURN_FALSE; /* not recorded, not a full span, or a fold already open */
    }
    if ((light_spare == NULL || light_spare->full != full) && !exact_str_set(full)) {
        return NULL; /* a new set of full names is checked once, not on every step */
    }
    Light *L = light_spare;
    light_spare = NULL;
    PyObject *old_full = NULL, *old_names[LIGHT_NAMES];
    int old_n = 0;
    if (L != NULL && L->full != full) { /* other full names: the names start anew */
        old_full = L->full;
        old_n = L->nnames;
        memcpy(old_names, L->names, sizeof(PyObject *) * (size_t)old_n);
        L->full = NULL;
        L->nnames = 0;
    }
    if (L == NULL) {
        L = PyMem_Malloc(sizeof(Light));
        if (L == NULL) {
            return PyErr_NoMemory();
        }
        L->full = NULL;
        L->nnames = 0; /* the arrays are written as they fill */
    }
    for (int i = 0; i < L->nnames; i++) { /* the names of the last fold, none seen yet */
        L->total[i] = L->own[i] = L->count[i] = 0;
    }
    L->depth = 0;
    L->owner = Py_NewRef(owner);
    L->publish = Py_NewRef(publish);
    if (L->full == NULL) {
        L->full = Py_NewRef(full);
    }
    light = L;
    release_names(old_full, old_names, old_n); /* can run code: the fold is complete */
    Py_RETURN_TRUE;
}

static PyObject *
Span_exit(SpanBase *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long end;
    PyObject *exc;
    if (self->token == NULL) { /* disabled when the block started */
        Py_RETURN_NONE;
    }
    end = now_monotonic_ns();
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "Expected 3 arguments for __exit__ (type, value, traceback), but received "
                     "%zd.",
                     nargs);
        return NULL;
    }
    if (self->lmode == 1) { /* a light span */
        light_exit(self, end, args[1]);
        Py_RETURN_NONE;
    }
    if (self->lmode == 2) {
        light_exit_full(self, end);
    }
    if (light != NULL && light->owner == (PyObject *)self && light_finish() < 0) {
        PyErr_WriteUnraisable((PyObject *)self); /* the step's own row still comes */
    }
    if (PyContextVar_Reset(ctxvar, self->token) < 0) {
        /* Left in another context than it was entered in (ValueError), or the token was
         * used already (RuntimeError): the span is still recorded, and __exit__ never
         * replaces the block's own exception. */
        if (PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            PyErr_Clear();
        }
        else {
            PyErr_WriteUnraisable((PyObject *)self);
        }
    }
    Py_CLEAR(self->token);
    self->end_ns = end;
    exc = args[1];
    if (exc != Py_None && set_error_text(self, exc) < 0) {
        goto lost;
    }
    record(self);
    Py_RETURN_NONE;
lost:
    /* Telemetry never breaks training: report the failure, keep the block's outcome. */
    PyErr_WriteUnraisable((PyObject *)self);
    Py_RETURN_NONE;
}

static PyObject *
Span_mark(SpanBase *self, PyObject *arg)
{
    /* again(arg), then an empty block's span recorded at once: its start and end read
     * back to back, under the current span, which it never becomes (nothing runs inside
     * it). What "with span.again(arg): pass" records (see _SpanAPI.mark). */
    SpanBase *span;
    PyObject *target = Span_again(self, arg); /* this span, or a new one while it is open */
    if (target == NULL) {
        return NULL;
    }
    if (!enabled) { /* as an entered and left block: nothing is recorded */
        Py_DECREF(target);
        Py_RETURN_NONE;
    }
    if (!PyObject_TypeCheck(target, &SpanBaseType)) {
        Py_DECREF(target);
        PyErr_SetString(PyExc_TypeError,
                        "Expected the span's type to make a ppetrace span, but it made another "
                        "object.");
        return NULL;
    }
    span = (SpanBase *)target;
    Py_CLEAR(span->error);
    int taken = light != NULL ? light_mark(span) : 0;
    if (taken != 0) {
        Py_DECREF(target);
        if (taken < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (span_start(span, 0) < 0) {
        Py_DECREF(target);
        return NULL;
    }
    span->end_ns = now_monotonic_ns();
    record(span);
    Py_DECREF(target);
    Py_RETURN_NONE;
}

static int
Span_traverse(SpanBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->arg);
    Py_VISIT(self->attrs);
    Py_VISIT(self->trace_id);
    Py_VISIT(self->error);
    Py_VISIT(self->token);
    Py_VISIT(self->ctx_from);
    Py_VISIT(self->ctx_made);
    return 0;
}

static int
Span_clear(SpanBase *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->arg);
    Py_CLEAR(self->attrs);
    Py_CLEAR(self->trace_id);
    Py_CLEAR(self->error);
    Py_CLEAR(self->token);
    Py_CLEAR(self->ctx_from);
    Py_CLEAR(self->ctx_made);
    return 0;
}

static void
Span_dealloc(SpanBase *self)
{
    PyObject_GC_UnTrack(self);
    Span_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Span_methods[] = {
    {"again", (PyCFunction)Span_again, METH_O,
     "again(arg) -> this span with arg, to enter again (a new one while this is open)."},
    {"mark", (PyCFunction)Span_mark, METH_O,
     "mark(arg) -> None: record an empty block's span now, as again(arg) entered and left."},
    {"__enter__", (PyCFunction)Span_enter, METH_NOARGS, "Start the span."},
    {"__exit__", (PyCFunction)(void (*)(void))Span_exit, METH_FASTCALL, "End the span."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Span_members[] = {
    {"name", T_OBJECT, offsetof(SpanBase, name), READONLY, "the event name"},
    {"arg", T_OBJECT, offsetof(SpanBase, arg), READONLY, "the arg, as given"},
    {"_attrs", T_OBJECT, offsetof(SpanBase, attrs), READONLY,
     "the attributes: the snapshot of arg taken when the span was entered"},
    {"trace_id", T_OBJECT, offsetof(SpanBase, trace_id), READONLY, "the trace id"},
    {"error", T_OBJECT, offsetof(SpanBase, error), READONLY, "exception text or None"},
    {"span_id", T_ULONGLONG, offsetof(SpanBase, span_id), READONLY, "the span id"},
    {"parent_id", T_ULONGLONG, offsetof(SpanBase, parent_id), READONLY, "0 for a root"},
    {"start_ns", T_LONGLONG, offsetof(SpanBase, start_ns), READONLY, "monotonic ns"},
    {"end_ns", T_LONGLONG, offsetof(SpanBase, end_ns), READONLY, "monotonic ns"},
    {"_token", T_OBJECT, offsetof(SpanBase, token), READONLY, "context token while open"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SpanBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ppetrace.tracing._speedups.SpanBase",
    .tp_basicsize = sizeof(SpanBase),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The C part of ppetrace.trace: enter and exit.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Span_init,
    .tp_dealloc = (destructor)Span_dealloc,
    .tp_traverse = (traverseproc)Span_traverse,
    .tp_clear = (inquiry)Span_clear,
    .tp_methods = Span_methods,
    .tp_members = Span_members,
};

static PyObject *
install(PyObject *module, PyObject *args)
{
    PyObject *cv, *key, *tk, *nb, *of, *fp, *sn, *et, *rt, *ft, *ea;
    if (!PyArg_ParseTuple(args, "OUUOOOOOOOO:install", &cv, &key, &tk, &nb, &of, &fp, &sn, &et,
                          &rt, &ft, &ea)) {
        return NULL;
    }
    if (!PyType_Check(rt) || !PyType_IsSubtype((PyTypeObject *)rt, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "install() expected a tuple subclass for the row type.");
        return NULL;
    }
    if (!PyType_Check(ft)) {
        PyErr_SetString(PyExc_TypeError, "install() expected a type for the frozen mapping.");
        return NULL;
    }
    Py_XSETREF(row_type, Py_NewRef(rt));
    Py_XSETREF(frozen_type, Py_NewRef(ft));
    Py_XSETREF(empty_attrs, Py_NewRef(ea));
    Py_XSETREF(ctxvar, Py_NewRef(cv));
    Py_XSETREF(span_key, Py_NewRef(key));
    Py_XSETREF(tls_key, Py_NewRef(tk));
    Py_XSETREF(new_buffer_cb, Py_NewRef(nb));
    Py_XSETREF(on_full_cb, Py_NewRef(of));
    Py_XSETREF(foreign_parent_cb, Py_NewRef(fp));
    Py_XSETREF(snapshot_cb, Py_NewRef(sn));
    Py_XSETREF(error_text_cb, Py_NewRef(et));
    if (run_trace_id == NULL) {
        run_trace_id = PyLong_FromLong(1);
        if (run_trace_id == NULL) {
            return NULL;
        }
    }
    installed = 1;
    Py_RETURN_NONE;
}

static PyObject *
set_state(PyObject *module, PyObject *args)
{
    int en;
    Py_ssize_t cap;
    PyObject *tid;
    unsigned long long first_id;
    long long offset;
    if (!PyArg_ParseTuple(args, "pnOKL:set_state", &en, &cap, &tid, &first_id, &offset)) {
        return NULL;
    }
    /* everything is checked before anything changes */
    if (cap < 1) {
        PyErr_Format(PyExc_ValueError, "Expected a positive capacity, but received %zd.", cap);
        return NULL;
    }
    if (!PyLong_Check(tid)) {
        PyErr_Format(PyExc_TypeError, "Expected an int trace id, but received %.100s.",
                     Py_TYPE(tid)->tp_name);
        return NULL;
    }
    offset_ns = offset;
    enabled = en;
    capacity = cap;
    Py_XSETREF(run_trace_id, Py_NewRef(tid));
    if (first_id != 0) {
        next_id = first_id;
    }
    Py_RETURN_NONE;
}

static PyObject *
forget_thread_buffer(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    PyObject *tsdict = PyThreadState_GetDict();
    if (tsdict != NULL && tls_key != NULL) {
        if (PyDict_DelItem(tsdict, tls_key) < 0) {
            PyErr_Clear();
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
now_ns(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(now_monotonic_ns());
}

static PyMethodDef module_methods[] = {
    {"install", install, METH_VARARGS, "Give the hot path its context var and callbacks."},
    {"set_state", set_state, METH_VARARGS, "(enabled, capacity, trace_id, first_id or 0, offset_ns)."},
    {"forget_thread_buffer", forget_thread_buffer, METH_NOARGS,
     "Drop the calling thread's record list (after a fork)."},
    {"now_ns", now_ns, METH_NOARGS, "The clock of the spans (CLOCK_MONOTONIC), in ns."},
    {"light_begin", light_begin, METH_VARARGS,
     "light_begin(owner, publish, full) -> bool: the thread's spans as aggregates until owner "
     "ends (see 'light steps')."},
    {NULL, NULL, 0, NULL},
};

static int
speedups_exec(PyObject *m)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    if (owner_interp != NULL && owner_interp != interp) {
        PyErr_SetString(PyExc_ImportError,
                        "ppetrace.tracing._speedups keeps process-wide state and loads in one "
                        "interpreter per process only; this one uses the pure-Python hot path.");
        return -1;
    }
    if (PyType_Ready(&SpanBaseType) < 0) {
        return -1;
    }
    if (str_unset == NULL) {
        str_unset = PyUnicode_InternFromString("UNSET");
        str_error = PyUnicode_InternFromString("ERROR");
        str_empty = PyUnicode_InternFromString("");
        if (str_unset == NULL || str_error == NULL || str_empty == NULL) {
            return -1;
        }
    }
    if (PyModule_AddObjectRef(m, "SpanBase", (PyObject *)&SpanBaseType) < 0) {
        return -1;
    }
    static int atfork_done = 0;
    if (!atfork_done) {
        int rc = pthread_atfork(NULL, NULL, forget_thread_state);
        if (rc != 0) {
            PyErr_Format(PyExc_ImportError,
                         "ppetrace.tracing._speedups could not register its fork handler "
                         "(pthread_atfork returned %d); ppetrace uses the pure-Python hot "
                         "path.", rc);
            return -1;
        }
        atfork_done = 1;
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
    .m_name = "ppetrace.tracing._speedups",
    .m_doc = "The hot path of ppetrace.trace, in C.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = speedups_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
