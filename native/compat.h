/* What sysmon.c relies on that changed between CPython 3.12 and 3.15, as named facts
 * (MS_HAS_..., each 0 or 1) and small accessors for the struct fields that moved.
 *
 * This is the only file of native/ that tests PY_VERSION_HEX in an #if or #elif
 * (tests/unit/test_native.py fails on one elsewhere): sysmon.c reads a fact by name, as
 * the Python code reads monstack/_env.py. Each fact says what changed, in which version
 * and, where there is one, the CPython issue (gh-NNNNN). 3.15 changed none of them again.
 * sysmon.c's layout table still records PY_VERSION_HEX itself: that is data the loader
 * compares with the running interpreter, not a branch.
 *
 * Included by sysmon.c after <Python.h> and <internal/pycore_frame.h> (Py_BUILD_CORE). */
#ifndef MONSTACK_COMPAT_H
#define MONSTACK_COMPAT_H

#if PY_VERSION_HEX < 0x030C0000 || PY_VERSION_HEX >= 0x03100000
#error "sysmon.c is for CPython 3.12 to 3.15"
#endif

/* ------------------------------------------------------------------ the facts */
/* 3.12: objects can be immortal, their reference count never changes (PEP 683). */
#define MS_HAS_IMMORTAL_OBJECTS (PY_VERSION_HEX >= 0x030C0000)
/* 3.13: _PyCFrame is gone; the thread's top frame is PyThreadState.current_frame (gh-108035). */
#define MS_HAS_TS_CURRENT_FRAME (PY_VERSION_HEX >= 0x030D0000)
/* 3.13: _PyInterpreterFrame.f_code became f_executable, which may hold another object than
 * a code object, or NULL (gh-100987). */
#define MS_HAS_FRAME_EXECUTABLE (PY_VERSION_HEX >= 0x030D0000)
/* 3.13: _PyInterpreterFrame.prev_instr became instr_ptr, the instruction running or next
 * to run: a suspended generator's frame points at the RESUME after its yield, not at the
 * YIELD_VALUE (gh-109094). */
#define MS_HAS_INSTR_PTR (PY_VERSION_HEX >= 0x030D0000)
/* 3.13: RESUME's specialised form RESUME_CHECK (an opcode the code may see). */
#define MS_HAS_RESUME_CHECK (PY_VERSION_HEX >= 0x030D0000)
/* 3.13: a reference tracer (PyRefTracer_GetTracer), told of every deallocation (gh-93502). */
#define MS_HAS_REFTRACER (PY_VERSION_HEX >= 0x030D0000)
/* 3.14: f_executable is a _PyStackRef, a tagged pointer (Py_TAG_REFCNT set for a deferred
 * or immortal reference), in internal/pycore_interpframe_structs.h (gh-123923). */
#define MS_HAS_STACKREF_EXECUTABLE (PY_VERSION_HEX >= 0x030E0000)
/* 3.14: the interpreter's entry frames are FRAME_OWNED_BY_INTERPRETER and the owners were
 * renumbered (FRAME_OWNED_BY_CSTACK is assigned nowhere, gone in 3.15) (gh-128563). */
#define MS_HAS_FRAME_OWNED_BY_INTERPRETER (PY_VERSION_HEX >= 0x030E0000)
/* 3.12-3.13: PyDictObject.ma_version_tag, bumped by every change of the dict (deprecated
 * in 3.12, PEP 699; removed in 3.14, gh-124296). */
#define MS_HAS_DICT_VERSION_TAG (PY_VERSION_HEX < 0x030E0000)
/* 3.14: tuples cache their hash in PyTupleObject.ob_hash, -1 until computed (gh-131525). */
#define MS_HAS_TUPLE_HASH_CACHE (PY_VERSION_HEX >= 0x030E0000)

/* ------------------------------------------------------------------ headers */
#if MS_HAS_STACKREF_EXECUTABLE
#include <internal/pycore_interpframe_structs.h>
#endif
#if !MS_HAS_DICT_VERSION_TAG
/* the TLS dict's keys object and entries, read instead of the version tag */
#include <internal/pycore_dict.h>
#endif

/* ------------------------------------------------------------------ accessors */
/* The thread's top interpreter frame, or NULL. */
static inline _PyInterpreterFrame *ms_current_frame(PyThreadState *ts)
{
#if MS_HAS_TS_CURRENT_FRAME
    return ts->current_frame;
#else
    return ts->cframe != NULL ? ts->cframe->current_frame : NULL;
#endif
}

/* A frame owned by the C stack: an entry frame of the interpreter (frame.f_back skips
 * it). 3.12/3.13: FRAME_OWNED_BY_CSTACK; 3.14+: owner >= FRAME_OWNED_BY_INTERPRETER, as
 * CPython tests it. */
#if MS_HAS_FRAME_OWNED_BY_INTERPRETER
#define MS_OWNED_BY_C(f) ((f)->owner >= FRAME_OWNED_BY_INTERPRETER)
#else
#define MS_OWNED_BY_C(f) ((f)->owner == FRAME_OWNED_BY_CSTACK)
#endif

/* What a frame runs, unchecked: f_executable (3.13+: possibly another object than a
 * code object, or NULL; 3.14+: the tag bits masked off, a NULL reference masks to NULL)
 * or f_code (3.12). */
static inline PyObject *ms_frame_executable(_PyInterpreterFrame *f)
{
#if MS_HAS_STACKREF_EXECUTABLE
    return PyStackRef_AsPyObjectBorrow(f->f_executable);
#elif MS_HAS_FRAME_EXECUTABLE
    return f->f_executable;
#else
    return (PyObject *)f->f_code;
#endif
}

/* The frame's instruction pointer: instr_ptr (3.13+) or prev_instr (3.12). */
static inline _Py_CODEUNIT *ms_frame_instr(_PyInterpreterFrame *f)
{
#if MS_HAS_INSTR_PTR
    return f->instr_ptr;
#else
    return f->prev_instr;
#endif
}

#if MS_HAS_DICT_VERSION_TAG
/* The dict version tag (deprecated in 3.12 but still maintained in 3.12 and 3.13; the
 * loader verifies that it moves). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static inline uint64_t ms_dict_version(PyObject *d)
{
    return ((PyDictObject *)d)->ma_version_tag;
}
#pragma GCC diagnostic pop
#endif

/* A tuple (or tuple subclass instance) this code fills or reuses: its cached hash, if the
 * version has one, set to -1 (not computed), as tuple_alloc does. */
static inline void ms_tuple_reset_hash(PyObject *op)
{
#if MS_HAS_TUPLE_HASH_CACHE
    ((PyTupleObject *)op)->ob_hash = -1;
#else
    (void)op;
#endif
}

/* Layout entries that name a moved field (sysmon.c's ms_layout). */
#if MS_HAS_TS_CURRENT_FRAME
#define TS_FRAME_EXPR offsetof(PyThreadState, current_frame)
#else
#define TS_FRAME_EXPR offsetof(PyThreadState, cframe)
#endif
#if MS_HAS_FRAME_EXECUTABLE
#define IF_CODE_EXPR offsetof(_PyInterpreterFrame, f_executable)
#else
#define IF_CODE_EXPR offsetof(_PyInterpreterFrame, f_code)
#endif
#if MS_HAS_INSTR_PTR
#define IF_INSTR_EXPR offsetof(_PyInterpreterFrame, instr_ptr)
#else
#define IF_INSTR_EXPR offsetof(_PyInterpreterFrame, prev_instr)
#endif

#endif /* MONSTACK_COMPAT_H */
