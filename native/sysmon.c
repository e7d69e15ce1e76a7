/* monstack's native sys.monitoring callbacks for CPython 3.12 to 3.15 (GIL builds).
 *
 * Built by native/build.py into a position-independent, relocation-free blob
 * (monstack/_native/sysmon3XX-<arch>.bin, manifest sysmon3XX.json). The code never names an external
 * symbol: every C-API function and object it uses is reached through `API` (struct
 * ms_api below), a table the loader (monstack/_native.py) fills in before it makes the
 * pages read+execute. All mutable state lives in heap memory (struct ms_state), owned
 * by a capsule that is the `self` of the Python-callable functions.
 *
 * The callbacks keep exactly the shadow stack of the pure-Python callbacks in
 * monstack/_sysmon.py (see that file and monstack/_stack.py):
 *   - node = (code, parent, parent_lasti), per-thread cell = TLS.cell = [top];
 *   - push on PY_START / PY_RESUME / PY_THROW, pop on PY_RETURN / PY_YIELD / PY_UNWIND;
 *   - tracking decision per file through the policy's own decision dict; undecided
 *     code asks the Python policy once (the `decide` helper); filtered code gets
 *     DISABLE for its local events;
 *   - seeding a thread and resynchronising after a mismatched pop call the Python
 *     helpers `seed` / `resync` (rare slow paths, same rules as the Python callbacks).
 * One improvement: a push records the real call site (parent_lasti) instead of UNKNOWN
 * when the caller frame -- the nearest one past C-stack entry frames and known-filtered
 * code, as capture's _fill walks f_back -- is a complete Python frame running the top
 * node's code and the top node's own call site is known (so a node with a known call
 * site is always part of a chain that was verified; the one blind spot this cannot see
 * -- frames CPython links without events on a throw into a delegating generator -- is
 * closed by the (Python) PY_THROW callback, which rebuilds the stack from the real frames,
 * and, for a frame a throw() method runs in, called from C before any PY_THROW, by not
 * trusting a caller that is such a linked frame: the push records UNKNOWN, and capture's
 * _fill rebuilds when it meets one).
 *
 * Hot paths (tracked push/pop) call no Python code. Callbacks are entered with no
 * exception pending (CPython stashes it around the call) and always return a
 * non-NULL result with no exception set: an internal error is handed to `on_error`
 * (which warns once and uninstalls), exactly as the Python callbacks do.
 */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <internal/pycore_gc.h>
#include <internal/pycore_context.h> /* (PyContext.ctx_vars: carrier.h's create_task) */
#include <stddef.h>
#include <stdint.h>
#include "compat.h" /* the version facts (MS_HAS_...) and accessors; the 3.14+ headers */
#include <opcode.h>

#ifdef Py_GIL_DISABLED
#error "free-threaded builds are not supported"
#endif
#if defined(Py_DEBUG) || defined(Py_TRACE_REFS) || defined(Py_REF_DEBUG)
#error "debug builds are not supported"
#endif

#pragma GCC visibility push(hidden)

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---------------------------------------------------------------- the table */
/* X(return type, symbol, parameters): C-API functions, filled with their addresses. */
#define MS_FUNCS(X)                                                             \
    X(PyThreadState *, PyThreadState_Get, (void))                               \
    X(PyObject *, PyTuple_New, (Py_ssize_t))                                    \
    X(PyObject *, PyLong_FromLong, (long))                                      \
    X(void, _Py_Dealloc, (PyObject *))                                          \
    X(PyObject *, PyDict_GetItemWithError, (PyObject *, PyObject *))            \
    X(PyObject *, PyObject_GetAttr, (PyObject *, PyObject *))                   \
    X(PyObject *, PyObject_Vectorcall, (PyObject *, PyObject *const *, size_t, PyObject *)) \
    X(int, PyObject_IsTrue, (PyObject *))                                       \
    X(PyObject *, PyErr_GetRaisedException, (void))                             \
    X(void, PyErr_SetString, (PyObject *, const char *))                        \
    X(int, PyErr_ExceptionMatches, (PyObject *))                                \
    X(void, PyErr_Clear, (void))                                                \
    X(PyObject *, PyErr_Occurred, (void))                                       \
    X(void *, PyCapsule_GetPointer, (PyObject *, const char *))                 \
    X(PyObject *, PyCapsule_New, (void *, const char *, PyCapsule_Destructor))  \
    X(int, PyUnstable_Code_SetExtra, (PyObject *, Py_ssize_t, void *))          \
    X(Py_ssize_t, PyLong_AsSsize_t, (PyObject *))                               \
    X(int, PyContextVar_Get, (PyObject *, PyObject *, PyObject **))             \
    X(void *, PyMem_Calloc, (size_t, size_t))                                   \
    X(void, PyMem_Free, (void *))                                               \
    X(void, PyObject_GC_UnTrack, (void *))                                      \
    X(void, PyObject_GC_Del, (void *))                                          \
    X(void *, PyObject_Malloc, (size_t))                                        \
    X(void, PyObject_Free, (void *))                                            \
    X(PyVarObject *, PyObject_InitVar, (PyVarObject *, PyTypeObject *, Py_ssize_t)) \
    X(PyObject *, PyErr_NoMemory, (void))                                       \
    X(PyObject *, PyWeakref_NewRef, (PyObject *, PyObject *))                   \
    X(int, PyObject_CallFinalizerFromDealloc, (PyObject *))                     \
    MS_FUNCS_VERSIONED(X)
#if MS_HAS_REFTRACER
#define MS_FUNCS_VERSIONED(X) X(PyRefTracer, PyRefTracer_GetTracer, (void **))
#else
#define MS_FUNCS_VERSIONED(X)
#endif

/* X(field, symbol): addresses of C-API objects (&symbol). */
#define MS_OBJS(X)                                                              \
    X(none, _Py_NoneStruct)                                                     \
    X(true_, _Py_TrueStruct)                                                    \
    X(false_, _Py_FalseStruct)                                                  \
    X(tuple_type, PyTuple_Type)                                                 \
    X(long_type, PyLong_Type)                                                   \
    X(list_type, PyList_Type)                                                   \
    X(dict_type, PyDict_Type)                                                   \
    X(code_type, PyCode_Type)                                                   \
    X(capsule_type, PyCapsule_Type)                                             \
    X(cfunction_type, PyCFunction_Type)                                         \
    X(type_type, PyType_Type)

/* X(field, symbol): values of C-API pointer variables (*symbol). */
#define MS_PTRS(X)                                                              \
    X(exc_attribute, PyExc_AttributeError)                                      \
    X(exc_type, PyExc_TypeError)                                                \
    X(exc_exception, PyExc_Exception)

#define MS_MAGIC 0x6d6f6e73796d6f6eULL /* "monsymon" */

struct ms_api {
    uint64_t magic;
    uint64_t nslots;
#define DECL_F(ret, name, params) ret (*name) params;
    MS_FUNCS(DECL_F)
#define DECL_O(field, sym) void *field;
    MS_OBJS(DECL_O)
    MS_PTRS(DECL_O)
};

#define NSLOTS ((sizeof(struct ms_api) - 2 * sizeof(uint64_t)) / sizeof(void *))

/* The table, at symbol ms_table; the names of its slots, in order, at ms_table_names:
 * "f:<symbol>" = address of a function, "o:<symbol>" = address of an object,
 * "p:<symbol>" = value of a pointer variable. */
__attribute__((section(".data.ms_table"), aligned(64), used))
struct ms_api ms_table = {MS_MAGIC, NSLOTS};
#define API ms_table

#define NAME_F(ret, name, params) "f:" #name "\0"
#define NAME_O(field, sym) "o:" #sym "\0"
#define NAME_P(field, sym) "p:" #sym "\0"
__attribute__((used))
const char ms_table_names[] = MS_FUNCS(NAME_F) MS_OBJS(NAME_O) MS_PTRS(NAME_P);

/* Interpreter layout this code was compiled for ("name=value\0" ...): the loader
 * checks each one it can observe against the running interpreter. */
#define STR2(x) #x
#define STR(x) STR2(x)
/* (TS_FRAME_EXPR, IF_CODE_EXPR, IF_INSTR_EXPR: compat.h) */
#if !MS_HAS_DICT_VERSION_TAG
/* 3.14+: no dict version tag (ma_version_tag is gone): the TLS.cell cache checks the
 * thread's TLS dict entry itself (ms_cell), reading the dict's keys object. */
#define MS_LAYOUT_DICT offsetof(PyDictObject, ma_keys)
#define MS_LAYOUT_DICT_NAME "ma_keys\0"
#define MS_LAYOUT_DICT_MORE                                                     \
    offsetof(PyDictObject, ma_values),                                          \
    offsetof(PyDictKeysObject, dk_log2_index_bytes),                            \
    offsetof(PyDictKeysObject, dk_kind),                                        \
    offsetof(PyDictKeysObject, dk_nentries),                                    \
    offsetof(PyDictKeysObject, dk_indices),                                     \
    sizeof(PyDictUnicodeEntry),                                                 \
    offsetof(PyDictUnicodeEntry, me_key),                                       \
    offsetof(PyDictUnicodeEntry, me_value),                                     \
    DICT_KEYS_GENERAL,
#define MS_LAYOUT_DICT_MORE_NAMES                                               \
    "ma_values\0dk_log2_index_bytes\0dk_kind\0dk_nentries\0dk_indices\0"       \
    "sizeof_PyDictUnicodeEntry\0me_key\0me_value\0DICT_KEYS_GENERAL\0"
#else
#define MS_LAYOUT_DICT offsetof(PyDictObject, ma_version_tag)
#define MS_LAYOUT_DICT_NAME "ma_version_tag\0"
#define MS_LAYOUT_DICT_MORE
#define MS_LAYOUT_DICT_MORE_NAMES
#endif
#if MS_HAS_TUPLE_HASH_CACHE
#define MS_LAYOUT_TUPLE_HASH offsetof(PyTupleObject, ob_hash),
#define MS_LAYOUT_TUPLE_HASH_NAME "tuple_ob_hash\0"
#else
#define MS_LAYOUT_TUPLE_HASH
#define MS_LAYOUT_TUPLE_HASH_NAME
#endif
#if MS_HAS_FRAME_OWNED_BY_INTERPRETER
#define MS_LAYOUT_OWNERS FRAME_OWNED_BY_GENERATOR, FRAME_OWNED_BY_INTERPRETER,
#define MS_LAYOUT_OWNERS_NAMES "FRAME_OWNED_BY_GENERATOR\0FRAME_OWNED_BY_INTERPRETER\0"
#else
#define MS_LAYOUT_OWNERS
#define MS_LAYOUT_OWNERS_NAMES
#endif
#if MS_HAS_STACKREF_EXECUTABLE
#define MS_LAYOUT_STACKREF Py_TAG_BITS,
#define MS_LAYOUT_STACKREF_NAME "Py_TAG_BITS\0"
#else
#define MS_LAYOUT_STACKREF
#define MS_LAYOUT_STACKREF_NAME
#endif
/* (the 3.14+ entries, values and names in the same order) */
#define MS_LAYOUT_MORE MS_LAYOUT_DICT_MORE MS_LAYOUT_TUPLE_HASH MS_LAYOUT_OWNERS MS_LAYOUT_STACKREF
#define MS_LAYOUT_MORE_NAMES                                                    \
    MS_LAYOUT_DICT_MORE_NAMES MS_LAYOUT_TUPLE_HASH_NAME MS_LAYOUT_OWNERS_NAMES MS_LAYOUT_STACKREF_NAME
__attribute__((used))
const uint64_t ms_layout[] = {
    PY_VERSION_HEX,
    sizeof(PyObject),
    offsetof(PyThreadState, id),
    offsetof(PyThreadState, interp),
    offsetof(PyThreadState, dict),
    TS_FRAME_EXPR,
    IF_CODE_EXPR,
    offsetof(_PyInterpreterFrame, previous),
    offsetof(_PyInterpreterFrame, f_globals),
    IF_INSTR_EXPR,
    offsetof(_PyInterpreterFrame, owner),
    offsetof(PyCodeObject, co_filename),
    offsetof(PyCodeObject, _co_firsttraceable),
    offsetof(PyCodeObject, co_code_adaptive),
    offsetof(PyTupleObject, ob_item),
    offsetof(PyListObject, ob_item),
    offsetof(PyVarObject, ob_size),
    sizeof(PyMethodDef),
    offsetof(PyMethodDef, ml_meth),
    offsetof(PyMethodDef, ml_flags),
    offsetof(PyCodeObject, co_extra),
    MS_LAYOUT_DICT,
    offsetof(PyTypeObject, tp_basicsize),
    offsetof(PyTypeObject, tp_itemsize),
    offsetof(PyTypeObject, tp_flags),
    offsetof(PyTypeObject, tp_base),
    offsetof(PyTypeObject, tp_dictoffset),
    offsetof(PyTypeObject, tp_weaklistoffset),
    offsetof(PyTypeObject, tp_alloc),
    Py_TPFLAGS_HAVE_GC,
    offsetof(PyTypeObject, tp_free),
    sizeof(PyGC_Head),
    offsetof(PyTypeObject, tp_dealloc),
    offsetof(PyTypeObject, tp_finalize),
    offsetof(PyTypeObject, tp_del),
    YIELD_VALUE,
    INSTRUMENTED_YIELD_VALUE,
    RESUME,
    INSTRUMENTED_RESUME,
#if MS_HAS_RESUME_CHECK
    RESUME_CHECK,
#else
    0,
#endif
    offsetof(PyCFunctionObject, m_self),
    offsetof(PyCFunctionObject, vectorcall),
    offsetof(PyTypeObject, tp_vectorcall_offset),
    Py_TPFLAGS_HAVE_VECTORCALL,
    MS_LAYOUT_MORE
};
__attribute__((used))
const char ms_layout_names[] =
    "PY_VERSION_HEX\0sizeof_PyObject\0ts_id\0ts_interp\0ts_dict\0ts_frame\0"
    "if_code\0if_previous\0if_globals\0if_instr\0if_owner\0co_filename\0"
    "co_firsttraceable\0co_code_adaptive\0tuple_ob_item\0list_ob_item\0"
    "var_ob_size\0sizeof_PyMethodDef\0ml_meth\0ml_flags\0co_extra\0" MS_LAYOUT_DICT_NAME
    "tp_basicsize\0tp_itemsize\0tp_flags\0tp_base\0tp_dictoffset\0tp_weaklistoffset\0"
    "tp_alloc\0TPFLAGS_HAVE_GC\0tp_free\0sizeof_PyGC_Head\0tp_dealloc\0tp_finalize\0tp_del\0"
    "op_YIELD_VALUE\0op_INSTRUMENTED_YIELD_VALUE\0op_RESUME\0op_INSTRUMENTED_RESUME\0op_RESUME_CHECK\0"
    "cfunc_m_self\0cfunc_vectorcall\0tp_vectorcall_offset\0TPFLAGS_HAVE_VECTORCALL\0" MS_LAYOUT_MORE_NAMES;

/* ---------------------------------------------------------------- refcounts */
/* Py_INCREF is inline with no external reference; Py_DECREF would name _Py_Dealloc. */
static inline void ms_decref(PyObject *op)
{
#if MS_HAS_IMMORTAL_OBJECTS
    if (_Py_IsImmortal(op)) {
        return;
    }
#endif
    if (--op->ob_refcnt == 0) {
        API._Py_Dealloc(op);
    }
}
static inline void ms_xdecref(PyObject *op)
{
    if (op != NULL) {
        ms_decref(op);
    }
}
#define NONE ((PyObject *)API.none)

/* co_extra's layout (private to Objects/codeobject.c; the loader verifies it). */
typedef struct {
    Py_ssize_t ce_size;
    void *ce_extras[1];
} ms_code_extra;

/* (ms_dict_version, the dict version tag of 3.12/3.13: compat.h) */
#define IS_TYPE(op, field) (Py_TYPE(op) == (PyTypeObject *)API.field)

/* ---------------------------------------------------------------- state */
#define STATE_NAME "monstack.sysmon_native.state"
#define MS_SPARE 8

struct ms_state {
    uint64_t magic;
    /* strong references, released by ms_state_free */
    PyObject *tls;        /* monstack._stack.TLS of this install (a _thread._local) */
    PyObject *by_file;    /* policy.tracked_files(): file name -> True/False */
    PyObject *decide;     /* decide(code) -> bool (frame 1 = the event's frame) */
    PyObject *seed;       /* seed(): sets TLS.cell from the real frames */
    PyObject *resync;     /* resync(): rebuilds TLS.cell from the real frames */
    PyObject *on_error;   /* on_error(exc) */
    PyObject *disable;    /* sys.monitoring.DISABLE */
    PyObject *unknown;    /* monstack._stack.UNKNOWN (the int -1) */
    PyObject *s_cell;     /* "cell" */
    PyObject *s_dict;     /* "__dict__" */
    PyObject *coro_exit;  /* monstack._backend.COROUTINE_EXIT: [handler or None] */
    /* snapshot_new's Snapshot class and origin ContextVar (strong; NULL until
     * snapshot_setup), and whether its instances may be untracked by the GC */
    PyObject *snap_cls;
    PyObject *origin_var;
    PyObject *slow;       /* monstack.snapshot: capture()'s fallback (strong; or NULL) */
    int snap_untrack;
    int snap_raw;         /* snapshots allocated by ms_snap_alloc (cls->tp_dealloc is ms_snap_dealloc) */
    PyObject **ints;      /* ms_int's cache: ints[i] is the int i (strong) or NULL; or NULL */
    PyObject *shorten;    /* [hops at which Snapshot._new shortens a chain] (strong; or NULL) */
    /* The last snapshot ms_build_snapshot made (strong; or NULL) and its lasti: handed
     * out again while the same one would be built (see ms_build_snapshot); let go when
     * its top node is popped, at retire and when the state is freed */
    PyObject *last_snap;
    long last_lasti;
    /* What carrier.h's create_task keeps for last_snap, let go of with it (strong; or
     * NULL): the pair (the creator's context variables, a Context with those and the
     * origin) as a tuple, or a weak reference to the variables a creation left that made
     * no pair */
    PyObject *last_ctx;
    int untrack_nodes;    /* code objects are not GC containers (always so in 3.12/3.13) */
    /* Nodes popped while nothing else referenced them, kept for the next pushes
     * instead of being freed (a return cascade pops several in a row): 3-tuples,
     * items NULL, refcount 1, owned; spare[0 .. n_spare-1] */
    PyObject *spare[MS_SPARE];
    int n_spare;
    /* per-code decision cache in co_extra[extra_index] (-1: none): the value
     * (epoch << 2) | 2 | tracked, where epoch identifies this state's policy */
    Py_ssize_t extra_index;
    uint64_t epoch;
    /* one-thread cache of TLS.cell: valid while c_ts/c_id match and the thread's
     * TLS dict has not changed since (version tag c_version): then "cell" in it is
     * still c_cell */
    PyThreadState *c_ts;
    uint64_t c_id;
    uint64_t c_version;
    PyObject *c_ldict;    /* strong */
    PyObject *c_cell;     /* strong */
#if !MS_HAS_DICT_VERSION_TAG
    /* 3.14+ (no version tag; c_version unused): where "cell" sat in c_ldict's keys
     * when cached: the keys object c_keys (not owned: only compared; NULL: nothing
     * cached), its dk_log2_index_bytes and the entry's index. See ms_cell. */
    PyDictKeysObject *c_keys;
    Py_ssize_t c_index;
    PyDictUnicodeEntry *c_entry; /* &entries[c_index] in c_keys, as computed when cached */
    uint8_t c_log2_index_bytes;
#endif
    /* counters (read by tests through ms_counters) */
    int64_t n_push_known, n_push_unknown, n_pop, n_seed, n_resync, n_decide, n_errors, n_cache_miss, n_linked;
    int64_t n_events, n_reused, n_unwind_filtered;
};

/* The capsule's pointer, read directly (PyCapsule_GetPointer compares names with
 * strcmp on every call). The loader verifies that the pointer sits right after the
 * object header; the magic guards against anything else. */
static inline struct ms_state *ms_state_of(PyObject *self)
{
    if (UNLIKELY(!IS_TYPE(self, capsule_type))) {
        return NULL;
    }
    struct ms_state *st = *(struct ms_state **)((char *)self + sizeof(PyObject));
    return (st != NULL && LIKELY(st->magic == MS_MAGIC)) ? st : NULL;
}

static void ms_cache_drop(struct ms_state *st)
{
    PyObject *ldict = st->c_ldict, *cell = st->c_cell;
    st->c_ts = NULL;
    st->c_id = 0;
    st->c_ldict = NULL;
    st->c_cell = NULL;
#if !MS_HAS_DICT_VERSION_TAG
    st->c_keys = NULL;
#endif
    ms_xdecref(ldict);
    ms_xdecref(cell);
}

/* The int of an instruction offset (a node's call site, a snapshot's lasti), new
 * reference or NULL with an exception. Offsets past 256 are not CPython's cached small
 * ints: each would be allocated with its node or snapshot and freed with it, so this
 * state keeps the ints of the offsets below MS_INTS it has used (at most 16 KB of
 * pointers plus the ints; released with the state). */
#define MS_INTS 2048
static PyObject *ms_int_slow(struct ms_state *st, long v)
{
    if (v >= 0 && v < MS_INTS) {
        if (st->ints == NULL) {
            st->ints = (PyObject **)API.PyMem_Calloc(MS_INTS, sizeof(PyObject *));
        }
        if (st->ints != NULL) {
            PyObject *o = API.PyLong_FromLong(v);
            if (o == NULL) {
                return NULL;
            }
            st->ints[v] = o;
            Py_INCREF(o);
            return o;
        }
    }
    return API.PyLong_FromLong(v);
}

/* (inline: it runs at most pushes and twice per snapshot; the rest is out of line) */
static inline PyObject *ms_int(struct ms_state *st, long v)
{
    PyObject *o;
    if (LIKELY((unsigned long)v < MS_INTS && st->ints != NULL && (o = st->ints[v]) != NULL)) {
        Py_INCREF(o);
        return o;
    }
    return ms_int_slow(st, v);
}

/* The last snapshot, if its top node is `node` (or any, for NULL): taken out of the
 * cache, a reference for the caller to drop once nothing of ours is stale (dropping it
 * may free it, its nodes and code objects: __del__ and weakref callbacks run Python
 * code); or NULL. */
static inline PyObject *ms_take_last_snap(struct ms_state *st, PyObject *node)
{
    PyObject *last = st->last_snap;
    if (last == NULL || (node != NULL && PyTuple_GET_ITEM(last, 0) != node)) {
        return NULL;
    }
    st->last_snap = NULL;
    return last;
}

/* The pair create_task made for the last snapshot (see last_ctx), taken out: a
 * reference for the caller to drop once nothing of ours is stale; or NULL. */
static inline PyObject *ms_take_last_ctx(struct ms_state *st)
{
    PyObject *pair = st->last_ctx;
    st->last_ctx = NULL;
    return pair;
}

/* `node` is popped (its frame is gone): the kept snapshot of it cannot recur. Let go of
 * it where that frees nothing (something else holds it too); else hand it to the
 * caller through `drop` (two slots: the snapshot, create_task's pair) to drop last,
 * or, with no `drop`, keep it (the next snapshot built replaces it). 0, or -1: it (or
 * the pair, which is let go of with it) would be freed and `drop` is NULL. */
static inline int ms_snap_popped(struct ms_state *st, PyObject *node, PyObject **drop)
{
    PyObject *last = st->last_snap;
    if (LIKELY(last == NULL || PyTuple_GET_ITEM(last, 0) != node)) {
        return 0;
    }
    if (st->last_ctx != NULL) {
        if (drop == NULL) {
            return -1; /* (dropping the pair may free contexts: to the full path) */
        }
        drop[1] = ms_take_last_ctx(st);
    }
    if (Py_REFCNT(last) > 1) {
        st->last_snap = NULL;
        ms_decref(last); /* (not the last reference: nothing runs) */
        return 0;
    }
    if (drop == NULL) {
        return -1;
    }
    st->last_snap = NULL;
    *drop = last;
    return 0;
}

static void ms_state_free(PyObject *capsule)
{
    struct ms_state *st = (struct ms_state *)API.PyCapsule_GetPointer(capsule, STATE_NAME);
    if (st == NULL) {
        API.PyErr_Clear();
        return;
    }
    ms_cache_drop(st);
    ms_xdecref(ms_take_last_snap(st, NULL));
    ms_xdecref(ms_take_last_ctx(st));
    ms_xdecref(st->tls);
    ms_xdecref(st->by_file);
    ms_xdecref(st->decide);
    ms_xdecref(st->seed);
    ms_xdecref(st->resync);
    ms_xdecref(st->on_error);
    ms_xdecref(st->disable);
    ms_xdecref(st->unknown);
    ms_xdecref(st->s_cell);
    ms_xdecref(st->s_dict);
    ms_xdecref(st->coro_exit);
    ms_xdecref(st->snap_cls);
    ms_xdecref(st->origin_var);
    ms_xdecref(st->slow);
    ms_xdecref(st->shorten);
    while (st->n_spare > 0) {
        ms_decref(st->spare[--st->n_spare]); /* (a tuple with NULL items deallocates as any) */
    }
    if (st->ints != NULL) {
        for (long i = 0; i < MS_INTS; i++) {
            ms_xdecref(st->ints[i]);
        }
        API.PyMem_Free(st->ints);
    }
    st->magic = 0;
    API.PyMem_Free(st);
}

/* ---------------------------------------------------------------- frames */
/* (ms_current_frame, MS_OWNED_BY_C, ms_frame_executable, ms_frame_instr: compat.h) */

/* What a (non-C-stack) frame runs, unchecked: its code object, or on 3.13+ possibly
 * another object or NULL; NULL for a C-stack frame. Compared by address with a known
 * code object, it needs no type check. */
static inline PyObject *ms_frame_exec(_PyInterpreterFrame *f)
{
    if (MS_OWNED_BY_C(f)) {
        return NULL;
    }
    return ms_frame_executable(f);
}

/* The code object a (non-C-stack) frame runs, or NULL. */
static inline PyCodeObject *ms_frame_code(_PyInterpreterFrame *f)
{
    if (MS_OWNED_BY_C(f)) {
        return NULL;
    }
#if MS_HAS_FRAME_EXECUTABLE
    PyObject *ex = ms_frame_executable(f);
    return (ex != NULL && IS_TYPE(ex, code_type)) ? (PyCodeObject *)ex : NULL;
#else
    return (PyCodeObject *)ms_frame_executable(f);
#endif
}

/* frame.f_lasti of a complete Python frame running `code`, or -1. */
static inline long ms_frame_lasti(_PyInterpreterFrame *f, PyCodeObject *code)
{
    _Py_CODEUNIT *first = (_Py_CODEUNIT *)code->co_code_adaptive;
    _Py_CODEUNIT *at = ms_frame_instr(f);
    if (f->owner != FRAME_OWNED_BY_GENERATOR && at < first + code->_co_firsttraceable) {
        return -1; /* incomplete frame */
    }
    long lasti = (long)(at - first);
    if (lasti < 0) {
        return -1;
    }
    return lasti * (long)sizeof(_Py_CODEUNIT);
}

/* A generator frame suspended at its delegation point (`yield from`/`await`) while
 * frames above it run: gen.throw() linked it in without resuming it (_gen_throw), and
 * unlinks it again without any event. 3.12: at the YIELD_VALUE it suspended at; 3.13:
 * at the RESUME after it, oparg 2 (after yield from) or 3 (after await). A running
 * frame sits elsewhere (SEND, a call). Behind INSTRUMENTED_LINE/INSTRUCTION (another
 * tool's line events) the opcode is not visible here: not linked, as far as we know. */
static inline int ms_op_at_delegation(_Py_CODEUNIT *at)
{
#if MS_HAS_INSTR_PTR
    int op = at->op.code;
    return (op == RESUME || op == RESUME_CHECK || op == INSTRUMENTED_RESUME) && (at->op.arg & 3) >= 2;
#else
    int op = at->op.code;
    return op == YIELD_VALUE || op == INSTRUMENTED_YIELD_VALUE;
#endif
}

static inline int ms_linked_suspended(_PyInterpreterFrame *f)
{
    PyCodeObject *code;
    if (f->owner != FRAME_OWNED_BY_GENERATOR || (code = ms_frame_code(f)) == NULL) {
        return 0;
    }
    _Py_CODEUNIT *first = (_Py_CODEUNIT *)code->co_code_adaptive;
    _Py_CODEUNIT *at = ms_frame_instr(f);
    if (at < first || at >= first + Py_SIZE(code)) {
        return 0;
    }
    return ms_op_at_delegation(at);
}

#define MS_CO_SUSPENDABLE (CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR)

/* An unwind that ms_coro_exit must see (the fast path leaves it to the full one). */
#define MS_IS_CORO_UNWIND(args, nargs) \
    ((nargs) >= 3 && IS_TYPE((args)[0], code_type) && (((PyCodeObject *)(args)[0])->co_flags & CO_COROUTINE))

/* ---------------------------------------------------------------- errors */
/* An internal error is pending: hand it to on_error, never let it escape. */
static PyObject *ms_fail(PyObject *self, struct ms_state *st)
{
    PyObject *exc = API.PyErr_GetRaisedException();
    st->n_errors++;
    Py_INCREF(self); /* on_error uninstalls: keep our state alive until we return */
    if (exc != NULL) {
        PyObject *res = API.PyObject_Vectorcall(st->on_error, &exc, 1, NULL);
        if (res == NULL) {
            API.PyErr_Clear();
        }
        else {
            ms_decref(res);
        }
        ms_decref(exc);
    }
    ms_decref(self);
    Py_INCREF(NONE);
    return NONE;
}

/* Call a Python helper (slow paths only). New reference or NULL with an exception.
 * The callbacks hold a reference to `self` (the state's capsule) for their whole
 * run, so a helper that uninstalls monstack (or lets another thread do it) cannot
 * free the state under them. */
static PyObject *ms_call(PyObject *self, PyObject *fn, PyObject *arg)
{
    PyObject *args[1] = {arg};
    return API.PyObject_Vectorcall(fn, args, arg != NULL ? 1 : 0, NULL);
}

/* ---------------------------------------------------------------- policy */
static inline void ms_remember(struct ms_state *st, PyObject *code, int tracked)
{
    if (st->extra_index >= 0) {
        uintptr_t v = (uintptr_t)((st->epoch << 2) | 2u | (tracked ? 1u : 0u));
        if (API.PyUnstable_Code_SetExtra(code, st->extra_index, (void *)v) < 0) {
            API.PyErr_Clear(); /* only a cache */
        }
    }
}

/* 1 tracked, 0 filtered, -1 error. Python is called only for undecided files. */
static inline int ms_tracked(PyObject *self, struct ms_state *st, PyObject *code)
{
    Py_ssize_t idx = st->extra_index;
    ms_code_extra *ex = (ms_code_extra *)((PyCodeObject *)code)->co_extra;
    if (LIKELY(ex != NULL && idx >= 0 && idx < ex->ce_size)) {
        uintptr_t v = (uintptr_t)ex->ce_extras[idx];
        if (LIKELY((v >> 2) == st->epoch && (v & 2u))) {
            return (int)(v & 1u);
        }
    }
    PyObject *d = API.PyDict_GetItemWithError(st->by_file, ((PyCodeObject *)code)->co_filename);
    if (LIKELY(d == (PyObject *)API.true_)) {
        ms_remember(st, code, 1);
        return 1;
    }
    if (d == (PyObject *)API.false_) {
        ms_remember(st, code, 0);
        return 0;
    }
    if (d == NULL && API.PyErr_Occurred() != NULL) {
        return -1;
    }
    st->n_decide++;
    PyObject *res = ms_call(self, st->decide, code);
    if (res == NULL) {
        return -1;
    }
    int t = API.PyObject_IsTrue(res);
    ms_decref(res);
    if (t >= 0) {
        ms_remember(st, code, t);
    }
    return t;
}

/* ---------------------------------------------------------------- TLS.cell */
#if !MS_HAS_DICT_VERSION_TAG
/* The entries of a combined, str-keyed dict's keys object (DK_UNICODE_ENTRIES). */
static inline PyDictUnicodeEntry *ms_dict_entries(PyDictKeysObject *keys)
{
    return (PyDictUnicodeEntry *)(keys->dk_indices + ((size_t)1 << keys->dk_log2_index_bytes));
}

/* Remember where `ldict` holds s_cell -> cell (see ms_cell); nothing (c_keys NULL: every
 * event looks the cell up) for a split or general dict, or a key that is not s_cell
 * itself. */
static void ms_cache_locate(struct ms_state *st, PyObject *ldict, PyObject *cell)
{
    PyDictObject *d = (PyDictObject *)ldict;
    PyDictKeysObject *keys = d->ma_keys;
    st->c_keys = NULL;
    if (d->ma_values != NULL || keys->dk_kind == DICT_KEYS_GENERAL) {
        return;
    }
    PyDictUnicodeEntry *ep = ms_dict_entries(keys);
    for (Py_ssize_t i = 0; i < keys->dk_nentries; i++) {
        if (ep[i].me_key == st->s_cell && ep[i].me_value == cell) {
            st->c_keys = keys;
            st->c_index = i;
            st->c_entry = ep + i;
            st->c_log2_index_bytes = keys->dk_log2_index_bytes;
            return;
        }
    }
}
#endif

/* This thread's TLS.cell (borrowed from the cache), NULL with no exception when the
 * thread has none (unseeded) or it is None (*is_none set), NULL with an exception on
 * error. Like the Python callbacks, pops treat a None cell as no stack and pushes
 * fail on it. */
static PyObject *ms_cell_slow(struct ms_state *st, PyThreadState *ts, int *is_none)
{
    *is_none = 0;
    st->n_cache_miss++;
    ms_cache_drop(st);
    PyObject *ldict = API.PyObject_GetAttr(st->tls, st->s_dict);
    if (ldict == NULL) {
        return NULL;
    }
    if (!IS_TYPE(ldict, dict_type)) {
        ms_decref(ldict);
        API.PyErr_SetString((PyObject *)API.exc_type, "monstack: TLS.__dict__ is not a dict");
        return NULL;
    }
    PyObject *cell = API.PyDict_GetItemWithError(ldict, st->s_cell);
    if (cell == NULL) {
        ms_decref(ldict);
        return NULL; /* unseeded, or an error */
    }
    if (cell == NONE) {
        ms_decref(ldict);
        *is_none = 1;
        return NULL;
    }
    if (!IS_TYPE(cell, list_type) || Py_SIZE(cell) != 1) {
        ms_decref(ldict);
        API.PyErr_SetString((PyObject *)API.exc_type,
                            "monstack: this thread's TLS.cell is not a [top] list");
        return NULL;
    }
    Py_INCREF(cell);
    st->c_ts = ts;
    st->c_id = ts->id;
#if !MS_HAS_DICT_VERSION_TAG
    ms_cache_locate(st, ldict, cell);
#else
    st->c_version = ms_dict_version(ldict);
#endif
    st->c_ldict = ldict;
    st->c_cell = cell;
    return cell;
}

/* The cached cell (borrowed) when the cache is valid for thread `ts`, else NULL. Reads
 * only: no exception, no side effect. */
static inline PyObject *ms_cell_cached(struct ms_state *st, PyThreadState *ts)
{
#if !MS_HAS_DICT_VERSION_TAG
    /* The thread's TLS dict still maps "cell" (st->s_cell itself) to c_cell: its keys
     * object is the one cached (by address), with the same index size (so the cached
     * entry's address, c_entry, is still where entry c_index lies), combined and
     * str-keyed, and that entry -- one it has in use -- holds s_cell -> c_cell. Keys are
     * unique within a dict, so that is the "cell" lookup's answer, even if the keys
     * object was replaced by another at the same address (all checked on the current
     * one, inside its used entries). */
    if (LIKELY(ts == st->c_ts && ts->id == st->c_id)) {
        PyDictObject *d = (PyDictObject *)st->c_ldict;
        PyDictKeysObject *keys = d->ma_keys;
        if (LIKELY(keys == st->c_keys && d->ma_values == NULL && keys->dk_kind != DICT_KEYS_GENERAL &&
                   keys->dk_log2_index_bytes == st->c_log2_index_bytes && st->c_index < keys->dk_nentries)) {
            PyDictUnicodeEntry *ep = st->c_entry;
            if (LIKELY(ep->me_key == st->s_cell && ep->me_value == st->c_cell)) {
                return st->c_cell;
            }
        }
    }
#else
    if (LIKELY(ts == st->c_ts && ts->id == st->c_id && ms_dict_version(st->c_ldict) == st->c_version)) {
        return st->c_cell;
    }
#endif
    return NULL;
}

static inline PyObject *ms_cell(struct ms_state *st, PyThreadState *ts, int *is_none)
{
    PyObject *cell = ms_cell_cached(st, ts);
    if (LIKELY(cell != NULL)) {
        return cell;
    }
    return ms_cell_slow(st, ts, is_none);
}

/* The cell, seeding the thread from its real frames when it has none. New reference. */
static PyObject *ms_cell_or_seed(PyObject *self, struct ms_state *st, PyThreadState *ts)
{
    int is_none = 0;
    PyObject *cell = ms_cell(st, ts, &is_none);
    if (LIKELY(cell != NULL)) {
        Py_INCREF(cell);
        return cell;
    }
    if (API.PyErr_Occurred() != NULL) {
        return NULL;
    }
    if (is_none) {
        API.PyErr_SetString((PyObject *)API.exc_type, "monstack: this thread's TLS.cell is None");
        return NULL;
    }
    st->n_seed++;
    PyObject *res = ms_call(self, st->seed, NULL);
    if (res == NULL) {
        return NULL;
    }
    ms_decref(res);
    cell = ms_cell_slow(st, ts, &is_none);
    if (cell == NULL) {
        if (API.PyErr_Occurred() == NULL) {
            API.PyErr_SetString((PyObject *)API.exc_type, "monstack: seeding left no TLS.cell");
        }
        return NULL;
    }
    Py_INCREF(cell);
    return cell;
}

/* ---------------------------------------------------------------- push / pop */
/* 1 if `code` is known to be filtered (decision cached in co_extra for this policy, or
 * its file decided False), else 0 (tracked or undecided). Runs no Python code. */
static inline int ms_known_filtered(struct ms_state *st, PyCodeObject *code)
{
    Py_ssize_t idx = st->extra_index;
    ms_code_extra *ex = (ms_code_extra *)code->co_extra;
    if (ex != NULL && idx >= 0 && idx < ex->ce_size) {
        uintptr_t v = (uintptr_t)ex->ce_extras[idx];
        if ((v >> 2) == st->epoch && (v & 2u)) {
            return (v & 1u) ? 0 : 1;
        }
    }
    PyObject *d = API.PyDict_GetItemWithError(st->by_file, code->co_filename);
    if (d == NULL) {
        API.PyErr_Clear();
        return 0;
    }
    return d == (PyObject *)API.false_;
}

/* How many known-filtered frames (a library, monstack's own helpers) the fast path
 * looks through between snapshot() and the nearest tracked frame, and a push between
 * the new frame and its tracked caller. */
#define MS_FAST_FILTERED_HOPS 16

/* The call site for a push of `code` under `top` (the cell's current top): the
 * caller's f_lasti when the caller is a complete frame running top's code and top's own
 * call site is known, else -1. Reads frames, co_extra and the policy's decision dict
 * (str keys): runs no Python code, changes nothing. */
__attribute__((always_inline)) static inline long ms_call_site(struct ms_state *st, PyThreadState *ts, PyObject *top, PyObject *code)
{
    if (top == NONE || !IS_TYPE(top, tuple_type) || Py_SIZE(top) != 3 ||
        PyTuple_GET_ITEM(top, 2) == st->unknown) {
        return -1;
    }
    _PyInterpreterFrame *f = ms_current_frame(ts);
    if (f == NULL || ms_frame_exec(f) != code) {
        return -1;
    }
    /* The caller: the nearest frame that is neither a C-stack entry frame (a call
     * through C: tp_call, next(), map()...) nor known-filtered code (a library calling
     * back into user code), as capture's _fill walks f_back. */
    PyObject *top_code = PyTuple_GET_ITEM(top, 0);
    _PyInterpreterFrame *caller = f->previous;
    for (int hops = 0; caller != NULL && hops <= MS_FAST_FILTERED_HOPS; hops++) {
        PyObject *ex = ms_frame_exec(caller);
        if (ex == top_code) {
            long lasti = ms_frame_lasti(caller, (PyCodeObject *)ex);
            /* Called through C (hops > 0: past an entry frame) from a generator that
             * gen.throw() linked in, as its delegate's throw() method is: no event
             * pushed that generator, the top node may be the thrower's, of the same
             * code. Unknown: capture's _fill rebuilds when it meets one. */
            if (UNLIKELY(hops != 0) && caller->owner == FRAME_OWNED_BY_GENERATOR && lasti >= 0 &&
                ms_op_at_delegation(ms_frame_instr(caller))) {
                lasti = -1;
            }
            return lasti;
        }
        if (ex != NULL && IS_TYPE(ex, code_type) && !ms_known_filtered(st, (PyCodeObject *)ex)) {
            return -1;
        }
        caller = caller->previous;
    }
    return -1;
}

/* Fill `node` (an empty 3-tuple, owned) as (code, top, off) and make it the top of
 * `cell`: the cell's reference to top moves into the node, `off` (owned) too. */
static inline void ms_link(PyObject *cell, PyObject *node, PyObject *code, PyObject *off)
{
    PyObject **slot = &((PyListObject *)cell)->ob_item[0];
    Py_INCREF(code);
    PyTuple_SET_ITEM(node, 0, code);
    PyTuple_SET_ITEM(node, 1, *slot);
    PyTuple_SET_ITEM(node, 2, off);
    *slot = node;
}

static int ms_push(struct ms_state *st, PyThreadState *ts, PyObject *cell, PyObject *code)
{
    /* Allocate first: a collection here may run Python code that changes cell[0]. */
    PyObject *node;
    int fresh = st->n_spare == 0;
    if (LIKELY(!fresh)) {
        node = st->spare[--st->n_spare];
        st->n_reused++;
        ms_tuple_reset_hash(node); /* 3.14+ caches a tuple's hash */
    }
    else if ((node = API.PyTuple_New(3)) == NULL) {
        return -1;
    }
    long lasti = ms_call_site(st, ts, ((PyListObject *)cell)->ob_item[0], code);
    PyObject *off;
    if (lasti >= 0) {
        off = ms_int(st, lasti); /* (runs no Python code) */
        if (off == NULL) {
            ms_decref(node);
            return -1;
        }
        st->n_push_known++;
    }
    else {
        off = st->unknown;
        Py_INCREF(off);
        st->n_push_unknown++;
    }
    ms_link(cell, node, code, off);
    /* A node (code, parent node or None, int) can never be part of a reference cycle
     * (code objects are not GC containers: checked at load), so the collector need
     * not traverse it -- it would untrack it at its first pass anyway. */
    if (fresh && LIKELY(st->untrack_nodes)) {
        API.PyObject_GC_UnTrack(node);
    }
    return 0;
}

/* 1 popped, 0 top is not `code`. A kept snapshot of the popped node that only the
 * cache held goes to *drop (NULL: it stays kept), for the caller to drop last. */
static inline int ms_pop(struct ms_state *st, PyObject *cell, PyObject *code, PyObject **drop)
{
    PyObject **slot = &((PyListObject *)cell)->ob_item[0];
    PyObject *top = *slot;
    if (LIKELY(top != NONE && IS_TYPE(top, tuple_type) && Py_SIZE(top) == 3 &&
               PyTuple_GET_ITEM(top, 0) == code)) {
        PyObject *parent = PyTuple_GET_ITEM(top, 1);
        st->n_pop++;
        if (LIKELY(top->ob_refcnt == 1 && st->n_spare < MS_SPARE && st->untrack_nodes)) {
            /* Nothing else holds the node (no snapshot, no other thread's view): keep
             * the tuple for the next push. The parent's reference moves to the cell;
             * code and offset are released last, when no pointer of ours is stale
             * (releasing a code object can run Python code: weakref callbacks). */
            PyObject *code_ref = PyTuple_GET_ITEM(top, 0), *off = PyTuple_GET_ITEM(top, 2);
            PyTuple_SET_ITEM(top, 0, NULL);
            PyTuple_SET_ITEM(top, 1, NULL);
            PyTuple_SET_ITEM(top, 2, NULL);
            *slot = parent;
            st->spare[st->n_spare++] = top;
            ms_decref(off);
            ms_decref(code_ref);
            return 1;
        }
        (void)ms_snap_popped(st, top, drop);
        Py_INCREF(parent);
        *slot = parent;
        ms_decref(top);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- fast paths */
/* The common events in one straight run: tracked code whose decision is cached, this
 * thread's cell cached, a pop that frees nothing. They call no Python code and release
 * no reference that could be the last one (so neither `self` nor the cell need a
 * reference of their own meanwhile). A push without a spare node allocates one: since
 * 3.12 an allocation only schedules a collection (it runs at the next eval-breaker
 * check, not inside the allocation), so that runs no Python code either. Anything else returns NULL with
 * nothing changed and no exception, and the event takes the full path (ms_enter /
 * ms_leave) from its start. They return None borrowed: it is immortal (3.12+). */

/* The decision cached in co_extra for this policy: 1 tracked, 0 filtered, -1 none. */
static inline int ms_cached_decision(struct ms_state *st, PyObject *code)
{
    Py_ssize_t idx = st->extra_index;
    ms_code_extra *ex = (ms_code_extra *)((PyCodeObject *)code)->co_extra;
    if (LIKELY(ex != NULL && idx >= 0 && idx < ex->ce_size)) {
        uintptr_t v = (uintptr_t)ex->ce_extras[idx];
        if (LIKELY((v >> 2) == st->epoch && (v & 2u))) {
            return (int)(v & 1u);
        }
    }
    return -1;
}

/* PY_START / PY_RESUME of tracked code. */
__attribute__((always_inline)) static inline PyObject *ms_enter_fast(struct ms_state *st, PyObject *const *args, Py_ssize_t nargs)
{
    if (UNLIKELY(nargs < 1)) {
        return NULL;
    }
    PyObject *code = args[0];
    if (UNLIKELY(!IS_TYPE(code, code_type) || ms_cached_decision(st, code) != 1)) {
        return NULL;
    }
    PyThreadState *ts = API.PyThreadState_Get();
    PyObject *cell = ms_cell_cached(st, ts);
    if (UNLIKELY(cell == NULL)) {
        return NULL;
    }
    long lasti = ms_call_site(st, ts, ((PyListObject *)cell)->ob_item[0], code);
    PyObject *off;
    if (lasti >= 0) {
        if (UNLIKELY(lasti >= MS_INTS || st->ints == NULL || (off = st->ints[lasti]) == NULL)) {
            return NULL; /* (ms_push makes the int) */
        }
    }
    else {
        off = st->unknown;
    }
    PyObject *node;
    if (LIKELY(st->n_spare != 0)) {
        node = st->spare[--st->n_spare];
        st->n_reused++;
        ms_tuple_reset_hash(node); /* 3.14+ caches a tuple's hash */
    }
    else {
        if (UNLIKELY(!st->untrack_nodes || (node = API.PyTuple_New(3)) == NULL)) {
            API.PyErr_Clear(); /* (the full path tries again and reports) */
            return NULL;
        }
        /* (see ms_push) */
        API.PyObject_GC_UnTrack(node);
    }
    Py_INCREF(off);
    st->n_events++;
    if (lasti >= 0) {
        st->n_push_known++;
    }
    else {
        st->n_push_unknown++;
    }
    ms_link(cell, node, code, off);
    return NONE;
}

/* PY_RETURN, PY_YIELD (is_yield) and PY_UNWIND of the cell's top node. */
__attribute__((always_inline)) static inline PyObject *ms_leave_fast(struct ms_state *st, PyObject *const *args, Py_ssize_t nargs, int is_yield)
{
    if (UNLIKELY(nargs < 1)) {
        return NULL;
    }
    PyObject *code = args[0];
    PyThreadState *ts = API.PyThreadState_Get();
    PyObject *cell = ms_cell_cached(st, ts);
    if (UNLIKELY(cell == NULL)) {
        return NULL;
    }
    PyObject **slot = &((PyListObject *)cell)->ob_item[0];
    PyObject *top = *slot;
    if (UNLIKELY(top == NONE || !IS_TYPE(top, tuple_type) || Py_SIZE(top) != 3 ||
                 PyTuple_GET_ITEM(top, 0) != code)) {
        return NULL;
    }
    PyObject *parent = PyTuple_GET_ITEM(top, 1);
    /* a yield to a generator frame: ms_leave looks for frames gen.throw() linked in */
    if (is_yield && parent != NONE && IS_TYPE(parent, tuple_type) && Py_SIZE(parent) == 3 &&
        (((PyCodeObject *)PyTuple_GET_ITEM(parent, 0))->co_flags & MS_CO_SUSPENDABLE)) {
        return NULL;
    }
    if (LIKELY(Py_REFCNT(top) == 1)) {
        /* Nothing else holds the node: keep the tuple for the next push (as ms_pop),
         * when that releases no last reference (the code object stays held by the
         * event's frame; the offset is an int) */
        PyObject *off = PyTuple_GET_ITEM(top, 2);
        if (UNLIKELY(st->n_spare >= MS_SPARE || !st->untrack_nodes || Py_REFCNT(code) <= 1)) {
            return NULL;
        }
        PyTuple_SET_ITEM(top, 0, NULL);
        PyTuple_SET_ITEM(top, 1, NULL);
        PyTuple_SET_ITEM(top, 2, NULL);
        *slot = parent;
        st->spare[st->n_spare++] = top;
        ms_decref(off);
        ms_decref(code);
    }
    else {
        /* a snapshot (or another thread) holds it too: not freed here; nor is the
         * snapshot kept of it (that one to the full path, which holds self) */
        if (UNLIKELY(ms_snap_popped(st, top, NULL) < 0)) {
            return NULL;
        }
        Py_INCREF(parent);
        *slot = parent;
        ms_decref(top);
    }
    st->n_pop++;
    st->n_events++;
    return NONE;
}

/* PY_UNWIND: an exception leaves the frame. The event cannot be disabled per code
 * object, so every frame of filtered code an exception leaves reports it, on threads
 * that may never have run tracked code (no cell: the lookup would take the slow path
 * each time). A filtered code object (its decision cached for this state's policy)
 * has no node on any thread's stack: every stack is seeded and pushed under that
 * policy since the state was made (start() forgets the older ones). Nothing to pop. */
__attribute__((always_inline)) static inline PyObject *ms_unwind_fast(struct ms_state *st, PyObject *const *args, Py_ssize_t nargs)
{
    if (UNLIKELY(MS_IS_CORO_UNWIND(args, nargs))) {
        return NULL; /* ms_unwind_full: it holds the state while the handler runs */
    }
    if (LIKELY(nargs >= 1 && IS_TYPE(args[0], code_type)) && ms_cached_decision(st, args[0]) == 0) {
        st->n_events++;
        st->n_unwind_filtered++;
        return NONE;
    }
    return ms_leave_fast(st, args, nargs, 0);
}

/* PY_UNWIND of a coroutine frame (see Backend.reports_coroutine_exits): when an
 * Exception leaves it and the frame below (C entry frames skipped, as frame.f_back skips
 * them) runs no generator, coroutine or async generator code -- nothing awaits it: the
 * outermost coroutine of an asyncio task's step -- call COROUTINE_EXIT[0](code, exc).
 * Tracked or filtered code alike. Runs only when an exception leaves a coroutine; the
 * handler (Python) makes the exact checks. Its failures are its own: cleared here. */
__attribute__((noinline, cold)) static void ms_coro_exit(struct ms_state *st, PyObject *code, PyObject *exc)
{
    PyObject *handler = ((PyListObject *)st->coro_exit)->ob_item[0];
    if (handler == NONE) {
        return;
    }
    PyTypeObject *t = Py_TYPE(exc);
    while (t != NULL && t != (PyTypeObject *)API.exc_exception) {
        t = t->tp_base;
    }
    if (t == NULL) { /* CancelledError, KeyboardInterrupt...: not an Exception */
        return;
    }
    _PyInterpreterFrame *f = ms_current_frame(API.PyThreadState_Get());
    if (f == NULL || (PyObject *)ms_frame_code(f) != code) {
        return;
    }
    f = f->previous;
    while (f != NULL && MS_OWNED_BY_C(f)) {
        f = f->previous;
    }
    PyCodeObject *below = f != NULL ? ms_frame_code(f) : NULL;
    if (below != NULL && (below->co_flags & MS_CO_SUSPENDABLE)) {
        return; /* awaited by that frame */
    }
    Py_INCREF(handler);
    PyObject *args[2] = {code, exc};
    PyObject *res = API.PyObject_Vectorcall(handler, args, 2, NULL);
    ms_decref(handler);
    if (res == NULL) {
        API.PyErr_Clear();
        st->n_errors++;
    }
    else {
        ms_decref(res);
    }
}


static inline int ms_check_args(PyObject *const *args, Py_ssize_t nargs)
{
    if (UNLIKELY(nargs < 1 || !IS_TYPE(args[0], code_type))) {
        API.PyErr_SetString((PyObject *)API.exc_type, "monstack: callback called without a code object");
        return -1;
    }
    return 0;
}

/* PY_START, PY_RESUME (disable = 1) and PY_THROW (disable = 0). */
__attribute__((always_inline)) static inline PyObject *ms_enter(PyObject *self, PyObject *const *args, Py_ssize_t nargs, int disable)
{
    struct ms_state *st = ms_state_of(self);
    if (UNLIKELY(st == NULL)) {
        API.PyErr_Clear();
        Py_INCREF(NONE);
        return NONE;
    }
    st->n_events++;
    if (ms_check_args(args, nargs) < 0) {
        return ms_fail(self, st);
    }
    PyObject *code = args[0];
    int t = ms_tracked(self, st, code);
    if (UNLIKELY(t <= 0)) {
        if (t < 0) {
            return ms_fail(self, st);
        }
        if (disable) {
            Py_INCREF(st->disable);
            return st->disable;
        }
        Py_INCREF(NONE);
        return NONE;
    }
    PyThreadState *ts = API.PyThreadState_Get();
    PyObject *cell = ms_cell_or_seed(self, st, ts);
    if (UNLIKELY(cell == NULL)) {
        return ms_fail(self, st);
    }
    int err = ms_push(st, ts, cell, code);
    ms_decref(cell);
    if (UNLIKELY(err < 0)) {
        return ms_fail(self, st);
    }
    Py_INCREF(NONE);
    return NONE;
}

/* After a tracked generator yielded and was popped (the new top runs generator code):
 * pop the nodes of the generators gen.throw() had linked in above it (see
 * ms_linked_suspended). They will not run -- the throw returns the value just yielded
 * to its caller -- and leave without any event. */
static void ms_drop_linked(struct ms_state *st, PyThreadState *ts, PyObject *cell)
{
    _PyInterpreterFrame *f = ms_current_frame(ts); /* the frame that yielded */
    for (int hops = 0; f != NULL && hops < 256; hops++) {
        f = f->previous;
        /* (a generator resumed from C, as _gen_throw resumes the one that catches,
         * runs above a C-stack entry frame: skipped, as frame.f_back skips it) */
        while (f != NULL && MS_OWNED_BY_C(f)) {
            f = f->previous;
        }
        if (f == NULL || !ms_linked_suspended(f)) {
            return;
        }
        if (ms_pop(st, cell, (PyObject *)ms_frame_code(f), NULL)) {
            st->n_linked++;
        }
    }
}

/* PY_RETURN, PY_YIELD (disable = 1; is_yield) and PY_UNWIND (disable = 0). */
__attribute__((always_inline)) static inline PyObject *ms_leave(PyObject *self, PyObject *const *args, Py_ssize_t nargs, int disable, int is_yield)
{
    struct ms_state *st = ms_state_of(self);
    if (UNLIKELY(st == NULL)) {
        API.PyErr_Clear();
        Py_INCREF(NONE);
        return NONE;
    }
    st->n_events++;
    if (ms_check_args(args, nargs) < 0) {
        return ms_fail(self, st);
    }
    PyObject *code = args[0];
    PyThreadState *ts = API.PyThreadState_Get();
    int is_none = 0;
    PyObject *cell = ms_cell(st, ts, &is_none);
    if (LIKELY(cell != NULL)) {
        PyObject *drop[2] = {NULL, NULL};
        if (LIKELY(ms_pop(st, cell, code, drop))) {
            if (is_yield) {
                PyObject *below = ((PyListObject *)cell)->ob_item[0];
                if (below != NONE && IS_TYPE(below, tuple_type) && Py_SIZE(below) == 3 &&
                    (((PyCodeObject *)PyTuple_GET_ITEM(below, 0))->co_flags & MS_CO_SUSPENDABLE)) {
                    ms_drop_linked(st, ts, cell);
                }
            }
            ms_xdecref(drop[0]); /* last: it may run Python code (self is held: so is st) */
            ms_xdecref(drop[1]);
            Py_INCREF(NONE);
            return NONE;
        }
    }
    else if (API.PyErr_Occurred() != NULL) {
        return ms_fail(self, st);
    }
    int t = ms_tracked(self, st, code);
    if (t < 0) {
        return ms_fail(self, st);
    }
    if (t == 0) {
        if (disable) {
            Py_INCREF(st->disable);
            return st->disable;
        }
        Py_INCREF(NONE);
        return NONE;
    }
    st->n_resync++;
    PyObject *res = ms_call(self, st->resync, NULL);
    if (res == NULL) {
        return ms_fail(self, st);
    }
    ms_decref(res);
    /* resync replaced TLS.cell: the cache revalidates on the next event */
    Py_INCREF(NONE);
    return NONE;
}

/* PY_UNWIND's full path: a coroutine's exit is reported first, then the frame leaves. */
static inline PyObject *ms_unwind_full(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct ms_state *st = ms_state_of(self);
    if (st != NULL && MS_IS_CORO_UNWIND(args, nargs)) {
        ms_coro_exit(st, args[0], args[2]);
    }
    return ms_leave(self, args, nargs, 0, 0);
}

#define MS_HOLD_SELF(call)       \
    do {                         \
        Py_INCREF(self);         \
        PyObject *res_ = (call); \
        ms_decref(self);         \
        return res_;             \
    } while (0)

/* The full paths, out of line (so the entry points' fast paths save only the registers
 * they use). */
#define MS_FULL(name, call)                                                                  \
    __attribute__((noinline)) static PyObject *name(PyObject *self, PyObject *const *args, \
                                                    Py_ssize_t nargs)                       \
    {                                                                                        \
        MS_HOLD_SELF(call);                                                                  \
    }
MS_FULL(ms_full_start, ms_enter(self, args, nargs, 1))
MS_FULL(ms_full_throw, ms_enter(self, args, nargs, 0))
MS_FULL(ms_full_return, ms_leave(self, args, nargs, 1, 0))
MS_FULL(ms_full_yield, ms_leave(self, args, nargs, 1, 1))
MS_FULL(ms_full_unwind, ms_unwind_full(self, args, nargs))

/* The fast path `fast` (st: the state) when it applies, else the full path `full`. */
#define MS_FAST_OR(fast, full)                              \
    do {                                                    \
        struct ms_state *st = ms_state_of(self);            \
        if (LIKELY(st != NULL)) {                           \
            PyObject *fres_ = (fast);                       \
            if (LIKELY(fres_ != NULL)) {                    \
                return fres_;                               \
            }                                               \
        }                                                   \
        return full(self, args, nargs);                     \
    } while (0)

__attribute__((used, noinline))
PyObject *ms_on_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    MS_FAST_OR(ms_enter_fast(st, args, nargs), ms_full_start);
}

__attribute__((used, noinline))
PyObject *ms_on_throw(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return ms_full_throw(self, args, nargs);
}

__attribute__((used, noinline))
PyObject *ms_on_return(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    MS_FAST_OR(ms_leave_fast(st, args, nargs, 0), ms_full_return);
}

__attribute__((used, noinline))
PyObject *ms_on_yield(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    MS_FAST_OR(ms_leave_fast(st, args, nargs, 1), ms_full_yield);
}

__attribute__((used, noinline))
PyObject *ms_on_unwind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    MS_FAST_OR(ms_unwind_fast(st, args, nargs), ms_full_unwind);
}

/* The same callbacks as vectorcall functions. The loader writes them into the
 * `vectorcall` field of the builtin-function objects it registers (after checking the
 * field), so that CPython's event dispatch (_PyObject_VectorcallTstate) calls them
 * directly instead of through cfunction_vectorcall_FASTCALL, which looks the thread
 * state up once more and counts a recursion level for a call that cannot recurse.
 * Calls through ml_meth (CALL_BUILTIN_FAST from Python code) still reach the
 * functions above. Keyword arguments are refused as the builtin would refuse them. */
static PyObject *ms_vc_kwargs(PyObject *kwnames)
{
    (void)kwnames;
    API.PyErr_SetString((PyObject *)API.exc_type, "monstack callbacks take no keyword arguments");
    return NULL;
}

#define MS_VC_SELF(callable) (((PyCFunctionObject *)(callable))->m_self)
#define MS_VC(name, fast, body)                                                                 \
    __attribute__((used, noinline)) PyObject *name(PyObject *callable, PyObject *const *args, \
                                                   size_t nargsf, PyObject *kwnames)           \
    {                                                                                           \
        if (UNLIKELY(kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {                      \
            return ms_vc_kwargs(kwnames);                                                       \
        }                                                                                       \
        PyObject *self = MS_VC_SELF(callable);                                                  \
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);                                          \
        MS_FAST_OR(fast, body);                                                                 \
    }

/* The loader's check that a vectorcall function written into a builtin's field is the
 * one its calls reach: returns the callable itself (ms_noop, its ml_meth, returns None). */
__attribute__((used, noinline))
PyObject *ms_vc_probe(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    (void)args;
    (void)nargsf;
    (void)kwnames;
    Py_INCREF(callable);
    return callable;
}

MS_VC(ms_vc_start, ms_enter_fast(st, args, nargs), ms_full_start)
MS_VC(ms_vc_throw, ((void)st, (PyObject *)NULL), ms_full_throw)
MS_VC(ms_vc_return, ms_leave_fast(st, args, nargs, 0), ms_full_return)
MS_VC(ms_vc_yield, ms_leave_fast(st, args, nargs, 1), ms_full_yield)
MS_VC(ms_vc_unwind, ms_unwind_fast(st, args, nargs), ms_full_unwind)

/* snapshot_fast() -> (top, lasti) or None. The O(1) case of a snapshot, natively:
 * called from monstack.snapshot(), it looks at snapshot()'s caller (the frame before
 * the current one, which must be a complete Python frame called directly, not through
 * C); if this thread's top node runs that frame's code and its call site is known, the
 * snapshot is (top, that frame's f_lasti). Anything else -> None: the Python path
 * (lazy fill, resync, seeding) decides. */
/* The fast case shared by snapshot_fast / snapshot_new: 1 and (*top borrowed, *lasti),
 * or 0. */
static inline int ms_fast_top(struct ms_state *st, PyThreadState *ts, int from_caller, PyObject **top_out,
                               long *lasti_out)
{
    _PyInterpreterFrame *f = ms_current_frame(ts);
    if (f == NULL || ms_frame_code(f) == NULL) {
        return 0;
    }
    int is_none = 0;
    PyObject *cell = ms_cell(st, ts, &is_none);
    if (cell == NULL) {
        API.PyErr_Clear();
        return 0;
    }
    PyObject *top = ((PyListObject *)cell)->ob_item[0];
    int empty = top == NONE;
    if (!empty && (!IS_TYPE(top, tuple_type) || Py_SIZE(top) != 3 || PyTuple_GET_ITEM(top, 2) == st->unknown)) {
        return 0;
    }
    /* snapshot()'s caller, or -- when that caller is filtered code, as when a framework
     * takes the snapshot for its user -- the nearest tracked frame above it, looking
     * through at most MS_FAST_FILTERED_HOPS known-filtered frames (C-stack entry frames
     * are skipped, as frame.f_back skips them). Undecided code: the Python path. An
     * empty shadow stack with only known-filtered frames looked at (the bottom reached,
     * or the limit: the user's code excluded, a framework's thread) is the empty
     * snapshot, (None, -1), as snapshot()'s Python path answers it. */
    _PyInterpreterFrame *caller = from_caller ? f->previous : f;
    PyCodeObject *code;
    int hops = 0;
    for (;;) {
        if (caller == NULL) {
            goto filtered_only;
        }
        code = ms_frame_code(caller);
        if (code != NULL) {
            if (!empty && PyTuple_GET_ITEM(top, 0) == (PyObject *)code) {
                break;
            }
            if (!ms_known_filtered(st, code)) {
                return 0;
            }
        }
        if (++hops > MS_FAST_FILTERED_HOPS) {
            goto filtered_only;
        }
        caller = caller->previous;
    }
    long lasti = ms_frame_lasti(caller, code);
    if (lasti < 0) {
        return 0;
    }
    *top_out = top;
    *lasti_out = lasti;
    return 1;
filtered_only:
    if (!empty) {
        return 0;
    }
    *top_out = NONE;
    *lasti_out = -1;
    return 1;
}

/* ---------------------------------------------------------------- snapshot memory */
/* A Snapshot is a 5-tuple subclass that can never be part of a reference cycle (it holds
 * nodes, ints, None, plain records and older snapshots), so the native paths untrack it.
 * Allocated through PyType_GenericAlloc it still counts as a new GC object: on 3.12
 * (threshold 700) a framework keeping a few hundred ops in flight, each with a snapshot,
 * triggered ~10x more young collections, each traversing everything in flight -- ~4%
 * of the op-queue bench. So the native paths allocate snapshots the way
 * _PyType_AllocNoTrack does, minus _PyObject_GC_Link (the count and the collection it
 * may schedule), as CPython's own free lists skip them, and mark them (MS_SNAP_MARK in
 * the untracked header's _gc_prev, which nothing reads while untracked). The class's
 * tp_dealloc becomes ms_snap_dealloc, which frees a marked snapshot uncounted and
 * anything else (allocated by Python: tracked and counted) through the class's own
 * tp_free, PyObject_GC_Del, as before. */
#ifdef Py_TPFLAGS_INLINE_VALUES
#define MS_TPFLAGS_INLINE_VALUES Py_TPFLAGS_INLINE_VALUES
#else
#define MS_TPFLAGS_INLINE_VALUES 0
#endif
#define MS_SNAP_ITEMS 5
#define MS_SNAP_BASICSIZE ((Py_ssize_t)offsetof(PyTupleObject, ob_item))
#define MS_SNAP_SIZE (offsetof(PyTupleObject, ob_item) + MS_SNAP_ITEMS * sizeof(PyObject *))
/* low two bits clear: _PyGC_PREV_MASK_FINALIZED / _COLLECTING stay unset */
#define MS_SNAP_MARK ((uintptr_t)0x6d736e70u << 2)

/* The class's tp_dealloc once adopted: what subtype_dealloc and tupledealloc do for a
 * Snapshot -- finalizer (only if one was added later), untrack, release the items,
 * free, the type's reference -- without subtype_dealloc's generic steps for __slots__,
 * __dict__ and weakrefs (the class has none: checked at adoption) and without its
 * trashcan. The only recursion a snapshot can start goes down its origin chain (nodes
 * and records are plain tuples, whose deallocation has its own trashcan; a snapshot
 * placed in another one's other items by hand, with tuple.__new__, is not guarded),
 * and that is unrolled here: an origin this is the last reference to is deallocated by
 * the next turn of the loop. A subclass's instances come here from subtype_dealloc
 * (their base's dealloc), which did its own steps: the base tuple's dealloc frees them
 * with their own tp_free. */
static void ms_snap_dealloc(PyObject *op)
{
    destructor tuple_dealloc = ((PyTypeObject *)API.tuple_type)->tp_dealloc;
    for (;;) {
        PyTypeObject *tp = Py_TYPE(op);
        /* A subclass instance (one allocated here and reassigned to a subclass with
         * __class__ is then uncounted by its PyObject_GC_Del without ever having been
         * counted: the count, which stops at 0, is one lower; no memory hazard). */
        if (UNLIKELY(tp->tp_dealloc != ms_snap_dealloc)) {
            tuple_dealloc(op);
            ms_decref((PyObject *)tp);
            return;
        }
        if (UNLIKELY(tp->tp_finalize != NULL)) { /* a __del__ added after adoption */
            if (API.PyObject_CallFinalizerFromDealloc(op) < 0) {
                return; /* resurrected */
            }
        }
        PyGC_Head *gc = (PyGC_Head *)((char *)op - sizeof(PyGC_Head));
        /* (a finalizer run above may have set _gc_prev's FINALIZED bit) */
        int marked = gc->_gc_next == 0 && (gc->_gc_prev & ~(uintptr_t)3) == MS_SNAP_MARK;
        API.PyObject_GC_UnTrack(op);
        PyObject *origin = NULL;
        for (Py_ssize_t i = Py_SIZE(op); --i >= 0;) {
            PyObject *item = PyTuple_GET_ITEM(op, i);
            PyTuple_SET_ITEM(op, i, NULL);
            if (i == 2) {
                origin = item;
            }
            else if (item != NULL) {
                ms_decref(item);
            }
        }
        if (marked) {
            API.PyObject_Free(gc);
        }
        else {
            tp->tp_free(op);
        }
        ms_decref((PyObject *)tp);
        if (origin == NULL) {
            return;
        }
        if (Py_TYPE(origin)->tp_dealloc == ms_snap_dealloc && !_Py_IsImmortal(origin) &&
            origin->ob_refcnt == 1) {
            origin->ob_refcnt = 0; /* the reference this snapshot held was the last */
#if MS_HAS_REFTRACER
            void *data = NULL; /* _Py_Dealloc's work, skipped by the loop: tell a tracer */
            PyRefTracer tracer = API.PyRefTracer_GetTracer(&data);
            if (tracer != NULL) {
                tracer(origin, PyRefTracer_DESTROY, data);
            }
#endif
            op = origin;
            continue;
        }
        ms_decref(origin);
        return;
    }
}

/* An untracked, uncounted 5-item instance of cls (checked by snapshot_setup), items
 * NULL; new reference or NULL with MemoryError. */
static PyObject *ms_snap_alloc(PyTypeObject *cls)
{
    uintptr_t *mem = (uintptr_t *)API.PyObject_Malloc(sizeof(PyGC_Head) + MS_SNAP_SIZE);
    if (mem == NULL) {
        return API.PyErr_NoMemory();
    }
#pragma GCC unroll 16
    for (size_t i = 0; i < (sizeof(PyGC_Head) + MS_SNAP_SIZE) / sizeof(uintptr_t); i++) {
        mem[i] = 0; /* _gc_next = 0: not tracked; items NULL */
    }
    ((PyGC_Head *)mem)->_gc_prev = MS_SNAP_MARK;
    PyObject *op = (PyObject *)((char *)mem + sizeof(PyGC_Head));
    API.PyObject_InitVar((PyVarObject *)op, cls, MS_SNAP_ITEMS); /* type ref, refcount 1 */
    ms_tuple_reset_hash(op); /* not computed (as tuple_alloc resets it) */
    return op;
}

/* snapshot_setup(cls, origin_var, slow, plain, shorten) -> None: the Snapshot class
 * snapshot_new and capture build (a tuple subclass), the ContextVar of the current
 * origin they read, capture()'s fallback (monstack.snapshot), an instance of a plain
 * class (see the adoption below) and the one-item list holding the hop count at which
 * Snapshot._new shortens an origin chain (_snapshot._SHORTEN_CELL: it changes with
 * install(chain_limit=...)). Instances are untracked by the GC when they cannot be part
 * of a cycle: no __dict__, no weakrefs, no extra slots (then a snapshot holds only
 * nodes, ints, None and older snapshots). snapshot_setup(None, ...) retires the fast
 * paths (uninstall): capture() then always falls back. */
__attribute__((used, noinline))
PyObject *ms_snapshot_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct ms_state *st = ms_state_of(self);
    if (st == NULL || nargs != 5) {
        API.PyErr_SetString((PyObject *)API.exc_type,
                            "snapshot_setup(cls, origin_var, slow, plain, shorten) on a live state");
        return NULL;
    }
    PyObject *old_cls = st->snap_cls, *old_var = st->origin_var, *old_slow = st->slow;
    PyObject *old_shorten = st->shorten;
    if (args[0] == NONE) {
        /* retire: capture() keeps working through st->slow (kept), the rest declines */
        PyObject *old_snap = ms_take_last_snap(st, NULL); /* (it holds this install's nodes) */
        PyObject *old_ctx = ms_take_last_ctx(st);
        st->snap_cls = NULL;
        st->origin_var = NULL;
        st->shorten = NULL;
        st->snap_raw = 0;
        ms_xdecref(old_cls);
        ms_xdecref(old_var);
        ms_xdecref(old_shorten);
        ms_xdecref(old_snap);
        ms_xdecref(old_ctx);
        Py_INCREF(NONE);
        return NONE;
    }
    if (!IS_TYPE(args[4], list_type) || Py_SIZE(args[4]) != 1) {
        API.PyErr_SetString((PyObject *)API.exc_type, "snapshot_setup(): shorten must be a [int] list");
        return NULL;
    }
    if (!IS_TYPE(Py_TYPE(args[0]), type_type)) {
        API.PyErr_SetString((PyObject *)API.exc_type, "snapshot_setup(): cls must be a type");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    PyTypeObject *tup = (PyTypeObject *)API.tuple_type;
    if (cls->tp_base != tup || cls->tp_alloc == NULL) {
        API.PyErr_SetString((PyObject *)API.exc_type, "snapshot_setup(): cls must subclass tuple directly");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    Py_INCREF(args[4]);
    PyObject *old_snap = ms_take_last_snap(st, NULL); /* (made for the old class, var, chain limit) */
    PyObject *old_ctx = ms_take_last_ctx(st);
    st->snap_cls = args[0];
    st->origin_var = args[1];
    st->slow = args[2];
    st->shorten = args[4];
    st->snap_untrack = st->untrack_nodes && cls->tp_basicsize == tup->tp_basicsize &&
                       cls->tp_itemsize == tup->tp_itemsize && cls->tp_dictoffset == 0 &&
                       cls->tp_weaklistoffset == 0;
    /* Adopt the class's deallocation (see ms_snap_dealloc): only an untrackable class
     * whose memory starts with exactly a PyGC_Head, with no finalizer, still deallocated
     * and freed as every class statement's are (subtype_dealloc: the tp_dealloc of
     * `plain`, an instance of such a class; PyObject_GC_Del), or already adopted by this
     * code. Kept for good: instances allocated here may outlive this state, and this
     * code is never unmapped. */
    destructor plain = Py_TYPE(args[3])->tp_dealloc;
    if (st->snap_untrack && (cls->tp_flags & Py_TPFLAGS_HAVE_GC) &&
        !(cls->tp_flags & (Py_TPFLAGS_PREHEADER | MS_TPFLAGS_INLINE_VALUES)) &&
        (cls->tp_flags & Py_TPFLAGS_HEAPTYPE) && cls->tp_basicsize == MS_SNAP_BASICSIZE &&
        cls->tp_itemsize == (Py_ssize_t)sizeof(PyObject *) && cls->tp_finalize == NULL &&
        cls->tp_del == NULL && (Py_TYPE(args[3])->tp_flags & Py_TPFLAGS_HEAPTYPE) &&
        plain != tup->tp_dealloc) {
        if (cls->tp_free == API.PyObject_GC_Del && cls->tp_dealloc == plain) {
            cls->tp_dealloc = ms_snap_dealloc;
        }
    }
    st->snap_raw = st->snap_untrack && cls->tp_free == API.PyObject_GC_Del && cls->tp_dealloc == ms_snap_dealloc;
    ms_xdecref(old_cls);
    ms_xdecref(old_var);
    ms_xdecref(old_slow);
    ms_xdecref(old_shorten);
    ms_xdecref(old_snap);
    ms_xdecref(old_ctx);
    Py_INCREF(NONE);
    return NONE;
}

/* Snapshot._new's hop bookkeeping: meta = dropped << MS_HOP_BITS | hops. */
#define MS_HOP_BITS 32
#define MS_HOP_MASK ((1LL << MS_HOP_BITS) - 1)

/* The meta int of a snapshot linked to `origin` (Snapshot._new: origin's meta + 1), as
 * a new reference; None (new reference) when Python must decide: origin not exactly
 * cls, or the chain due to be shortened (Snapshot._new makes the shortened copy). */
static PyObject *ms_linked_meta(struct ms_state *st, PyTypeObject *cls, PyObject *origin)
{
    if (Py_TYPE(origin) != cls || Py_SIZE(origin) != 5 || st->shorten == NULL ||
        Py_SIZE(st->shorten) != 1) {
        goto none;
    }
    PyObject *m = PyTuple_GET_ITEM(origin, 4);
    PyObject *at = ((PyListObject *)st->shorten)->ob_item[0];
    if (!IS_TYPE(m, long_type) || !IS_TYPE(at, long_type)) {
        goto none;
    }
    Py_ssize_t meta = API.PyLong_AsSsize_t(m);
    Py_ssize_t shorten_at = API.PyLong_AsSsize_t(at);
    if (meta < 0 || shorten_at < 0 || meta >= PY_SSIZE_T_MAX) {
        API.PyErr_Clear(); /* -1: an error (too big) */
        goto none;
    }
    meta += 1;
    if ((meta & MS_HOP_MASK) >= shorten_at) {
        goto none;
    }
    return meta < MS_INTS ? ms_int(st, (long)meta) : API.PyLong_FromLong((long)meta);
none:
    Py_INCREF(NONE);
    return NONE;
}

/* The O(1) snapshot: an instance of snapshot_setup's cls, (top, lasti, None, None, 0)
 * or, under an origin, (top, lasti, origin, None, origin's meta + 1): exactly what
 * Snapshot._new(top, lasti, origin) builds (checked by monstack/_accel.py before it
 * hands the functions out), of the current frame (from_caller = 0) or of its caller
 * (1). A new reference, None (new reference: take the Python path) or NULL with an
 * exception. */
static PyObject *ms_build_snapshot(struct ms_state *st, int from_caller)
{
    PyObject *top;
    long lasti;
    if (UNLIKELY(st->snap_cls == NULL)) {
        goto none;
    }
    PyTypeObject *cls = (PyTypeObject *)st->snap_cls;
    PyThreadState *ts = API.PyThreadState_Get();
    PyObject *origin = NULL;
    if (API.PyContextVar_Get(st->origin_var, NULL, &origin) < 0) {
        API.PyErr_Clear();
        goto none;
    }
    if (origin == NULL) {
        origin = NONE;
        Py_INCREF(NONE);
    }
    PyObject *meta;
    if (origin == NONE) {
        meta = ms_int(st, 0);
    }
    else {
        meta = ms_linked_meta(st, cls, origin);
        if (meta == NONE) {
            ms_decref(meta);
            ms_decref(origin);
            goto none;
        }
    }
    if (meta == NULL) {
        ms_decref(origin);
        return NULL;
    }
    if (!ms_fast_top(st, ts, from_caller, &top, &lasti)) {
        ms_decref(meta);
        ms_decref(origin);
        goto none;
    }
    /* The same snapshot as the last one (a loop submitting jobs or creating tasks at
     * one call site): that one again, not an equal copy. A snapshot is an immutable
     * value, and while cached it holds its top node, so the node cannot have been
     * freed and reused for another frame: the same items make the same snapshot. */
    PyObject *last = st->last_snap;
    if (last != NULL && st->last_lasti == lasti && PyTuple_GET_ITEM(last, 0) == top &&
        PyTuple_GET_ITEM(last, 2) == origin && PyTuple_GET_ITEM(last, 4) == meta && Py_TYPE(last) == cls) {
        Py_INCREF(last);
        ms_decref(meta);
        ms_decref(origin);
        return last;
    }
    PyObject *off = ms_int(st, lasti);
    if (off == NULL) {
        ms_decref(meta);
        ms_decref(origin);
        return NULL;
    }
    Py_INCREF(top); /* before the allocation: a collection may replace cell[0] */
    PyObject *snap = st->snap_raw ? ms_snap_alloc(cls) : cls->tp_alloc(cls, 5);
    if (snap == NULL) {
        ms_decref(top);
        ms_decref(off);
        ms_decref(meta);
        ms_decref(origin);
        return NULL;
    }
    ms_tuple_reset_hash(snap); /* (tp_alloc zeroed it; tuple_subtype_new resets it) */
    PyTuple_SET_ITEM(snap, 0, top);
    PyTuple_SET_ITEM(snap, 1, off);
    PyTuple_SET_ITEM(snap, 2, origin);
    Py_INCREF(NONE);
    PyTuple_SET_ITEM(snap, 3, NONE);
    PyTuple_SET_ITEM(snap, 4, meta);
    if (st->snap_untrack && !st->snap_raw) {
        API.PyObject_GC_UnTrack(snap);
    }
    Py_INCREF(snap);
    last = st->last_snap;
    PyObject *last_ctx = ms_take_last_ctx(st);
    st->last_snap = snap;
    st->last_lasti = lasti;
    ms_xdecref(last); /* (last: may run Python code, the cache is consistent) */
    ms_xdecref(last_ctx);
    return snap;
none:
    Py_INCREF(NONE);
    return NONE;
}

/* snapshot_new() -> a Snapshot of the caller of the Python function calling it (that
 * is, snapshot()'s caller) or None: the Python path decides. */
__attribute__((used, noinline))
PyObject *ms_snapshot_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    struct ms_state *st = ms_state_of(self);
    if (UNLIKELY(st == NULL || nargs != 0)) {
        Py_INCREF(NONE);
        return NONE;
    }
    return ms_build_snapshot(st, 1);
}

/* capture() -> the Snapshot of its caller, always: monstack.snapshotter()'s function.
 * The O(1) case natively (no Python frame of its own, unlike snapshot()); anything
 * else -- an origin set, an unknown call site, a retired state -- calls monstack.snapshot
 * (from C, so that function's caller is capture()'s caller). */
__attribute__((used, noinline))
PyObject *ms_capture(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    struct ms_state *st = ms_state_of(self);
    if (UNLIKELY(st == NULL || st->slow == NULL)) {
        API.PyErr_SetString((PyObject *)API.exc_type, "monstack capture(): not set up");
        return NULL;
    }
    if (UNLIKELY(nargs != 0)) {
        API.PyErr_SetString((PyObject *)API.exc_type, "capture() takes no arguments");
        return NULL;
    }
    PyObject *snap = ms_build_snapshot(st, 0);
    if (snap != NONE) {
        return snap;
    }
    ms_decref(snap);
    PyObject *slow = st->slow;
    Py_INCREF(slow); /* the Python path may retire this state */
    Py_INCREF(self);
    PyObject *res = ms_call(self, slow, NULL);
    ms_decref(self);
    ms_decref(slow);
    return res;
}

__attribute__((used, noinline))
PyObject *ms_snapshot_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct ms_state *st = ms_state_of(self);
    if (UNLIKELY(st == NULL)) {
        goto none;
    }
    PyThreadState *ts = API.PyThreadState_Get();
    _PyInterpreterFrame *f = ms_current_frame(ts);
    if (f == NULL || ms_frame_code(f) == NULL) {
        goto none;
    }
    _PyInterpreterFrame *caller = f->previous;
    PyCodeObject *code;
    if (caller == NULL || (code = ms_frame_code(caller)) == NULL) {
        goto none;
    }
    int is_none = 0;
    PyObject *cell = ms_cell(st, ts, &is_none);
    if (cell == NULL) {
        API.PyErr_Clear();
        goto none;
    }
    PyObject *top = ((PyListObject *)cell)->ob_item[0];
    if (top == NONE || !IS_TYPE(top, tuple_type) || Py_SIZE(top) != 3 ||
        PyTuple_GET_ITEM(top, 0) != (PyObject *)code || PyTuple_GET_ITEM(top, 2) == st->unknown) {
        goto none;
    }
    long lasti = ms_frame_lasti(caller, code);
    if (lasti < 0) {
        goto none;
    }
    PyObject *out = API.PyTuple_New(2);
    if (out == NULL) {
        return NULL;
    }
    PyObject *off = ms_int(st, lasti);
    if (off == NULL) {
        ms_decref(out);
        return NULL;
    }
    /* re-read: PyTuple_New may have collected garbage and run Python code */
    top = ((PyListObject *)cell)->ob_item[0];
    if (top == NONE || !IS_TYPE(top, tuple_type) || PyTuple_GET_ITEM(top, 0) != (PyObject *)code ||
        PyTuple_GET_ITEM(top, 2) == st->unknown) {
        ms_decref(out);
        ms_decref(off);
        goto none;
    }
    Py_INCREF(top);
    PyTuple_SET_ITEM(out, 0, top);
    PyTuple_SET_ITEM(out, 1, off);
    return out;
none:
    Py_INCREF(NONE);
    return NONE;
}

/* An empty callback (benchmarks: the cost of CPython's event machinery alone). */
__attribute__((used, noinline))
PyObject *ms_noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_INCREF(NONE);
    return NONE;
}

/* ---------------------------------------------------------------- management */
/* new_state(tls, by_file, decide, seed, resync, on_error, DISABLE, UNKNOWN, "cell",
 * "__dict__", coro_exit, extra_index, epoch) -> capsule. Called once per install, from
 * Python (self unused). */
__attribute__((used, noinline))
PyObject *ms_new_state(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 13) {
        API.PyErr_SetString((PyObject *)API.exc_type, "new_state() takes 13 arguments");
        return NULL;
    }
    Py_ssize_t extra_index = API.PyLong_AsSsize_t(args[11]);
    Py_ssize_t epoch = API.PyLong_AsSsize_t(args[12]);
    if ((extra_index == -1 || epoch == -1) && API.PyErr_Occurred() != NULL) {
        return NULL;
    }
    if (epoch <= 0 || extra_index < -1) {
        API.PyErr_SetString((PyObject *)API.exc_type, "new_state(): bad extra_index or epoch");
        return NULL;
    }
    if (!IS_TYPE(args[1], dict_type)) {
        API.PyErr_SetString((PyObject *)API.exc_type, "new_state(): by_file must be a dict");
        return NULL;
    }
    if (!IS_TYPE(args[10], list_type) || Py_SIZE(args[10]) != 1) {
        API.PyErr_SetString((PyObject *)API.exc_type, "new_state(): coro_exit must be a 1-item list");
        return NULL;
    }
    struct ms_state *st = (struct ms_state *)API.PyMem_Calloc(1, sizeof(struct ms_state));
    if (st == NULL) {
        API.PyErr_SetString((PyObject *)API.exc_type, "new_state(): out of memory");
        return NULL;
    }
    PyObject **fields[11] = {&st->tls, &st->by_file, &st->decide, &st->seed, &st->resync,
                             &st->on_error, &st->disable, &st->unknown, &st->s_cell, &st->s_dict,
                             &st->coro_exit};
    for (int i = 0; i < 11; i++) {
        Py_INCREF(args[i]);
        *fields[i] = args[i];
    }
    st->extra_index = extra_index;
    st->epoch = (uint64_t)epoch;
    st->untrack_nodes = !(((PyTypeObject *)API.code_type)->tp_flags & Py_TPFLAGS_HAVE_GC);
    st->magic = MS_MAGIC;
    PyObject *cap = API.PyCapsule_New(st, STATE_NAME, ms_state_free);
    if (cap == NULL) {
        for (int i = 0; i < 11; i++) {
            ms_decref(*fields[i]);
        }
        API.PyMem_Free(st);
    }
    return cap;
}

/* counters(state) -> tuple of ints (tests and `info`). */
__attribute__((used, noinline))
PyObject *ms_counters(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 1 || !IS_TYPE(args[0], capsule_type)) {
        API.PyErr_SetString((PyObject *)API.exc_type, "counters() takes a state");
        return NULL;
    }
    struct ms_state *st = ms_state_of(args[0]);
    if (st == NULL) {
        API.PyErr_SetString((PyObject *)API.exc_type, "counters(): not a live state");
        return NULL;
    }
    int64_t vals[12] = {st->n_push_known, st->n_push_unknown, st->n_pop, st->n_seed,
                        st->n_resync, st->n_decide, st->n_errors, st->n_cache_miss, st->n_events,
                        st->n_linked, st->n_reused, st->n_unwind_filtered};
    PyObject *out = API.PyTuple_New(12);
    if (out == NULL) {
        return NULL;
    }
    for (int i = 0; i < 12; i++) {
        PyObject *v = API.PyLong_FromLong((long)vals[i]);
        if (v == NULL) {
            ms_decref(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* probe() -> (code, lasti, caller code or None, caller lasti, ts.id, ts.interp, ts.dict
 * address, this thread's state address): what the hot path reads, for the loader to
 * compare with sys._getframe() and ctypes. Called from Python, so the current frame
 * is the caller's. */
__attribute__((used, noinline))
PyObject *ms_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    (void)args;
    (void)nargs;
    PyThreadState *ts = API.PyThreadState_Get();
    _PyInterpreterFrame *f = ms_current_frame(ts);
    PyObject *out = API.PyTuple_New(8);
    if (out == NULL) {
        return NULL;
    }
    PyObject *items[8] = {0};
    PyCodeObject *code = f != NULL ? ms_frame_code(f) : NULL;
    _PyInterpreterFrame *caller = f != NULL ? f->previous : NULL;
    while (caller != NULL && ms_frame_code(caller) == NULL) {
        caller = caller->previous; /* skip C-stack entry frames */
    }
    PyCodeObject *ccode = caller != NULL ? ms_frame_code(caller) : NULL;
    items[0] = code != NULL ? (PyObject *)code : NONE;
    Py_INCREF(items[0]);
    items[1] = API.PyLong_FromLong(code != NULL ? ms_frame_lasti(f, code) : -2);
    items[2] = ccode != NULL ? (PyObject *)ccode : NONE;
    Py_INCREF(items[2]);
    items[3] = API.PyLong_FromLong(ccode != NULL ? ms_frame_lasti(caller, ccode) : -2);
    items[4] = API.PyLong_FromLong((long)ts->id);
    items[5] = API.PyLong_FromLong((long)(uintptr_t)ts->interp);
    items[6] = API.PyLong_FromLong((long)(uintptr_t)ts->dict);
    items[7] = API.PyLong_FromLong((long)(uintptr_t)ts);
    for (int i = 0; i < 8; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 8; j++) {
                ms_xdecref(items[j]);
            }
            ms_decref(out);
            return NULL;
        }
    }
    for (int i = 0; i < 8; i++) {
        PyTuple_SET_ITEM(out, i, items[i]);
    }
    return out;
}

/* ---------------------------------------------------------------- the origin carrier */
/* carrier.h's create_task keeps what it made for a snapshot beside the snapshot cache
 * (last_ctx): valid while that snapshot is the kept one, let go of with it. */
#define MS_TASK_CONTEXT 1

/* The state behind `capture` (ms_capture's function, as the install handed it to the
 * asyncio point) if `snap` is the snapshot it keeps; else NULL. */
static struct ms_state *ms_task_ctx_state(PyObject *capture, PyObject *snap)
{
    if (!IS_TYPE(capture, cfunction_type)) {
        return NULL;
    }
    PyCFunctionObject *f = (PyCFunctionObject *)capture;
    if (f->m_ml == NULL || f->m_ml->ml_meth != (PyCFunction)(void (*)(void))ms_capture) {
        return NULL;
    }
    struct ms_state *st = ms_state_of(f->m_self);
    return st != NULL && snap != NULL && st->last_snap == snap ? st : NULL;
}

/* What is kept for `snap`: 1 with the pair (borrowed, or NULL) and the variables a
 * creation left that made no pair (borrowed: only to compare; or NULL); 0 where `snap`
 * is not the kept snapshot. */
static int ms_task_ctx_get(PyObject *capture, PyObject *snap, PyObject **pair, PyObject **seen)
{
    struct ms_state *st = ms_task_ctx_state(capture, snap);
    if (st == NULL) {
        return 0;
    }
    PyObject *kept = st->last_ctx;
    *pair = NULL;
    *seen = NULL;
    if (kept != NULL && IS_TYPE(kept, tuple_type)) {
        *pair = kept;
    } else if (kept != NULL) {
        *seen = ((PyWeakReference *)kept)->wr_object; /* (None once they are gone) */
    }
    return 1;
}

/* Keep `kept` (a new reference, or NULL: stolen) for `snap` if it is still the kept
 * snapshot, in place of what was kept (let go of last: that may run Python code). */
static void ms_task_ctx_keep(PyObject *capture, PyObject *snap, PyObject *kept)
{
    struct ms_state *st = ms_task_ctx_state(capture, snap); /* (a collection may have run since) */
    if (st == NULL) {
        ms_xdecref(kept);
        return;
    }
    PyObject *old = st->last_ctx;
    st->last_ctx = kept;
    ms_xdecref(old);
}

/* A creation for `snap` made no pair and left the creator's variables `vars`: noted (a
 * weak reference: an address alone could be another HAMT's by the next creation), in
 * place of what was kept. */
static void ms_task_ctx_note(PyObject *capture, PyObject *snap, PyObject *vars)
{
    if (ms_task_ctx_state(capture, snap) == NULL) {
        return;
    }
    PyObject *ref = API.PyWeakref_NewRef(vars, NULL);
    if (ref == NULL) {
        API.PyErr_Clear();
    }
    ms_task_ctx_keep(capture, snap, ref);
}

/* Keep the pair (vars, ctx) for `snap`. */
static void ms_task_ctx_put(PyObject *capture, PyObject *snap, PyObject *vars, PyObject *ctx)
{
    if (ms_task_ctx_state(capture, snap) == NULL) {
        return;
    }
    PyObject *pair = API.PyTuple_New(2);
    if (pair == NULL) {
        API.PyErr_Clear();
        return;
    }
    Py_INCREF(vars);
    Py_INCREF(ctx);
    PyTuple_SET_ITEM(pair, 0, vars);
    PyTuple_SET_ITEM(pair, 1, ctx);
    ms_task_ctx_keep(capture, snap, pair);
}

#include "carrier.h" /* (after ms_decref) */

#pragma GCC visibility pop
