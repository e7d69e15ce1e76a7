/* Shared declarations of the CPython 3.11 eval_frame shim (see shim311.c).
 *
 * Compiled against the real CPython 3.11 headers (Py_BUILD_CORE for
 * _PyInterpreterFrame). Nothing here may reference an external symbol: every
 * function and object the shim uses comes through `struct ms_data`, filled at load
 * time by monstack/_native.py and monstack/_evalframe.py. build.py records the offset of every field below
 * and of every interpreter struct field the shim reads; the loader verifies the
 * latter against the running interpreter.
 */
#ifndef MONSTACK_SHIM311_H
#define MONSTACK_SHIM311_H

#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <opcode.h>
#include <stdint.h>
#include <stddef.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030C0000
#error "shim311 must be compiled against CPython 3.11 headers"
#endif

typedef PyObject *(*ms_evalfunc)(PyThreadState *, _PyInterpreterFrame *, int);

/* The address table: one entry per external function, named after its symbol.
 * X(return type, symbol, parameter list) */
#define MS_API_TABLE(X)                                                        \
    X(PyObject *, _PyEval_EvalFrameDefault, (PyThreadState *, _PyInterpreterFrame *, int)) \
    X(PyObject *, PyDict_GetItemWithError, (PyObject *, PyObject *))          \
    X(PyObject *, PyTuple_New, (Py_ssize_t))                                  \
    X(PyObject *, PyList_New, (Py_ssize_t))                                   \
    X(PyObject *, PyLong_FromSsize_t, (Py_ssize_t))                           \
    X(Py_ssize_t, PyLong_AsSsize_t, (PyObject *))                             \
    X(void, _Py_Dealloc, (PyObject *))                                        \
    X(int, _PyCode_SetExtra, (PyObject *, Py_ssize_t, void *))                \
    X(PyObject *, PyObject_CallFunctionObjArgs, (PyObject *, ...))            \
    X(int, PyObject_SetAttr, (PyObject *, PyObject *, PyObject *))            \
    X(void, PyErr_Fetch, (PyObject **, PyObject **, PyObject **))             \
    X(void, PyErr_Restore, (PyObject *, PyObject *, PyObject *))              \
    X(void, PyErr_Clear, (void))                                              \
    X(void, PyErr_SetString, (PyObject *, const char *))                      \
    X(void *, PyMem_Malloc, (size_t))                                         \
    X(void *, PyMem_Realloc, (void *, size_t))                                \
    X(void, PyMem_Free, (void *))                                             \
    X(unsigned long, pthread_self, (void))                                    \
    X(int, pthread_getattr_np, (unsigned long, void *))                       \
    X(int, pthread_attr_getstack, (void *, void **, size_t *))                \
    X(int, pthread_attr_destroy, (void *))                                    \
    X(PyThreadState *, PyThreadState_Get, (void))                             \
    X(int, PyContextVar_Get, (PyObject *, PyObject *, PyObject **))           \
    X(PyObject *, PyErr_Occurred, (void))                                     \
    X(void, PyErr_NormalizeException, (PyObject **, PyObject **, PyObject **)) \
    X(int, PyErr_GivenExceptionMatches, (PyObject *, PyObject *))

/* Objects and settings the loader writes (name, C type). */
#define MS_OBJ_FIELDS(X)                                                       \
    X(py_none, PyObject *)                                                     \
    X(py_true, PyObject *)                                                     \
    X(py_false, PyObject *)                                                    \
    X(exc_recursion, PyObject *)   /* PyExc_RecursionError */                  \
    X(exc_type_error, PyObject *)  /* PyExc_TypeError */                       \
    X(exc_exception, PyObject *)   /* PyExc_Exception */                       \
    X(coro_exit, PyObject *)       /* monstack._backend.COROUTINE_EXIT: [handler or None] */ \
    X(list_type, PyTypeObject *)                                               \
    X(tuple_type, PyTypeObject *)                                              \
    X(long_type, PyTypeObject *)                                               \
    X(dummy_type, PyTypeObject *)  /* _thread._localdummy */                   \
    X(interp, PyInterpreterState *)                                            \
    X(tls, PyObject *)             /* monstack._stack.TLS */                   \
    X(tls_key, PyObject *)         /* its key in each thread-state dict */     \
    X(str_cell, PyObject *)        /* "cell" */                                \
    X(decide, PyObject *)          /* callable(code, globals) -> True/False/None */ \
    X(off_localdict, int64_t)      /* offset of localdict in _thread._localdummy */ \
    X(extra_index, int64_t)        /* co_extra index for cached decisions */   \
    X(margin, int64_t)             /* C stack bytes kept in reserve */         \
    X(epoch, int64_t)              /* policy epoch: cached decisions of other epochs are stale */ \
    X(gen, int64_t)                /* install generation: bumped at start and stop */ \
    X(enabled, int64_t)                                                        \
    /* the native snapshot (ms_snapshot_new, ms_capture), borrowed: the backend keeps them */ \
    X(str_type, PyTypeObject *)                                                \
    X(snap_cls, PyTypeObject *)    /* monstack._snapshot.Snapshot */           \
    X(origin_var, PyObject *)      /* its CURRENT_ORIGIN ContextVar */         \
    X(shorten, PyObject *)         /* _snapshot._SHORTEN_CELL: [hops at which chains shorten] */ \
    X(by_file, PyObject *)         /* policy.tracked_files(): file name -> True/False */ \
    X(eval_slot, void **)          /* &interp->eval_frame: ours, or the stack is not trusted */ \
    X(snap_live, PyObject *)       /* the live install's token (self of its functions); 0: retired */ \
    /* the last snapshot build_snapshot made (strong; 0: none) and its lasti, handed out  \
     * again while the same one would be built; let go when its top node is popped or    \
     * by ms_snapshot_forget (retire) */                                                  \
    X(last_snap, PyObject *)                                                             \
    X(last_lasti, int64_t)

/* Counters the loader reads (for `info` and tests). */
#define MS_COUNTERS(X)                                                         \
    X(n_push) X(n_seed) X(n_verify) X(n_resync) X(n_decide) X(n_stack_refused) \
    X(n_errors) X(n_rec_claim) X(n_throw) X(n_snap) X(n_snap_py)

/* Per-thread record, in a table indexed by a hash of the PyThreadState pointer. */
struct ms_rec {
    PyThreadState *ts;
    uint64_t id;                 /* ts->id: a reused PyThreadState address is another thread */
    int64_t gen;
    uintptr_t stack_limit;       /* lowest stack address the shim lets Python frames start below */
    _PyInterpreterFrame *active_frame; /* innermost frame pushed by a live shim activation */
    PyObject *active_node;       /* its node (kept alive by that activation) */
    /* cache of this thread's TLS.cell lookup, valid while the thread-state dict is the
     * same object and the thread's local dict has not changed (dict version tags are
     * unique across all dicts and modifications) */
    PyObject *tdict;
    PyObject *ldict;
    uint64_t ldict_version;
    PyObject *cell;
    /* the top to put back after the evaluation of the frame just pushed on frames
     * gen.throw() linked in (see linked_restore in shim311.c): set by that push, taken
     * by its tracked_eval right after (a new reference, or NULL) */
    PyObject *restore;
    void *spare[5];              /* pads the record to 128 bytes: a cheaper index */
};

#define MS_NREC 1024
/* Call-site offsets below 2 * MS_LASTI_INTS get an int made once and kept (no
 * allocation per push); made on first use, not by the loader (2048 ints and an array
 * of them cost ~4M instructions at start-up). */
#define MS_LASTI_INTS 2048
#define MS_REC_BITS 10

struct ms_data {
    uint64_t magic;
#define MS_DECL_API(ret, name, args) ret (*name) args;
    MS_API_TABLE(MS_DECL_API)
#undef MS_DECL_API
#define MS_DECL_FIELD(name, type) type name;
    MS_OBJ_FIELDS(MS_DECL_FIELD)
#undef MS_DECL_FIELD
#define MS_DECL_COUNTER(name) int64_t name;
    MS_COUNTERS(MS_DECL_COUNTER)
#undef MS_DECL_COUNTER
    struct ms_rec recs[MS_NREC];
    PyObject *lasti_ints[MS_LASTI_INTS]; /* [i]: the int 2*i, or 0 until first needed */
};

/* co_extra layout (private to Objects/codeobject.c; verified by the loader). */
typedef struct {
    Py_ssize_t ce_size;
    void *ce_extras[1];
} ms_code_extra;

/* Interpreter struct fields the shim reads: (name, expression giving the offset). */
#define MS_INTERP_OFFSETS(X)                                                   \
    X(ts_interp, offsetof(PyThreadState, interp))                              \
    X(ts_recursion_remaining, offsetof(PyThreadState, recursion_remaining))    \
    X(ts_recursion_limit, offsetof(PyThreadState, recursion_limit))            \
    X(ts_tracing, offsetof(PyThreadState, tracing))                            \
    X(ts_cframe, offsetof(PyThreadState, cframe))                              \
    X(ts_dict, offsetof(PyThreadState, dict))                                  \
    X(ts_id, offsetof(PyThreadState, id))                                      \
    X(cframe_current_frame, offsetof(_PyCFrame, current_frame))                \
    X(if_globals, offsetof(_PyInterpreterFrame, f_globals))                    \
    X(if_code, offsetof(_PyInterpreterFrame, f_code))                          \
    X(if_frame_obj, offsetof(_PyInterpreterFrame, frame_obj))                  \
    X(if_previous, offsetof(_PyInterpreterFrame, previous))                    \
    X(if_prev_instr, offsetof(_PyInterpreterFrame, prev_instr))                \
    X(if_owner, offsetof(_PyInterpreterFrame, owner))                          \
    X(owner_generator, FRAME_OWNED_BY_GENERATOR)                               \
    X(frameobj_f_frame, offsetof(struct _frame, f_frame))                      \
    X(co_firsttraceable, offsetof(PyCodeObject, _co_firsttraceable))           \
    X(co_flags, offsetof(PyCodeObject, co_flags))                              \
    X(co_extra, offsetof(PyCodeObject, co_extra))                              \
    X(co_code_adaptive, offsetof(PyCodeObject, co_code_adaptive))              \
    X(dict_version, offsetof(PyDictObject, ma_version_tag))                    \
    X(list_ob_item, offsetof(PyListObject, ob_item))                           \
    X(tuple_ob_item, offsetof(PyTupleObject, ob_item))                         \
    X(var_ob_size, offsetof(PyVarObject, ob_size))                             \
    X(ob_refcnt, offsetof(PyObject, ob_refcnt))                                \
    X(ob_type, offsetof(PyObject, ob_type))                                    \
    X(sizeof_codeunit, sizeof(_Py_CODEUNIT))                                   \
    X(op_yield_value, YIELD_VALUE)

#define MS_MAGIC 0x6d6f6e7374616b31ULL /* "monstak1" */

#endif
