/* The native origin carrier: what WithOrigin.__call__ (monstack/_origin.py) does, in C.
 *
 * Included at the end of sysmon.c (3.12-3.15) and shim311.c (3.11), which define
 * ms_decref (the refcount drop that may free: their own table's _Py_Dealloc) before it.
 * Everything else it uses comes through its own table, `struct mc_ctx`, which the loader
 * (monstack/_origin.py, native_carrier) lays out by the names in ms_carrier_names and
 * keeps in a bytes object for the life of the process: the C-API functions (resolved by
 * name, as the blobs' tables are) and the objects the Python carrier uses (the
 * CURRENT_ORIGIN ContextVar, _snapshot.running_cell, attach_if_absent...).
 *
 * A carrier is an instance of monstack._origin.NativeCarrier, a subclass of WithOrigin
 * that adds one slot, invisible to Python, holding that bytes object: its last slot,
 * at tp_basicsize - sizeof(PyObject *). Its `__call__` is a method descriptor for
 * ms_carrier_call (METH_FASTCALL | METH_KEYWORDS); ms_carrier_new makes instances.
 *
 * ms_carrier_call runs `fn(*args, **kwargs)` with the snapshot as the current origin
 * (ContextVar set/reset) and in the thread's cell of _snapshot.RUNNING (what it held put
 * back after), and on an Exception calls attach_if_absent(exc, snap) before it
 * propagates. Being C, it adds no traceback entry (the Python carrier removes its own).
 * The thread finds its cell in its thread-state dict (PyThreadState_GetDict), under the
 * key `cell_key`, put there the first time from running_cell(): one lookup by an interned
 * string per job, where the ident's int object and three dict operations on RUNNING cost
 * about twice as much.
 *
 * ms_submit hands the carrier it made last out again (REUSED) to a job of the same
 * function with the same snapshot (capture() gives the same object again while nothing
 * changed: a loop submitting at one call site): one carrier for those jobs instead of
 * one each. A carrier is never changed by its calls, so sharing it is invisible to them.
 * The cache lets go of it when one of its calls ends (mc_reused_done), so it keeps
 * nothing alive much longer than the jobs do.
 */

/* X(return type, symbol, parameters): C-API functions the loader fills in. */
#define MC_FUNCS(X)                                                             \
    X(PyObject *, PyContextVar_Set, (PyObject *, PyObject *))                   \
    X(int, PyContextVar_Reset, (PyObject *, PyObject *))                        \
    X(PyObject *, PyThreadState_GetDict, (void))                                \
    X(PyObject *, PyDict_GetItemWithError, (PyObject *, PyObject *))            \
    X(int, PyDict_SetItem, (PyObject *, PyObject *, PyObject *))                \
    X(PyObject *, PyObject_Vectorcall, (PyObject *, PyObject *const *, size_t, PyObject *)) \
    X(void, PyErr_Fetch, (PyObject **, PyObject **, PyObject **))               \
    X(void, PyErr_NormalizeException, (PyObject **, PyObject **, PyObject **))  \
    X(void, PyErr_Restore, (PyObject *, PyObject *, PyObject *))                \
    X(int, PyErr_GivenExceptionMatches, (PyObject *, PyObject *))               \
    X(void, PyErr_Clear, (void))                                                \
    X(void, PyErr_SetString, (PyObject *, const char *))                       \
    X(int, PySet_Contains, (PyObject *, PyObject *))                            \
    X(int, PyDict_Contains, (PyObject *, PyObject *))                           \
    X(PyObject *, PyLong_FromVoidPtr, (void *))                                 \
    X(PyObject *, PyObject_VectorcallMethod, (PyObject *, PyObject *const *, size_t, PyObject *)) \
    X(PyObject *, PyObject_Call, (PyObject *, PyObject *, PyObject *))          \
    X(PyThreadState *, PyThreadState_Get, (void))                               \
    X(PyObject *, PyContext_Copy, (PyObject *))                                 \
    X(PyObject *, PyContext_CopyCurrent, (void))                                \
    X(PyObject *, PyObject_GetAttr, (PyObject *, PyObject *))

/* X(field): objects the loader stores (the loader keeps them alive). */
#define MC_OBJS(X)                                                              \
    X(var)             /* monstack._snapshot.CURRENT_ORIGIN */                  \
    X(cell_here)       /* monstack._snapshot.running_cell */                    \
    X(cell_key)        /* "monstack.running_cell.<id(RUNNING)>" (interned) */    \
    X(list)            /* list */                                               \
    X(attach)          /* monstack._origin.attach_if_absent */                  \
    X(exception)       /* Exception */                                          \
    X(none)            /* None */                                               \
    X(type_error)      /* TypeError */                                          \
    X(attribute_error) /* AttributeError */                                     \
    X(cls)             /* monstack._origin.NativeCarrier */                     \
    X(reused)          /* monstack._origin.REUSED: [a carrier ms_submit made, or None] */ \
    X(context_type)    /* contextvars.Context */

/* X(field): instance layout, as byte offsets from the object's start (from the loader). */
#define MC_OFFS(X) X(off_wrapped) X(off_snap) X(off_sent)

#define MC_MAGIC 0x6d6f6e6361727279ULL /* "moncarry" */

struct mc_ctx {
    uint64_t magic;
#define MC_DECL_F(ret, name, params) ret (*name) params;
    MC_FUNCS(MC_DECL_F)
#undef MC_DECL_F
#define MC_DECL_O(field) PyObject *field;
    MC_OBJS(MC_DECL_O)
#undef MC_DECL_O
#define MC_DECL_I(field) Py_ssize_t field;
    MC_OFFS(MC_DECL_I)
#undef MC_DECL_I
};

/* The fields of struct mc_ctx after the magic, in order ("f:" functions, "o:" objects,
 * "i:" offsets): the loader writes each by name, one pointer-sized word each. */
#define MC_NAME_F(ret, name, params) "f:" #name "\0"
#define MC_NAME_O(field) "o:" #field "\0"
#define MC_NAME_I(field) "i:" #field "\0"
__attribute__((used))
const char ms_carrier_names[] = MC_FUNCS(MC_NAME_F) MC_OBJS(MC_NAME_O) MC_OFFS(MC_NAME_I);
#undef MC_NAME_F
#undef MC_NAME_O
#undef MC_NAME_I

/* Facts the loader checks: the magic, sizeof(struct mc_ctx), where a bytes object's data
 * starts, where PyTypeObject's tp_basicsize, tp_alloc and tp_call are. */
__attribute__((used))
const int64_t ms_carrier_layout[] = {
    (int64_t)MC_MAGIC, (int64_t)sizeof(struct mc_ctx), (int64_t)offsetof(PyBytesObject, ob_sval),
    (int64_t)offsetof(PyTypeObject, tp_basicsize), (int64_t)offsetof(PyTypeObject, tp_alloc),
    (int64_t)offsetof(PyTypeObject, tp_call),
};

#define MC_SLOT(op, off) (*(PyObject **)((char *)(op) + (off)))

static inline struct mc_ctx *mc_ctx_of(PyObject *holder)
{
    return (struct mc_ctx *)((PyBytesObject *)holder)->ob_sval;
}

/* The bytes object holding the table: the carrier's last slot (NULL in an instance not
 * made by ms_carrier_new, e.g. object.__new__(NativeCarrier)). */
static inline PyObject *mc_holder(PyObject *self)
{
    return MC_SLOT(self, Py_TYPE(self)->tp_basicsize - (Py_ssize_t)sizeof(PyObject *));
}

/* ms_carrier_new(fn, snap): a new carrier (self: the bytes object holding the table). */
PyObject *ms_carrier_new(PyObject *holder, PyObject *const *args, Py_ssize_t nargs)
{
    struct mc_ctx *c = mc_ctx_of(holder);
    if (nargs != 2) {
        c->PyErr_SetString(c->type_error, "carrier_new(fn, snap) takes 2 arguments");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)c->cls;
    PyObject *self = cls->tp_alloc(cls, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(args[0]);
    MC_SLOT(self, c->off_wrapped) = args[0];
    Py_INCREF(args[1]);
    MC_SLOT(self, c->off_snap) = args[1];
    Py_INCREF(c->none);
    MC_SLOT(self, c->off_sent) = c->none;
    Py_INCREF(holder);
    MC_SLOT(self, cls->tp_basicsize - (Py_ssize_t)sizeof(PyObject *)) = holder;
    return self;
}

/* This thread's cell of _snapshot.RUNNING (a list of one item), a new reference; NULL
 * with an exception set where running_cell() raised or gave something else. A cell is
 * never replaced in RUNNING while its thread lives (running_cell() repairs one in place),
 * so the one kept in the thread-state dict stays the one other threads read. */
static PyObject *mc_cell(struct mc_ctx *c)
{
    PyObject *d = c->PyThreadState_GetDict(); /* (borrowed; NULL, no error, if none can be made) */
    if (d != NULL) {
        PyObject *found = c->PyDict_GetItemWithError(d, c->cell_key);
        if (found != NULL && Py_TYPE(found) == (PyTypeObject *)c->list && Py_SIZE(found) == 1) {
            Py_INCREF(found);
            return found;
        }
        if (found == NULL) {
            c->PyErr_Clear(); /* (a key's __eq__ could raise: running_cell() answers) */
        }
    }
    PyObject *cell = c->PyObject_Vectorcall(c->cell_here, NULL, 0, NULL);
    if (cell == NULL) {
        return NULL;
    }
    if (Py_TYPE(cell) != (PyTypeObject *)c->list || Py_SIZE(cell) != 1) {
        ms_decref(cell);
        c->PyErr_SetString(c->type_error, "running_cell() gave no list of one item");
        return NULL;
    }
    if (d != NULL && c->PyDict_SetItem(d, c->cell_key, cell) < 0) {
        c->PyErr_Clear(); /* (out of memory: found through running_cell() next time) */
    }
    return cell;
}

/* A call of `self` ends: REUSED lets go of its carrier if that is `self` (its other jobs
 * hold it, and so does this call's caller: never freed here), or if nothing else holds
 * it any more (a job that never ran: cancelled). Freeing that one may run Python code:
 * called with no exception set. */
static inline void mc_reused_done(struct mc_ctx *c, PyObject *self)
{
    PyObject *reused = c->reused;
    if (Py_SIZE(reused) != 1) {
        return;
    }
    PyObject *last = ((PyListObject *)reused)->ob_item[0];
    if (last == c->none || (last == self ? Py_REFCNT(last) <= 1 : Py_REFCNT(last) != 1)) {
        return;
    }
    Py_INCREF(c->none);
    ((PyListObject *)reused)->ob_item[0] = c->none;
    ms_decref(last);
}

/* The carrier's call: fn(*args) (vectorcall: args, nargs, kwnames) or, where targs is not
 * NULL, fn(*targs, **tkwargs) (tp_call: a tuple and a dict or NULL). */
static PyObject *mc_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                         PyObject *targs, PyObject *tkwargs)
{
    PyObject *holder = mc_holder(self);
    if (holder == NULL) {
        return NULL; /* no table to raise with: CPython reports a SystemError */
    }
    struct mc_ctx *c = mc_ctx_of(holder);
    PyObject *fn = MC_SLOT(self, c->off_wrapped);
    PyObject *snap = MC_SLOT(self, c->off_snap);
    if (fn == NULL || snap == NULL) {
        c->PyErr_SetString(c->attribute_error, fn == NULL ? "__wrapped__" : "_snap");
        return NULL;
    }
    Py_INCREF(fn); /* (the slots may be reassigned while fn runs) */
    Py_INCREF(snap);
    PyObject *res = NULL;
    PyObject *token = c->PyContextVar_Set(c->var, snap);
    if (token == NULL) {
        goto done;
    }
    PyObject *cell = mc_cell(c), *prev = NULL;
    if (cell == NULL) {
        c->PyErr_Clear(); /* (the job runs all the same; other threads do not see its origin) */
    } else {
        prev = ((PyListObject *)cell)->ob_item[0]; /* (the cell's reference, ours now) */
        Py_INCREF(snap);
        ((PyListObject *)cell)->ob_item[0] = snap;
    }

    res = targs != NULL ? c->PyObject_Call(fn, targs, tkwargs) : c->PyObject_Vectorcall(fn, args, (size_t)nargs, kwnames);

    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (res == NULL) {
        c->PyErr_Fetch(&type, &value, &tb);
        c->PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL && c->PyErr_GivenExceptionMatches(value, c->exception)) {
            PyObject *pair[2] = {value, snap};
            PyObject *r = c->PyObject_Vectorcall(c->attach, pair, 2, NULL);
            if (r == NULL) {
                c->PyErr_Clear();
            } else {
                ms_decref(r);
            }
        }
    }
    /* finally: the cell as it was, the origin reset (an exception set aside meanwhile) */
    if (cell != NULL) {
        if (Py_SIZE(cell) >= 1) { /* (resized meanwhile: running_cell() repairs it next time) */
            PyObject *now = ((PyListObject *)cell)->ob_item[0];
            ((PyListObject *)cell)->ob_item[0] = prev;
            if (now != NULL) {
                ms_decref(now);
            }
        } else {
            ms_decref(prev); /* (emptied meanwhile: left as it is) */
        }
        ms_decref(cell);
    }
    if (c->PyContextVar_Reset(c->var, token) < 0) {
        c->PyErr_Clear(); /* entered another context in between: leave it be */
    }
    ms_decref(token);
    mc_reused_done(c, self);
    if (res == NULL) {
        c->PyErr_Restore(type, value, tb);
    }
done:
    ms_decref(snap);
    ms_decref(fn);
    return res;
}

/* NativeCarrier.__call__(self, *args, **kwargs). */
PyObject *ms_carrier_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return mc_call(self, args, nargs, kwnames, NULL, NULL);
}

/* NativeCarrier's tp_call, which the loader sets in place of slot_tp_call (which looks
 * __call__ up on the type and calls that method per call): the same, from the tuple and
 * the dict a pool's worker calls its job with (fn(*args, **kwargs)). */
PyObject *ms_carrier_tp_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return mc_call(self, NULL, 0, NULL, args, kwargs);
}

/* ------------------------------------------------------------------ native replacements */

/* The native create_task and submit below are each the vectorcall of a Python
 * replacement (PyFunction_SetVectorcall; on 3.11 the field, set by the loader): the class
 * attribute stays the Python function (its code, signature, __wrapped__: what a tool that
 * wraps functions in place, like ddtrace, reads and rewrites), and CPython calls this
 * native code instead of evaluating the function's code, unless it inlines the call (it
 * does not for a function with another vectorcall: its version is 0; 3.11 inlines Python
 * calls when no eval_frame function is set, after the shim is gone: the Python code then
 * runs, with the same result). Off their common path, or where the function's code is no
 * longer the one it was made with (rewritten in place), they evaluate the function's own
 * code (the default vectorcall, read from a plain function: NR_PLAIN).
 *
 * Each finds its holder tuple, which starts with the items below, as item `at` of the list
 * in the function's closure cell number `cell` (fixed per replacement; the loader checks
 * the cell's name). */
enum {
    NR_TABLE, /* the carrier's table (bytes) */
    NR_CALL,  /* what the replacement replaced, called as Python would (binder) */
    NR_CODE,  /* the replacement's code when made */
    NR_LIST,  /* the list in its closure (which holds this tuple) */
    NR_PLAIN, /* a plain Python function: its vectorcall is the default one */
    NR_FIRST  /* the replacement's own items */
};

/* Flags of a code object that keep a function off the submit's short path (_origin.CO_KINDS). */
#define NR_CO_KINDS (CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR)

/* Facts the loader checks, per replacement: the holder's size, where a tuple's and a
 * list's items start, the cell and the index of the holder, where a function's code,
 * __dict__, closure, vectorcall and version are, where a code object's flags are, where a
 * cell's content is, the flags tested. */
#define NR_LAYOUT(size, cell, at)                                                       \
    {                                                                                   \
        (int64_t)(size), (int64_t)offsetof(PyTupleObject, ob_item),                     \
            (int64_t)offsetof(PyListObject, ob_item), (int64_t)(cell), (int64_t)(at),   \
            (int64_t)offsetof(PyFunctionObject, func_code),                             \
            (int64_t)offsetof(PyFunctionObject, func_dict),                             \
            (int64_t)offsetof(PyFunctionObject, func_closure),                          \
            (int64_t)offsetof(PyFunctionObject, vectorcall),                            \
            (int64_t)offsetof(PyFunctionObject, func_version),                          \
            (int64_t)offsetof(PyCodeObject, co_flags), (int64_t)offsetof(PyCellObject, ob_ref), \
            (int64_t)NR_CO_KINDS,                                                       \
    }

/* The holder of the replacement `self` (NULL where its closure does not hold one: only
 * if someone rewrote monstack's cell). */
static inline PyObject *nr_holder(PyFunctionObject *self, Py_ssize_t cell, Py_ssize_t at, Py_ssize_t size)
{
    PyObject *closure = self->func_closure;
    if (closure == NULL || Py_SIZE(closure) <= cell) {
        return NULL;
    }
    PyObject *list = ((PyCellObject *)((PyTupleObject *)closure)->ob_item[cell])->ob_ref;
    if (list == NULL || Py_SIZE(list) != at + 1) {
        return NULL;
    }
    PyObject *holder = ((PyListObject *)list)->ob_item[at];
    if (Py_TYPE(holder) != Py_TYPE(closure) || Py_SIZE(holder) != size ||
        ((PyTupleObject *)holder)->ob_item[NR_LIST] != list) {
        return NULL;
    }
    return holder;
}

/* The exception set: cleared (1) where it is an Exception; else left set (0: a
 * KeyboardInterrupt and the like propagate). */
static int nr_clear_exception(struct mc_ctx *c)
{
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    c->PyErr_Fetch(&type, &value, &tb);
    c->PyErr_NormalizeException(&type, &value, &tb);
    if (value == NULL || !c->PyErr_GivenExceptionMatches(value, c->exception)) {
        c->PyErr_Restore(type, value, tb);
        return 0;
    }
    if (type != NULL) {
        ms_decref(type);
    }
    ms_decref(value);
    if (tb != NULL) {
        ms_decref(tb);
    }
    return 1;
}

/* capture(): the snapshot (a new reference); NULL with *dropped set where it raised an
 * Exception (dropped: the work goes on without an origin, as in Python), NULL alone where
 * it raised anything else (KeyboardInterrupt and the like: it propagates). */
static PyObject *nr_capture(struct mc_ctx *c, PyObject *capture, int *dropped)
{
    PyObject *snap = c->PyObject_Vectorcall(capture, NULL, 0, NULL);
    if (snap != NULL) {
        return snap;
    }
    *dropped = nr_clear_exception(c);
    return NULL;
}

/* ------------------------------------------------------------------ create_task */

/* The native create_task: what the Python replacement of the event loop's create_task
 * (monstack/_points/asyncio.py, _make_create_task) does on its common path, in C, so a
 * task costs no Python call of monstack's: that replacement's vectorcall (above). Its
 * holder is the second item of the list in the replacement's closure cell `_native`
 * ([capture, holder]; cell 0: the names of free variables are sorted).
 *
 * The common path: the point on, exactly (loop, coro) positionally, keywords only
 * `name` and `context=None` (by identity with the interned names). Anything else
 * evaluates the replacement's code: `context=` a Context, eager_start=, odd callers.
 *
 * The task's context. The Python replacement sets the origin in the creator's context
 * around the creation, so that the task's copy of that context carries it: a Token and
 * two new HAMTs per task, and each task's context holds its own HAMT, which the
 * collector then traverses (about two thirds of what a task cost, counted). Where the
 * blob keeps snapshots (MS_TASK_CONTEXT, the 3.12+ callbacks) and the loop is one whose
 * create_task is asyncio's own (CT_OWN) with no task factory, the task gets that context
 * made here instead and passed as `context=`, which asyncio's Task takes as it is rather
 * than copying the current one (asyncio.tasks.Task must still be asyncio's: a class put
 * there may not take it): a copy of a template Context whose variables are the
 * creator's plus the origin. The template is made by the same set, copy and reset, at
 * the second creation with the same snapshot and the same creator's variables (the
 * first only notes them, by a weak reference: a creator that sets a variable before
 * each task never pays for a template it cannot use again), and kept beside the
 * snapshot cache (sysmon.c, last_ctx) with the variables it was made from: it serves
 * while the same snapshot is taken and the creator's context still has those very
 * variables (the same HAMT object, held, so equal by identity: HAMTs never change), and
 * goes when a creation on this path for that snapshot finds other variables, and when
 * that snapshot goes (its top frame, the nearest tracked one, returns or suspends;
 * another snapshot is built; uninstall). Tasks made at one call site then share one
 * HAMT, as copies of one context do. */
enum {
    CT_CAPTURE = NR_FIRST, /* the install's native snapshotter (the snapshot of its caller) */
    CT_AFTER,              /* after_create(snap, task, coro): an eager task done, or a done callback */
    CT_EXITS,              /* _backend.EXITS_REPORTED ([bool]) */
    CT_CORO,               /* types.CoroutineType */
    CT_LOOPS,              /* _threads.LOOPS (id(loop) -> weakref) */
    CT_NOTE_LOOP,          /* _threads.note_loop */
    CT_ON,                 /* _points.ON */
    CT_KEY,                /* "asyncio_tasks" */
    CT_NAME,               /* "name" (interned) */
    CT_CONTEXT,            /* "context" (interned) */
    CT_DONE,               /* "done" (interned) */
    CT_TRUE,               /* True */
    CT_OWN,                /* True: the replaced create_task is asyncio's own (BaseEventLoop's) */
    CT_FACTORY,            /* "_task_factory" (interned) */
    CT_KW_CONTEXT,         /* ("context",) */
    CT_KW_NAME_CONTEXT,    /* ("name", "context") */
    CT_TASKS,              /* vars(asyncio.tasks) */
    CT_TASK,               /* "Task" (interned) */
    CT_TASK_C,             /* asyncio.tasks._CTask (_asyncio.Task), or None */
    CT_TASK_PY,            /* asyncio.tasks._PyTask */
    CT_SIZE
};
#define CT_CELL 0
#define CT_HOLDER_AT 1

__attribute__((used))
const int64_t ms_create_task_layout[] = NR_LAYOUT(CT_SIZE, CT_CELL, CT_HOLDER_AT);

#ifndef MS_TASK_CONTEXT
#define MS_TASK_CONTEXT 0
#endif
#if MS_TASK_CONTEXT
/* Where PyContext keeps its variables (the loader checks it against the collector's view
 * of a Context: gc.get_referents). */
__attribute__((used))
const int64_t ms_task_context_layout[] = {(int64_t)offsetof(PyContext, ctx_vars)};

#define CT_VARS(ctx) ((PyObject *)((PyContext *)(ctx))->ctx_vars)

/* The context for a task `loop` creates with the origin `snap` (see "The task's context"
 * above): a new Context; or NULL, where the caller sets the origin around the creation
 * instead, with *note set where it is to note the variables that creation leaves
 * (ct_note) and *raised where an exception other than an Exception is to propagate. */
static PyObject *ct_task_context(struct mc_ctx *c, PyObject *holder, PyObject *loop, PyObject *snap, int *note,
                                 int *raised)
{
#define CT(i) (((PyTupleObject *)holder)->ob_item[(i)])
    if (CT(CT_OWN) != CT(CT_TRUE)) {
        return NULL;
    }
    /* asyncio's create_task passes `context` to asyncio.tasks.Task (read when called):
     * still one of asyncio's own classes, which take it */
    PyObject *cls = c->PyDict_GetItemWithError(CT(CT_TASKS), CT(CT_TASK));
    if (cls == NULL) {
        c->PyErr_Clear();
        return NULL;
    }
    if (cls != CT(CT_TASK_C) && cls != CT(CT_TASK_PY)) {
        return NULL;
    }
    PyObject *factory = c->PyObject_GetAttr(loop, CT(CT_FACTORY));
    if (factory == NULL) {
        *raised = !nr_clear_exception(c);
        return NULL;
    }
    int none = factory == c->none;
    ms_decref(factory);
    PyThreadState *ts = c->PyThreadState_Get();
    PyObject *cur = ts->context;
    PyObject *pair = NULL, *seen = NULL;
    if (!none || cur == NULL || Py_TYPE(cur) != (PyTypeObject *)c->context_type ||
        !ms_task_ctx_get(CT(CT_CAPTURE), snap, &pair, &seen)) {
        return NULL;
    }
    if (pair != NULL && PyTuple_GET_ITEM(pair, 0) == CT_VARS(cur)) {
        PyObject *ctx = c->PyContext_Copy(PyTuple_GET_ITEM(pair, 1));
        if (ctx == NULL) {
            c->PyErr_Clear();
        }
        return ctx;
    }
    if (CT_VARS(cur) != seen) {
        *note = 1; /* the first creation here with these variables: no template yet */
        return NULL;
    }
    /* The second: the template, by a set, copy and reset, as around a creation. It is
     * kept only where nothing changed the creator's variables in between (a collection
     * may run finalizers): the copy then has exactly those plus the origin, and the
     * reset leaves exactly those (a new HAMT: the one it is kept with). */
    PyObject *token = c->PyContextVar_Set(c->var, snap);
    if (token == NULL) {
        c->PyErr_Clear();
        return NULL;
    }
    PyObject *with = CT_VARS(cur); /* (the origin set) */
    Py_INCREF(with);
    PyObject *tmpl = c->PyContext_CopyCurrent();
    int same = tmpl != NULL && ts->context == cur && CT_VARS(cur) == with && CT_VARS(tmpl) == with;
    if (tmpl == NULL) {
        c->PyErr_Clear();
    }
    if (c->PyContextVar_Reset(c->var, token) < 0) {
        c->PyErr_Clear(); /* (entered another context in between: left as it is) */
        same = 0;
    }
    PyObject *vars = same && ts->context == cur ? CT_VARS(cur) : NULL;
    PyObject *ctx = NULL;
    if (vars != NULL) {
        Py_INCREF(vars);
        ctx = c->PyContext_Copy(tmpl);
        if (ctx == NULL) {
            c->PyErr_Clear();
        } else {
            ms_task_ctx_put(CT(CT_CAPTURE), snap, vars, tmpl);
        }
    }
    ms_decref(token);
    ms_decref(with);
    if (tmpl != NULL) {
        ms_decref(tmpl);
    }
    if (vars != NULL) {
        ms_decref(vars);
    }
    return ctx;
#undef CT
}

/* After a creation that set the origin around it (ct_task_context's *note): the
 * variables the creator's context has now, noted for `snap`. */
static void ct_note(struct mc_ctx *c, PyObject *holder, PyObject *snap)
{
    PyObject *cur = c->PyThreadState_Get()->context;
    if (cur != NULL && Py_TYPE(cur) == (PyTypeObject *)c->context_type) {
        ms_task_ctx_note(((PyTupleObject *)holder)->ob_item[CT_CAPTURE], snap, CT_VARS(cur));
    }
}

/* call(loop, coro, <the keywords>, context=ctx): `kwnames` NULL, or only "name" and
 * "context" (ms_create_task checked), with `args` their values after loop and coro. */
static PyObject *ct_call_in(struct mc_ctx *c, PyObject *holder, PyObject *const *args, PyObject *kwnames,
                            PyObject *ctx)
{
#define CT(i) (((PyTupleObject *)holder)->ob_item[(i)])
    PyObject *a[4] = {args[0], args[1], NULL, NULL};
    Py_ssize_t nkw = kwnames == NULL ? 0 : Py_SIZE(kwnames);
    PyObject *kw = kwnames;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = ((PyTupleObject *)kwnames)->ob_item[i];
        a[2 + i] = k == CT(CT_CONTEXT) ? ctx : args[2 + i];
    }
    if (nkw == 0) {
        a[2] = ctx;
        kw = CT(CT_KW_CONTEXT);
    } else if (nkw == 1 && ((PyTupleObject *)kwnames)->ob_item[0] == CT(CT_NAME)) {
        a[3] = ctx;
        kw = CT(CT_KW_NAME_CONTEXT);
    }
    return c->PyObject_Vectorcall(CT(NR_CALL), a, 2, kw);
#undef CT
}
#endif

PyObject *ms_create_task(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *holder = nr_holder((PyFunctionObject *)self, CT_CELL, CT_HOLDER_AT, CT_SIZE);
    if (holder == NULL) {
        return NULL; /* no table to raise with: CPython reports a SystemError */
    }
#define CT(i) (((PyTupleObject *)holder)->ob_item[(i)]) /* (no asserting macros: see build.py) */
    /* the function's own code, as CPython would run it */
    vectorcallfunc python = ((PyFunctionObject *)CT(NR_PLAIN))->vectorcall;
    if (((PyFunctionObject *)self)->func_code != CT(NR_CODE)) {
        return python(self, args, nargsf, kwnames); /* rewritten in place: theirs runs */
    }
    struct mc_ctx *c = mc_ctx_of(CT(NR_TABLE));
    PyObject *call = CT(NR_CALL);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int on = c->PySet_Contains(CT(CT_ON), CT(CT_KEY));
    if (on <= 0) {
        if (on < 0) {
            c->PyErr_Clear();
        }
        return python(self, args, nargsf, kwnames);
    }
    if (nargs != 2) {
        return python(self, args, nargsf, kwnames);
    }
    if (kwnames != NULL) {
        if (Py_SIZE(kwnames) > 2) {
            return python(self, args, nargsf, kwnames);
        }
        for (Py_ssize_t i = 0; i < Py_SIZE(kwnames); i++) {
            PyObject *k = ((PyTupleObject *)kwnames)->ob_item[i];
            if (k != CT(CT_NAME) && (k != CT(CT_CONTEXT) || args[nargs + i] != c->none)) {
                return python(self, args, nargsf, kwnames);
            }
        }
    }
    PyObject *loop = args[0], *coro = args[1];

    /* _threads.note_loop(loop) unless known (one dict lookup) */
    PyObject *key = c->PyLong_FromVoidPtr(loop);
    int known = key == NULL ? -1 : c->PyDict_Contains(CT(CT_LOOPS), key);
    if (key != NULL) {
        ms_decref(key);
    }
    if (known <= 0) {
        if (known < 0) {
            c->PyErr_Clear();
        }
        PyObject *r = c->PyObject_Vectorcall(CT(CT_NOTE_LOOP), args, 1, NULL);
        if (r == NULL) {
            c->PyErr_Clear();
        } else {
            ms_decref(r);
        }
    }

    /* snap = capture(); on an Exception: call through, with no origin */
    int dropped = 0;
    PyObject *snap = nr_capture(c, CT(CT_CAPTURE), &dropped);
    if (snap == NULL) {
        return dropped ? c->PyObject_Vectorcall(call, args, nargsf, kwnames) : NULL;
    }
    if (snap == c->none) {
        ms_decref(snap);
        return c->PyObject_Vectorcall(call, args, nargsf, kwnames);
    }

    PyObject *task;
#if MS_TASK_CONTEXT
    /* a context made for the task, carrying the origin */
    int note = 0, raised = 0;
    PyObject *tctx = ct_task_context(c, holder, loop, snap, &note, &raised);
    if (tctx != NULL) {
        task = ct_call_in(c, holder, args, kwnames, tctx);
        ms_decref(tctx);
        goto made;
    }
    if (raised) {
        ms_decref(snap);
        return NULL;
    }
#endif
    /* the origin is current while the task copies the context */
    PyObject *token = c->PyContextVar_Set(c->var, snap);
    if (token == NULL) {
        c->PyErr_Clear();
        ms_decref(snap);
        return c->PyObject_Vectorcall(call, args, nargsf, kwnames);
    }
    task = c->PyObject_Vectorcall(call, args, nargsf, kwnames);
    {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        c->PyErr_Fetch(&type, &value, &tb);
        if (c->PyContextVar_Reset(c->var, token) < 0) {
            c->PyErr_Clear(); /* entered another context in between: leave it be */
        }
#if MS_TASK_CONTEXT
        else if (note) {
            ct_note(c, holder, snap);
        }
#endif
        ms_decref(token);
        c->PyErr_Restore(type, value, tb);
    }
#if MS_TASK_CONTEXT
made:
#endif
    if (task == NULL) {
        ms_decref(snap);
        return NULL;
    }

    /* an eager task done already, a backend that reports no coroutine exits, a coroutine
     * that is no Python coroutine: after_create (Python) attaches or adds the callback */
    PyObject *self_arg[1] = {task};
    PyObject *done = c->PyObject_VectorcallMethod(CT(CT_DONE), self_arg, 1, NULL);
    if (done == NULL) {
        c->PyErr_Clear();
    } else {
        PyObject *t = CT(CT_TRUE);
        if (done == t || ((PyListObject *)CT(CT_EXITS))->ob_item[0] != t || Py_TYPE(coro) != (PyTypeObject *)CT(CT_CORO)) {
            PyObject *three[3] = {snap, task, coro};
            PyObject *r = c->PyObject_Vectorcall(CT(CT_AFTER), three, 3, NULL);
            if (r == NULL) {
                c->PyErr_Clear();
            } else {
                ms_decref(r);
            }
        }
        ms_decref(done);
    }
    ms_decref(snap);
    return task;
#undef CT
}

/* ------------------------------------------------------------------ submit */

/* The native submit: what the Python replacement of ThreadPoolExecutor.submit
 * (monstack/_points/futures.py, _make_submit) does on its short path, in C, so a job
 * costs no Python call of monstack's on the submitting side.
 *
 * That replacement's vectorcall (see "native replacements" above). Its holder is the
 * third item of the list in the function's closure cell SB_CELL (`fast`: [capture,
 * carrier constructor, holder]).
 *
 * The short path (the Python one's, exactly): the point on, the pool's type exactly
 * ThreadPoolExecutor (no subclass: not an interpreter pool), fn a plain Python function
 * whose code is no generator/coroutine and whose __dict__ (exactly a dict, or none yet)
 * has no non-None _is_coroutine_marker / _is_coroutine. There the job is queued as a
 * native carrier (ms_carrier_new) of fn and a snapshot of the submitter. */
enum {
    SB_TABLE = NR_TABLE,
    SB_CALL = NR_CALL,
    SB_CODE = NR_CODE,
    SB_FAST = NR_LIST,
    SB_PLAIN = NR_PLAIN,
    SB_CAPTURE = NR_FIRST, /* the install's native snapshotter (the snapshot of its caller) */
    SB_ON,        /* _points.ON */
    SB_KEY,       /* "thread_pool" */
    SB_POOL,      /* concurrent.futures.thread.ThreadPoolExecutor */
    SB_FUNCTION,  /* types.FunctionType */
    SB_DICT,      /* dict */
    SB_MARKER,    /* "_is_coroutine_marker" (interned) */
    SB_COROUTINE, /* "_is_coroutine" (interned) */
    SB_SIZE
};

/* The closure cell of the replacement that holds `fast`, and the holder's index there. */
#define SB_CELL 1
#define SB_HOLDER_AT 2
/* At most this many arguments (positional and keyword) on the short path: their copy,
 * with fn replaced by the carrier, lives on the C stack. */
#define SB_MAX_ARGS 16

__attribute__((used))
const int64_t ms_submit_layout[] = NR_LAYOUT(SB_SIZE, SB_CELL, SB_HOLDER_AT);

PyObject *ms_submit(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyFunctionObject *func = (PyFunctionObject *)self;
    PyObject *holder = nr_holder(func, SB_CELL, SB_HOLDER_AT, SB_SIZE);
    if (holder == NULL) {
        return NULL; /* no table to raise with: CPython reports a SystemError */
    }
#define SB(i) (((PyTupleObject *)holder)->ob_item[(i)]) /* (no asserting macros: see build.py) */
    /* the function's own code, as CPython would run it */
    vectorcallfunc python = ((PyFunctionObject *)SB(SB_PLAIN))->vectorcall;
    if (func->func_code != SB(SB_CODE)) {
        return python(self, args, nargsf, kwnames); /* rewritten in place: theirs runs */
    }
    PyObject *table = SB(SB_TABLE);
    struct mc_ctx *c = mc_ctx_of(table);
    PyObject *call = SB(SB_CALL);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames == NULL ? 0 : Py_SIZE(kwnames));
    int on = c->PySet_Contains(SB(SB_ON), SB(SB_KEY));
    if (on <= 0) {
        if (on < 0) {
            c->PyErr_Clear();
        }
        if (nargs >= 2) {
            return c->PyObject_Vectorcall(call, args, nargsf, kwnames);
        }
        return python(self, args, nargsf, kwnames); /* (its TypeError, as Python gives it) */
    }
    if (nargs < 2 || total > SB_MAX_ARGS || Py_TYPE(args[0]) != (PyTypeObject *)SB(SB_POOL) ||
        Py_TYPE(args[1]) != (PyTypeObject *)SB(SB_FUNCTION)) {
        return python(self, args, nargsf, kwnames);
    }
    PyObject *fn = args[1];
    PyFunctionObject *fn_func = (PyFunctionObject *)fn;
    if (((PyCodeObject *)fn_func->func_code)->co_flags & NR_CO_KINDS) {
        return python(self, args, nargsf, kwnames);
    }
    PyObject *attrs = fn_func->func_dict;
    if (attrs != NULL) {
        if (Py_TYPE(attrs) != (PyTypeObject *)SB(SB_DICT)) {
            return python(self, args, nargsf, kwnames);
        }
        if (((PyDictObject *)attrs)->ma_used != 0) {
            for (int i = SB_MARKER; i <= SB_COROUTINE; i++) {
                PyObject *v = c->PyDict_GetItemWithError(attrs, SB(i));
                if (v == NULL) {
                    c->PyErr_Clear(); /* (a str key: no error but a missing entry) */
                } else if (v != c->none) {
                    return python(self, args, nargsf, kwnames);
                }
            }
        }
    }

    /* snap = capture(); on an Exception: call through with fn unwrapped */
    int dropped = 0;
    PyObject *snap = nr_capture(c, SB(SB_CAPTURE), &dropped);
    if (snap == NULL) {
        return dropped ? c->PyObject_Vectorcall(call, args, nargsf, kwnames) : NULL;
    }
    /* the carrier made last, if it carries fn with this snapshot; else a new one, kept */
    PyObject *carrier, *reused = c->reused;
    PyObject *last = Py_SIZE(reused) == 1 ? ((PyListObject *)reused)->ob_item[0] : NULL;
    if (last != NULL && Py_TYPE(last) == (PyTypeObject *)c->cls && MC_SLOT(last, c->off_wrapped) == fn &&
        MC_SLOT(last, c->off_snap) == snap && MC_SLOT(last, c->off_sent) == c->none && mc_holder(last) == table) {
        Py_INCREF(last);
        carrier = last;
        ms_decref(snap);
    } else {
        PyObject *pair[2] = {fn, snap};
        carrier = ms_carrier_new(table, pair, 2); /* (a collection may run Python code here) */
        ms_decref(snap);
        if (carrier == NULL) {
            return NULL;
        }
        if (Py_SIZE(reused) == 1) {
            last = ((PyListObject *)reused)->ob_item[0]; /* again: that code may have submitted */
            Py_INCREF(carrier);
            ((PyListObject *)reused)->ob_item[0] = carrier;
            ms_decref(last); /* (may run Python code: REUSED is consistent) */
        }
    }
    /* the same arguments with the carrier in fn's place (one free slot in front, so the
     * callee may prepend a bound argument: PY_VECTORCALL_ARGUMENTS_OFFSET) */
    PyObject *buf[SB_MAX_ARGS + 1];
    for (Py_ssize_t i = 0; i < total; i++) {
        buf[i + 1] = args[i];
    }
    buf[2] = carrier;
    PyObject *res = c->PyObject_Vectorcall(call, buf + 1, (size_t)nargs | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
    ms_decref(carrier);
    return res;
#undef SB
}
