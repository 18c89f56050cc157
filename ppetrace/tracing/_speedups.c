/*
 * The hot path of ppetrace.trace in C: entering and leaving a traced block.
 *
 * ppetrace/_recorder.py holds the reference implementation in pure Python and
 * uses this module when it was built (see setup.py; the build is optional).
 * Both do the same work, in the same order:
 *
 *   enter: read the OpenTelemetry context (a ContextVar holding a dict), take
 *          the parent span from it, give the block the next span id, set a
 *          copy of the context with the block as the current span, read the
 *          monotonic clock (the clock of time.perf_counter_ns).
 *   exit:  read the clock, reset the context, append the finished span to its
 *          thread's record list as an exporters.SpanRow (epoch times, thread
 *          id, attributes, status and the exception text if the block raised)
 *          and call the recorder back when that list is full.
 *
 * Everything else (flushing, exporters, the OpenTelemetry span API of the
 * object) stays in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *arg;
    PyObject *trace_id;
    PyObject *error;
    PyObject *token;
    unsigned long long span_id;
    unsigned long long parent_id;
    long long start_ns;
    long long end_ns;
} SpanBase;

static PyTypeObject SpanBaseType;

/* Recorder state, set from Python by install() and set_state(). */
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
static PyObject *describe_cb = NULL;       /* (arg) -> reduced arg */
static PyObject *error_text_cb = NULL;     /* (exc) -> str */
static PyObject *row_type = NULL;          /* exporters.SpanRow, a tuple subclass */
static PyObject *attributes_cb = NULL;     /* (arg) -> Mapping, for args that are not dicts */
static PyObject *empty_attrs = NULL;       /* the shared empty Mapping for arg None */
static PyObject *str_unset = NULL, *str_error = NULL, *str_empty = NULL;
static long long offset_ns = 0;            /* monotonic ns -> epoch ns */

static inline long long
now_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
}

static inline int
is_primitive(PyObject *v)
{
    return PyUnicode_CheckExact(v) || PyLong_CheckExact(v) || PyBool_Check(v) ||
           PyFloat_CheckExact(v);
}

static int
keep_arg(PyObject *arg)
{
    /* None, a primitive, or a dict whose values are all None or primitives: kept as is.
     * Anything else goes through describe() so that no reference to objects such as
     * tensors is kept until the flush. */
    if (arg == Py_None || is_primitive(arg)) {
        return 1;
    }
    if (PyDict_CheckExact(arg)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(arg, &pos, &key, &value)) {
            if (value != Py_None && !is_primitive(value)) {
                return 0;
            }
        }
        return 1;
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
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    if (keep_arg(arg)) {
        Py_INCREF(arg);
    }
    else {
        arg = PyObject_CallOneArg(describe_cb, arg);
        if (arg == NULL) {
            return -1;
        }
    }
    Py_XSETREF(self->arg, arg);
    return 0;
}

static PyObject *
Span_enter(SpanBase *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *ctx = NULL, *parent, *new_ctx, *token;
    if (self->name == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Expected an initialised ppetrace.trace, but __init__ was not run. A "
                        "subclass's __init__ must call super().__init__(event_name, arg).");
        return NULL;
    }
    if (self->token != NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Expected a ppetrace.trace instance that is not already entered, but "
                        "this one is open. Create one per block: with ppetrace.trace(name): ...");
        return NULL;
    }
    Py_CLEAR(self->error);
    if (!enabled) {
        Py_INCREF(self);
        return (PyObject *)self;
    }
    if (PyContextVar_Get(ctxvar, NULL, &ctx) < 0) {
        return NULL;
    }
    parent = NULL;
    if (ctx != NULL) {
        if (!PyDict_Check(ctx)) {
            Py_DECREF(ctx);
            PyErr_SetString(PyExc_TypeError,
                            "ppetrace expected the OpenTelemetry context to be a dict.");
            return NULL;
        }
        parent = PyDict_GetItemWithError(ctx, span_key); /* borrowed */
        if (parent == NULL && PyErr_Occurred()) {
            Py_DECREF(ctx);
            return NULL;
        }
    }
    if (parent == NULL) {
        Py_INCREF(run_trace_id);
        Py_XSETREF(self->trace_id, run_trace_id);
        self->parent_id = 0;
    }
    else if (PyObject_TypeCheck(parent, &SpanBaseType)) {
        SpanBase *p = (SpanBase *)parent;
        Py_XINCREF(p->trace_id);
        Py_XSETREF(self->trace_id, p->trace_id);
        self->parent_id = p->span_id;
    }
    else {
        PyObject *res = PyObject_CallOneArg(foreign_parent_cb, parent);
        if (res == NULL) {
            Py_DECREF(ctx);
            return NULL;
        }
        if (res == Py_None) {
            Py_INCREF(run_trace_id);
            Py_XSETREF(self->trace_id, run_trace_id);
            self->parent_id = 0;
        }
        else if (PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 2) {
            PyObject *tid = PyTuple_GET_ITEM(res, 0);
            unsigned long long pid = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(res, 1));
            if (pid == (unsigned long long)-1 && PyErr_Occurred()) {
                Py_DECREF(res);
                Py_DECREF(ctx);
                return NULL;
            }
            Py_INCREF(tid);
            Py_XSETREF(self->trace_id, tid);
            self->parent_id = pid;
        }
        else {
            Py_DECREF(res);
            Py_DECREF(ctx);
            PyErr_SetString(PyExc_TypeError,
                            "ppetrace expected (trace_id, parent_id) or None from the "
                            "foreign-parent callback.");
            return NULL;
        }
        Py_DECREF(res);
    }
    self->span_id = next_id++;
    new_ctx = ctx != NULL ? PyDict_Copy(ctx) : PyDict_New();
    Py_XDECREF(ctx);
    if (new_ctx == NULL) {
        return NULL;
    }
    if (PyDict_SetItem(new_ctx, span_key, (PyObject *)self) < 0) {
        Py_DECREF(new_ctx);
        return NULL;
    }
    token = PyContextVar_Set(ctxvar, new_ctx);
    Py_DECREF(new_ctx);
    if (token == NULL) {
        return NULL;
    }
    Py_XSETREF(self->token, token);
    self->start_ns = now_monotonic_ns();
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *
thread_records(void)
{
    /* the calling thread's record list (borrowed), made on first use */
    PyObject *tsdict = PyThreadState_GetDict();
    PyObject *records;
    if (tsdict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ppetrace found no thread state dict.");
        return NULL;
    }
    records = PyDict_GetItemWithError(tsdict, tls_key);
    if (records != NULL || PyErr_Occurred()) {
        return records;
    }
    records = PyObject_CallNoArgs(new_buffer_cb);
    if (records == NULL) {
        return NULL;
    }
    if (!PyList_CheckExact(records) || PyDict_SetItem(tsdict, tls_key, records) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "ppetrace expected a list from new_buffer().");
        }
        Py_DECREF(records);
        return NULL;
    }
    Py_DECREF(records); /* the thread-state dict holds it */
    return records;
}

static PyObject *
make_row(SpanBase *self)
{
    /* exporters.SpanRow(name, span_id, parent_id, trace_id, start_ns, end_ns, tid,
     *                   attributes, status, error) */
    PyTypeObject *type = (PyTypeObject *)row_type;
    PyObject *row, *attrs, *item;
    PyObject *arg = self->arg != NULL ? self->arg : Py_None;
    if (PyDict_CheckExact(arg)) {
        attrs = Py_NewRef(arg);
    }
    else if (arg == Py_None) {
        attrs = Py_NewRef(empty_attrs);
    }
    else {
        attrs = PyObject_CallOneArg(attributes_cb, arg);
        if (attrs == NULL) {
            return NULL;
        }
    }
    row = type->tp_alloc(type, 10);
    if (row == NULL) {
        Py_DECREF(attrs);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 0, Py_NewRef(self->name));
    PyTuple_SET_ITEM(row, 3, Py_NewRef(self->trace_id));
    PyTuple_SET_ITEM(row, 7, attrs);
    if (self->error != NULL && self->error != Py_None) {
        PyTuple_SET_ITEM(row, 8, Py_NewRef(str_error));
        PyTuple_SET_ITEM(row, 9, Py_NewRef(self->error));
    }
    else {
        PyTuple_SET_ITEM(row, 8, Py_NewRef(str_unset));
        PyTuple_SET_ITEM(row, 9, Py_NewRef(str_empty));
    }
#define SET_NUM(i, expr)                \
    item = (expr);                      \
    if (item == NULL) {                 \
        Py_DECREF(row);                 \
        return NULL;                    \
    }                                   \
    PyTuple_SET_ITEM(row, i, item);
    SET_NUM(1, PyLong_FromUnsignedLongLong(self->span_id));
    SET_NUM(2, PyLong_FromUnsignedLongLong(self->parent_id));
    SET_NUM(4, PyLong_FromLongLong(self->start_ns + offset_ns));
    SET_NUM(5, PyLong_FromLongLong(self->end_ns + offset_ns));
    SET_NUM(6, PyLong_FromUnsignedLong(PyThread_get_thread_native_id()));
#undef SET_NUM
    return row;
}

static PyObject *
Span_exit(SpanBase *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long end;
    PyObject *records, *exc, *row;
    int rc;
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
    if (PyContextVar_Reset(ctxvar, self->token) < 0) {
        /* left in another context than it was entered in: still recorded */
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) {
            return NULL;
        }
        PyErr_Clear();
    }
    Py_CLEAR(self->token);
    self->end_ns = end;
    exc = args[1];
    if (exc != Py_None) {
        PyObject *text = PyObject_CallOneArg(error_text_cb, exc);
        if (text == NULL) {
            /* never replace the block's own exception */
            PyErr_Clear();
            text = PyUnicode_FromFormat("%.200s: <unprintable>", Py_TYPE(exc)->tp_name);
            if (text == NULL) {
                goto lost;
            }
        }
        Py_XSETREF(self->error, text);
    }
    records = thread_records();
    if (records == NULL) {
        goto lost;
    }
    row = make_row(self);
    if (row == NULL) {
        goto lost;
    }
    rc = PyList_Append(records, row);
    Py_DECREF(row);
    if (rc < 0) {
        goto lost;
    }
    if (PyList_GET_SIZE(records) >= capacity) {
        PyObject *res = PyObject_CallOneArg(on_full_cb, records);
        if (res == NULL) {
            goto lost;
        }
        Py_DECREF(res);
    }
    Py_RETURN_NONE;
lost:
    /* Telemetry never breaks training: report the failure, keep the block's outcome. */
    PyErr_WriteUnraisable((PyObject *)self);
    Py_RETURN_NONE;
}

static int
Span_traverse(SpanBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->arg);
    Py_VISIT(self->trace_id);
    Py_VISIT(self->error);
    Py_VISIT(self->token);
    return 0;
}

static int
Span_clear(SpanBase *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->arg);
    Py_CLEAR(self->trace_id);
    Py_CLEAR(self->error);
    Py_CLEAR(self->token);
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
    {"__enter__", (PyCFunction)Span_enter, METH_NOARGS, "Start the span."},
    {"__exit__", (PyCFunction)(void (*)(void))Span_exit, METH_FASTCALL, "End the span."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Span_members[] = {
    {"name", T_OBJECT, offsetof(SpanBase, name), READONLY, "the event name"},
    {"arg", T_OBJECT, offsetof(SpanBase, arg), READONLY, "the (reduced) arg"},
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
    PyObject *cv, *key, *tk, *nb, *of, *fp, *ds, *et, *rt, *ac, *ea;
    if (!PyArg_ParseTuple(args, "OUUOOOOOOOO:install", &cv, &key, &tk, &nb, &of, &fp, &ds, &et,
                          &rt, &ac, &ea)) {
        return NULL;
    }
    if (!PyType_Check(rt) || !PyType_IsSubtype((PyTypeObject *)rt, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "install() expected a tuple subclass for the row type.");
        return NULL;
    }
    Py_INCREF(rt);
    Py_XSETREF(row_type, rt);
    Py_INCREF(ac);
    Py_XSETREF(attributes_cb, ac);
    Py_INCREF(ea);
    Py_XSETREF(empty_attrs, ea);
    Py_INCREF(cv);
    Py_XSETREF(ctxvar, cv);
    Py_INCREF(key);
    Py_XSETREF(span_key, key);
    Py_INCREF(tk);
    Py_XSETREF(tls_key, tk);
    Py_INCREF(nb);
    Py_XSETREF(new_buffer_cb, nb);
    Py_INCREF(of);
    Py_XSETREF(on_full_cb, of);
    Py_INCREF(fp);
    Py_XSETREF(foreign_parent_cb, fp);
    Py_INCREF(ds);
    Py_XSETREF(describe_cb, ds);
    Py_INCREF(et);
    Py_XSETREF(error_text_cb, et);
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
    offset_ns = offset;
    if (cap < 1) {
        PyErr_Format(PyExc_ValueError, "Expected a positive capacity, but received %zd.", cap);
        return NULL;
    }
    enabled = en;
    capacity = cap;
    Py_INCREF(tid);
    Py_XSETREF(run_trace_id, tid);
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "ppetrace.tracing._speedups", "The hot path of ppetrace.trace, in C.", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m;
    if (PyType_Ready(&SpanBaseType) < 0) {
        return NULL;
    }
    m = PyModule_Create(&speedups_module);
    if (m == NULL) {
        return NULL;
    }
    str_unset = PyUnicode_InternFromString("UNSET");
    str_error = PyUnicode_InternFromString("ERROR");
    str_empty = PyUnicode_InternFromString("");
    if (str_unset == NULL || str_error == NULL || str_empty == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SpanBaseType);
    if (PyModule_AddObject(m, "SpanBase", (PyObject *)&SpanBaseType) < 0) {
        Py_DECREF(&SpanBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
