/* monstack's PEP 523 eval_frame shim for CPython 3.11.
 *
 * Built by native/build.py into a position-independent, relocation-free blob
 * (monstack/_native/evalframe311-<arch>.bin, manifest evalframe311.json). Every external function and object is reached through
 * `DATA` (struct ms_data, shim311.h), which the loader fills in; the code itself
 * never names an external symbol.
 *
 * What it does, per Python frame evaluated by the interpreter:
 *   - filtered code (cached decision in co_extra): tail-call _PyEval_EvalFrameDefault;
 *   - tracked code: push the node (code, top, call-site offset) on this thread's
 *     shadow stack (monstack._stack.TLS.cell[0]), evaluate, pop.
 * The shadow stack is the one the Python core reads: TLS.cell is found through the
 * thread-state dict exactly as _thread._local finds it.
 *
 * Invariant checks. A push is trusted without looking further when its tracked
 * caller is the frame of the innermost live shim activation on this thread and the
 * stack top is that activation's node. Otherwise (frames that started before
 * install, generator frames linked in by gen.throw() without being evaluated,
 * stacks rebuilt from Python) the whole shadow chain is compared with the real
 * frames (code objects and call-site offsets) and rebuilt from the real frames on
 * any difference.
 *
 * Throws into filtered code. gen.throw() into a tracked generator that delegates
 * (yield from / await) to a *filtered* generator links the tracked frame (and any
 * delegating frames between) into the frame chain without evaluating it, and
 * evaluates only the filtered frame, with throwflag set. No node is pushed for the
 * linked-in frames, and when the thrower runs the same code as the generator it
 * throws into, "top node = nearest tracked frame's code" cannot tell them apart. So
 * a filtered frame evaluated with throwflag (never a per-call event) makes the
 * shadow chain describe the real frames from its nearest tracked caller outwards for
 * the duration of the evaluation, and puts the previous top back afterwards (the
 * linked-in frames are unlinked again when it returns; their own later resume is an
 * ordinary evaluation and pushes as usual). When the stack top is the node of the
 * innermost live shim activation (the thrower, usually), only the tracked frames
 * between that activation's frame and the filtered frame get nodes, on top of it;
 * otherwise the whole chain is compared with the real frames and, on any difference,
 * rebuilt from them, as a push does. Filtered frames without throwflag take one
 * extra test of a register.
 *
 * Frames evaluated on linked-in frames. _gen_throw also evaluates frames *above*
 * linked-in ones without throwflag: the generator a returning catcher returns into
 * (its delegating callers stay linked until the throw returns), a delegate's Python
 * throw() method, a tracked callback of a library catcher. Such a push, found on the
 * slow path (its tracked caller is not the innermost activation's frame), rebuilds
 * the chain with the linked frames in it, and its pop would leave their nodes on top.
 * So when the nearest tracked caller is linked in (suspended at its `yield from`/
 * `await`), the top to put back after the evaluation is that of the first tracked
 * frame past the linked ones, as for throwflag (see linked_restore). The fast path
 * never looks.
 *
 * Our own bookkeeping runs with tstate->tracing raised, so Python code it may cause
 * (the policy callback, finalizers run by a garbage collection) is never tracked
 * and never re-enters the shim's tracking, exactly as CPython shields its own trace
 * functions. A pending exception (throw into a generator, an exception leaving the
 * frame) is saved and restored around anything that could touch it.
 *
 * C stack: with an eval_frame set, 3.11 evaluates every Python call in a new C
 * frame. The shim refuses to start a frame whose C stack pointer is within
 * DATA.margin bytes of the thread's stack end and raises RecursionError instead of
 * letting the process crash.
 */
#include "shim311.h"

#pragma GCC visibility push(hidden)

struct ms_data DATA __attribute__((section(".bss.ms_data"), aligned(64)));

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

static inline void ms_incref(PyObject *o) { o->ob_refcnt++; }
static inline void ms_decref(PyObject *o)
{
    if (--o->ob_refcnt == 0) {
        DATA._Py_Dealloc(o);
    }
}

static inline PyObject **list_items(PyObject *list) { return ((PyListObject *)list)->ob_item; }
static inline PyObject **tuple_items(PyObject *t) { return ((PyTupleObject *)t)->ob_item; }

static inline int is_node(PyObject *o)
{
    return Py_TYPE(o) == DATA.tuple_type && Py_SIZE(o) == 3;
}

/* ---- per-thread records ------------------------------------------------- */

static uintptr_t compute_stack_limit(void)
{
    union { char bytes[256]; long double align; } attr;
    void *addr = 0;
    size_t size = 0;
    if (DATA.pthread_getattr_np(DATA.pthread_self(), &attr) != 0) {
        return 0;
    }
    int rc = DATA.pthread_attr_getstack(&attr, &addr, &size);
    DATA.pthread_attr_destroy(&attr);
    if (rc != 0 || addr == 0 || size == 0) {
        return 0;
    }
    size_t margin = (size_t)DATA.margin;
    if (margin > size / 4) {
        margin = size / 4;
    }
    return (uintptr_t)addr + margin;
}

static __attribute__((noinline)) struct ms_rec *claim_rec(struct ms_rec *r, PyThreadState *ts)
{
    DATA.n_rec_claim++;
    r->ts = ts;
    r->id = ts->id;
    r->gen = DATA.gen;
    r->active_frame = 0;
    r->active_node = 0;
    r->tdict = 0;
    r->restore = 0; /* (always taken right after it is set: nonzero only if a collision
                     * claimed the record meanwhile, a leaked reference at worst) */
    r->stack_limit = compute_stack_limit();
    return r;
}

static inline struct ms_rec *get_rec(PyThreadState *ts)
{
    uintptr_t h = ((uintptr_t)ts * 0x9E3779B97F4A7C15ULL) >> (64 - MS_REC_BITS);
    struct ms_rec *r = &DATA.recs[h];
    if (LIKELY(r->ts == ts && r->id == ts->id)) {
        if (UNLIKELY(r->gen != DATA.gen)) {
            r->gen = DATA.gen;
            r->active_frame = 0;
            r->active_node = 0;
            r->tdict = 0;
        }
        return r;
    }
    return claim_rec(r, ts);
}

/* ---- shadow stack cell: TLS.cell of this thread, or NULL (not seeded) ----- */

static __attribute__((noinline)) PyObject *lookup_cell(PyThreadState *ts, struct ms_rec *r)
{
    PyObject *tdict = ts->dict;
    r->tdict = 0;
    if (tdict == 0 || !DATA.enabled) {
        return 0;
    }
    PyObject *dummy = DATA.PyDict_GetItemWithError(tdict, DATA.tls_key);
    if (dummy == 0 || Py_TYPE(dummy) != DATA.dummy_type) {
        return 0;
    }
    PyObject *ldict = *(PyObject **)((char *)dummy + DATA.off_localdict);
    PyObject *cell = DATA.PyDict_GetItemWithError(ldict, DATA.str_cell);
    if (cell == 0 || Py_TYPE(cell) != DATA.list_type || Py_SIZE(cell) < 1) {
        return 0;
    }
    r->tdict = tdict;
    r->ldict = ldict;
    r->ldict_version = ((PyDictObject *)ldict)->ma_version_tag;
    r->cell = cell;
    return cell;
}

/* r must be this thread's record (get_rec(ts)), fetched with no call in between that
 * could have let other code run. */
static inline PyObject *get_cell_r(PyThreadState *ts, struct ms_rec *r)
{
    if (LIKELY(r->tdict != 0 && r->tdict == ts->dict &&
               ((PyDictObject *)r->ldict)->ma_version_tag == r->ldict_version && DATA.enabled)) {
        return r->cell;
    }
    return lookup_cell(ts, r);
}

static inline PyObject *get_cell(PyThreadState *ts)
{
    return get_cell_r(ts, get_rec(ts));
}

static inline void cell_set(PyObject *cell, PyObject *value) /* steals value */
{
    PyObject **items = list_items(cell);
    PyObject *old = items[0];
    items[0] = value;
    ms_decref(old);
}

/* ---- tracking decisions, cached per code object in co_extra --------------- */

/* 1 tracked, 0 filtered, -1 not decided in this epoch */
static inline int cached_decision(PyCodeObject *co)
{
    ms_code_extra *ex = (ms_code_extra *)co->co_extra;
    Py_ssize_t i = (Py_ssize_t)DATA.extra_index;
    if (ex == 0 || ex->ce_size <= i) {
        return -1;
    }
    uintptr_t v = (uintptr_t)ex->ce_extras[i];
    if ((int64_t)(v >> 1) != DATA.epoch) {
        return -1;
    }
    return (int)(v & 1);
}

#define DECIDE_HEADROOM 50

/* Ask the Python policy (tstate->tracing is raised by the caller, and any pending
 * exception saved). Returns 1/0. The callback never raises an Exception (it records
 * them); what escapes is a KeyboardInterrupt or other BaseException raised by a signal
 * handler that ran inside it. With can_raise, that exception is left set and -2
 * returned: the frame about to start fails with it, as CPython raises a signal
 * handler's exception at a frame's first instruction. Otherwise it is dropped
 * (counted in n_errors). A failure counts as "filtered", uncached. */
static __attribute__((noinline)) int decide_slow(PyThreadState *ts, PyCodeObject *co, PyObject *globals,
                                                 int can_raise)
{
    PyObject *decide = DATA.decide;
    if (decide == 0) {
        return 0;
    }
    DATA.n_decide++;
    ms_incref(decide);
    ts->recursion_remaining += DECIDE_HEADROOM;
    PyObject *r = DATA.PyObject_CallFunctionObjArgs(decide, (PyObject *)co, globals ? globals : DATA.py_none, (PyObject *)0);
    ts->recursion_remaining -= DECIDE_HEADROOM;
    ms_decref(decide);
    if (r == 0) {
        if (can_raise) {
            return -2;
        }
        DATA.PyErr_Clear();
        DATA.n_errors++;
        return 0;
    }
    int out;
    if (r == DATA.py_true) {
        out = 1;
    } else if (r == DATA.py_false) {
        out = 0;
    } else {
        ms_decref(r);
        return 0;
    }
    ms_decref(r);
    if (DATA._PyCode_SetExtra((PyObject *)co, (Py_ssize_t)DATA.extra_index,
                              (void *)(uintptr_t)(((uintptr_t)DATA.epoch << 1) | (uintptr_t)out)) < 0) {
        DATA.PyErr_Clear();
    }
    return out;
}

static inline int frame_incomplete(_PyInterpreterFrame *f)
{
    return f->owner != FRAME_OWNED_BY_GENERATOR &&
           f->prev_instr < _PyCode_CODE(f->f_code) + f->f_code->_co_firsttraceable;
}

static inline int frame_tracked(PyThreadState *ts, _PyInterpreterFrame *f)
{
    int d = cached_decision(f->f_code);
    if (LIKELY(d >= 0)) {
        return d;
    }
    return decide_slow(ts, f->f_code, f->f_globals, 0);
}

/* The nearest frame from f outwards that Python would show (complete) and is tracked. */
static inline _PyInterpreterFrame *next_tracked(PyThreadState *ts, _PyInterpreterFrame *f)
{
    while (f != 0 && (frame_incomplete(f) || !frame_tracked(ts, f))) {
        f = f->previous;
    }
    return f;
}

static inline Py_ssize_t frame_lasti(_PyInterpreterFrame *f)
{
    return (Py_ssize_t)(f->prev_instr - _PyCode_CODE(f->f_code)) * (Py_ssize_t)sizeof(_Py_CODEUNIT);
}

/* lasti_int's first use of an offset: make its int and keep it in the table. */
__attribute__((noinline, cold)) static PyObject *lasti_int_first(Py_ssize_t half)
{
    PyObject *li = DATA.PyLong_FromSsize_t(half * 2);
    if (li != 0) {
        DATA.lasti_ints[half] = li; /* the table's reference, never released */
        ms_incref(li);
    }
    return li;
}

/* The int `lasti` (a new reference; NULL with an exception set on failure): one kept
 * for good per even offset below 2 * MS_LASTI_INTS, so that pushes do not allocate for
 * the call sites of all but huge functions (the GIL serialises the first use). */
static inline __attribute__((always_inline)) PyObject *lasti_int(Py_ssize_t lasti)
{
    Py_ssize_t half = lasti >> 1;
    if (LIKELY(lasti >= 0 && (lasti & 1) == 0 && half < MS_LASTI_INTS)) {
        PyObject *li = DATA.lasti_ints[half];
        if (UNLIKELY(li == 0)) {
            return lasti_int_first(half);
        }
        ms_incref(li);
        return li;
    }
    return DATA.PyLong_FromSsize_t(lasti);
}

/* A new node (code, parent, lasti); steals parent. NULL on failure (parent released). */
static PyObject *new_node(PyObject *code, PyObject *parent, Py_ssize_t lasti)
{
    PyObject *li = lasti_int(lasti);
    if (li == 0) {
        ms_decref(parent);
        return 0;
    }
    PyObject *t = DATA.PyTuple_New(3);
    if (t == 0) {
        ms_decref(parent);
        ms_decref(li);
        return 0;
    }
    ms_incref(code);
    PyObject **items = tuple_items(t);
    items[0] = code;
    items[1] = parent;
    items[2] = li;
    return t;
}

/* Nodes for the tracked frames from c (a tracked frame or NULL) outwards, built from
 * the real frames. New reference (None for an empty stack), NULL on failure. */
static __attribute__((noinline)) PyObject *build_chain(PyThreadState *ts, _PyInterpreterFrame *c)
{
    _PyInterpreterFrame *small[64];
    _PyInterpreterFrame **frames = small;
    Py_ssize_t n = 0, cap = 64;
    for (_PyInterpreterFrame *f = c; f != 0; f = next_tracked(ts, f->previous)) {
        if (n == cap) {
            Py_ssize_t ncap = cap * 2;
            _PyInterpreterFrame **nf;
            if (frames == small) {
                nf = (_PyInterpreterFrame **)DATA.PyMem_Malloc((size_t)ncap * sizeof(*nf));
                if (nf != 0) {
                    for (Py_ssize_t i = 0; i < n; i++) {
                        nf[i] = small[i];
                    }
                }
            } else {
                nf = (_PyInterpreterFrame **)DATA.PyMem_Realloc(frames, (size_t)ncap * sizeof(*nf));
            }
            if (nf == 0) {
                if (frames != small) {
                    DATA.PyMem_Free(frames);
                }
                return 0;
            }
            frames = nf;
            cap = ncap;
        }
        frames[n++] = f;
    }
    PyObject *node = DATA.py_none;
    ms_incref(node);
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Py_ssize_t lasti = (i + 1 < n) ? frame_lasti(frames[i + 1]) : 0;
        node = new_node((PyObject *)frames[i]->f_code, node, lasti);
        if (node == 0) {
            break;
        }
    }
    if (frames != small) {
        DATA.PyMem_Free(frames);
    }
    return node;
}

/* Does the shadow chain from `node` describe exactly the tracked real frames from c
 * outwards (code objects and call sites)? */
static __attribute__((noinline)) int chain_matches(PyThreadState *ts, PyObject *node, _PyInterpreterFrame *c)
{
    for (;;) {
        if (c == 0) {
            return node == DATA.py_none;
        }
        if (!is_node(node)) {
            return 0;
        }
        PyObject **items = tuple_items(node);
        if (items[0] != (PyObject *)c->f_code) {
            return 0;
        }
        _PyInterpreterFrame *p = next_tracked(ts, c->previous);
        Py_ssize_t expected = p ? frame_lasti(p) : 0;
        if (Py_TYPE(items[2]) != DATA.long_type || DATA.PyLong_AsSsize_t(items[2]) != expected) {
            return 0;
        }
        node = items[1];
        c = p;
    }
}

/* Is f a generator or coroutine frame that gen.throw() linked into the frame chain
 * without evaluating it? It is suspended at its delegation point (the YIELD_VALUE of a
 * `yield from`/`await`, followed by a RESUME with oparg 2 or 3: what _PyGen_yf looks
 * for) though frames above it run. A frame that is running sits elsewhere (SEND, a
 * call...). */
static inline int linked_suspended(_PyInterpreterFrame *f)
{
    if (f->owner != FRAME_OWNED_BY_GENERATOR) {
        return 0;
    }
    _Py_CODEUNIT *first = _PyCode_CODE(f->f_code);
    _Py_CODEUNIT *at = f->prev_instr;
    if (at < first || at + 1 >= first + Py_SIZE(f->f_code)) {
        return 0;
    }
    return _Py_OPCODE(at[0]) == YIELD_VALUE && _Py_OPARG(at[1]) >= 2;
}

/* Linked-in callers. A frame evaluated while its nearest tracked caller c is a frame
 * gen.throw() linked in (3.11's _gen_throw resumes the generator that catches, or the
 * one a returning catcher returns into, from C, and calls a delegate's throw() method,
 * with the outer delegating frames linked above the thrower) and pushed on a chain
 * the push rebuilt (or seeded) with the linked frames in it would pop back to them,
 * but they leave without a pop: the throw unlinks them. So the top to put back after
 * its evaluation is the node of the first tracked frame past them: the innermost live
 * activation's node when that is the frame and the top before the push was that node
 * (`trusted`: the fast path holds again), else that frame's node in the chain.
 * `cell`'s top describes the tracked real frames from c outwards. Sets this thread's
 * record's `restore` (a new reference) when c is linked in; returns the cell (fetched
 * again: the policy may have run), or NULL when monstack was stopped meanwhile.
 * tracing is raised and no exception is pending. */
static __attribute__((noinline)) PyObject *linked_restore(PyThreadState *ts, PyObject *cell,
                                                          _PyInterpreterFrame *c, int64_t gen,
                                                          int trusted)
{
    struct ms_rec *r = get_rec(ts);
    if (c == r->active_frame || r->restore != 0 || !linked_suspended(c)) {
        return cell;
    }
    PyObject *top = list_items(cell)[0];
    ms_incref(top); /* next_tracked may run the policy, which may run other code */
    PyObject *node = top;
    _PyInterpreterFrame *f = c;
    while (f != 0 && linked_suspended(f)) {
        if (!is_node(node)) {
            break;
        }
        node = tuple_items(node)[1];
        f = next_tracked(ts, f->previous);
    }
    PyObject *restore = 0;
    if (f == 0 ? node == DATA.py_none : (is_node(node) && tuple_items(node)[0] == (PyObject *)f->f_code)) {
        r = get_rec(ts);
        if (trusted && f != 0 && f == r->active_frame) {
            node = r->active_node; /* kept alive by that activation */
        }
        ms_incref(node);
        restore = node;
    }
    ms_decref(top);
    cell = DATA.gen == gen ? get_cell(ts) : 0;
    if (restore != 0) {
        if (cell == 0) {
            ms_decref(restore);
        } else {
            get_rec(ts)->restore = restore;
        }
    }
    return cell;
}

/* An internal failure of a push: cleared and counted; a restore a push set is dropped. */
static __attribute__((noinline)) PyObject *push_failed(PyThreadState *ts)
{
    /* (the restore is in the chain on the stack: the decref frees nothing) */
    DATA.PyErr_Clear();
    DATA.n_errors++;
    struct ms_rec *r = get_rec(ts);
    if (r->restore != 0) { /* set by linked_restore before a later failure */
        PyObject *lr = r->restore;
        r->restore = 0;
        ms_decref(lr);
    }
    return 0;
}

/* push, this thread not seeded yet: build its stack from the real frames. Returns the
 * cell, or NULL when the frame is not to be pushed. */
static __attribute__((noinline)) PyObject *push_seed(PyThreadState *ts, _PyInterpreterFrame *c, int64_t gen)
{
    PyObject *top = build_chain(ts, c);
    if (top == 0) {
        return push_failed(ts);
    }
    if (DATA.gen != gen || !DATA.enabled) { /* stopped while the policy ran */
        ms_decref(top);
        return 0;
    }
    PyObject *newcell = DATA.PyList_New(1);
    if (newcell == 0) {
        ms_decref(top);
        return push_failed(ts);
    }
    list_items(newcell)[0] = top;
    int rc = DATA.PyObject_SetAttr(DATA.tls, DATA.str_cell, newcell);
    ms_decref(newcell);
    if (rc < 0) {
        return push_failed(ts);
    }
    DATA.n_seed++;
    PyObject *cell = get_cell(ts);
    if (cell == 0 || DATA.gen != gen) {
        return 0;
    }
    if (c != 0 && c->owner == FRAME_OWNED_BY_GENERATOR) {
        cell = linked_restore(ts, cell, c, gen, 0);
    }
    return cell;
}

/* push, the top not known to be right (its tracked caller c is not the innermost
 * activation's frame, or the top is not that activation's node): compare the chain
 * with the real frames, rebuild it from them on any difference. Returns the cell, or
 * NULL when the frame is not to be pushed. */
static __attribute__((noinline)) PyObject *push_resync(PyThreadState *ts, _PyInterpreterFrame *c, int64_t gen,
                                                       struct ms_rec *r, PyObject *top)
{
    int trusted = r->active_frame != 0 && top == r->active_node;
    int same = chain_matches(ts, top, c);
    if (DATA.gen != gen || !DATA.enabled) {
        return 0;
    }
    if (same) {
        DATA.n_verify++;
        return get_cell(ts); /* the policy may have let other code run */
    }
    PyObject *fresh = build_chain(ts, c);
    if (fresh == 0) {
        return push_failed(ts);
    }
    PyObject *cell = DATA.gen == gen ? get_cell(ts) : 0;
    if (cell == 0) {
        ms_decref(fresh);
        return 0;
    }
    cell_set(cell, fresh);
    DATA.n_resync++;
    /* (a chain that matched was put there by someone who puts it back: throw_resync,
     * or the pop of the frame that pushed it) */
    if (c != 0 && c->owner == FRAME_OWNED_BY_GENERATOR) {
        cell = linked_restore(ts, cell, c, gen, trusted);
    }
    return cell;
}

/* Push the node of `frame`. Returns our new reference to it, or NULL when the frame
 * is not pushed (internal failure, or monstack was stopped meanwhile). When the frame
 * is pushed on frames gen.throw() linked in, sets the record's `restore` to the top to
 * put back after the evaluation (see linked_restore). tracing is raised and no
 * exception is pending. */
static PyObject *push(PyThreadState *ts, _PyInterpreterFrame *frame, int64_t gen)
{
    _PyInterpreterFrame *c = next_tracked(ts, ts->cframe->current_frame);
    if (DATA.gen != gen) {
        return 0;
    }
    PyObject *cell = get_cell(ts);
    if (UNLIKELY(cell == 0)) {
        cell = push_seed(ts, c, gen);
        if (cell == 0) {
            return 0;
        }
    } else {
        struct ms_rec *r = get_rec(ts);
        PyObject *top = list_items(cell)[0];
        if (UNLIKELY(c == 0 || c != r->active_frame || top != r->active_node)) {
            cell = push_resync(ts, c, gen, r, top);
            if (cell == 0) {
                return 0;
            }
        }
    }
    ms_incref(cell);
    PyObject *top = list_items(cell)[0];
    ms_incref(top);
    PyObject *node = new_node((PyObject *)frame->f_code, top, c ? frame_lasti(c) : 0);
    if (node == 0) {
        ms_decref(cell);
        return push_failed(ts);
    }
    ms_incref(node);
    cell_set(cell, node);
    ms_decref(cell);
    DATA.n_push++;
    return node;
}

static void pop(PyThreadState *ts, PyObject *node, _PyInterpreterFrame *prev_frame,
                PyObject *prev_node, int64_t gen, int failed)
{
    PyObject *et = 0, *ev = 0, *etb = 0;
    ts->tracing++;
    if (failed) {
        DATA.PyErr_Fetch(&et, &ev, &etb);
    }
    struct ms_rec *r = get_rec(ts);
    if (r->gen == gen && r->active_node == node) {
        r->active_frame = prev_frame;
        r->active_node = prev_node;
    }
    if (DATA.gen == gen) {
        PyObject *cell = get_cell_r(ts, r);
        if (cell != 0) {
            PyObject *parent = tuple_items(node)[1];
            if (list_items(cell)[0] != parent) {
                ms_incref(parent);
                cell_set(cell, parent);
            }
        }
    } else {
        /* A frame pushed under an earlier install returns (or yields). The current
         * install's stack, seeded or rebuilt from the real frames while it ran, may
         * hold a node for it that no pop of this install removes; a snapshot of its
         * caller running the same code would answer from that node. Empty the top:
         * the next push or snapshot checks the chain against the real frames.
         * (get_cell_r finds nothing while monstack is stopped.) */
        PyObject *cell = get_cell_r(ts, r);
        if (cell != 0 && list_items(cell)[0] != DATA.py_none) {
            ms_incref(DATA.py_none);
            cell_set(cell, DATA.py_none);
        }
    }
    /* the kept snapshot of this frame (see build_snapshot): its frame is gone, it cannot
     * recur; dropped last (that may free code objects: weakref callbacks run Python) */
    PyObject *last = DATA.last_snap;
    if (last != 0 && tuple_items(last)[0] == node) {
        DATA.last_snap = 0;
    } else {
        last = 0;
    }
    ms_decref(node);
    if (last != 0) {
        ms_decref(last);
    }
    if (failed) {
        DATA.PyErr_Restore(et, ev, etb);
    }
    ts->tracing--;
}

#define MS_LINKED_MAX 32

/* Nodes for the tracked frames from c out to (not including) `a`, the frame of the
 * innermost live shim activation, on top of `base`, its node (steals base). NULL when
 * `a` is not among the next MS_LINKED_MAX tracked frames, or on failure. */
static __attribute__((noinline)) PyObject *linked_chain(PyThreadState *ts, _PyInterpreterFrame *c,
                                                        _PyInterpreterFrame *a, PyObject *base)
{
    _PyInterpreterFrame *frames[MS_LINKED_MAX];
    int n = 0;
    for (_PyInterpreterFrame *f = c; f != a; f = next_tracked(ts, f->previous)) {
        if (f == 0 || n == MS_LINKED_MAX) {
            ms_decref(base);
            return 0;
        }
        frames[n++] = f;
    }
    PyObject *node = base;
    for (int i = n - 1; i >= 0; i--) {
        node = new_node((PyObject *)frames[i]->f_code, node, frame_lasti(i + 1 < n ? frames[i + 1] : a));
        if (node == 0) {
            DATA.PyErr_Clear();
            return 0;
        }
    }
    return node;
}

/* A throw into filtered code: see "Throws into filtered code" at the top. Returns a
 * new reference to the top to put back after the evaluation, or NULL when the
 * shadow chain was left as it was (it matched, nothing tracked is outside, the thread
 * is not seeded, monstack was stopped, or an internal failure). tracing is raised
 * and no exception is pending. */
static __attribute__((noinline)) PyObject *throw_resync(PyThreadState *ts, int64_t gen, int *unseeded)
{
    _PyInterpreterFrame *c = next_tracked(ts, ts->cframe->current_frame);
    if (c == 0 || DATA.gen != gen || !DATA.enabled) {
        return 0;
    }
    struct ms_rec *r = get_rec(ts);
    PyObject *cell = get_cell_r(ts, r);
    if (cell == 0) {
        *unseeded = 1; /* anything seeded during the evaluation would include the linked-in frames */
        return 0;
    }
    PyObject *top = list_items(cell)[0];
    _PyInterpreterFrame *a = r->active_frame;
    int trusted = a != 0 && top == r->active_node;
    if (trusted && c == a) {
        return 0; /* a frame evaluated by the shim threw (not a linked-in one) */
    }
    ms_incref(top); /* next_tracked may run the policy, which may run other code */
    PyObject *fresh = 0;
    if (trusted) {
        /* the usual case: frames linked in between the thrower's activation and here */
        ms_incref(top);
        fresh = linked_chain(ts, c, a, top);
    }
    if (fresh == 0) {
        int same = chain_matches(ts, top, c);
        if (same || DATA.gen != gen || !DATA.enabled) {
            if (same) {
                DATA.n_verify++;
            }
            ms_decref(top);
            return 0;
        }
        trusted = 0;
        fresh = build_chain(ts, c);
        if (fresh == 0) {
            ms_decref(top);
            DATA.PyErr_Clear();
            DATA.n_errors++;
            return 0;
        }
    }
    cell = DATA.gen == gen ? get_cell(ts) : 0;
    /* a chain built on `top` is only right while `top` is still on the stack */
    if (cell == 0 || (trusted && list_items(cell)[0] != top)) {
        ms_decref(top);
        ms_decref(fresh);
        return 0;
    }
    ms_decref(top);
    PyObject *saved = list_items(cell)[0];
    ms_incref(saved);
    cell_set(cell, fresh);
    DATA.n_throw++;
    return saved;
}

/* After the evaluation: put `saved` back on top (steals it). */
static __attribute__((noinline)) void throw_restore(PyThreadState *ts, PyObject *saved, int64_t gen, int failed)
{
    PyObject *et = 0, *ev = 0, *etb = 0;
    ts->tracing++;
    if (failed) {
        DATA.PyErr_Fetch(&et, &ev, &etb);
    }
    if (DATA.gen == gen) {
        PyObject *cell = get_cell(ts);
        if (cell != 0 && list_items(cell)[0] != saved) {
            ms_incref(saved);
            cell_set(cell, saved);
        }
    }
    ms_decref(saved);
    if (failed) {
        DATA.PyErr_Restore(et, ev, etb);
    }
    ts->tracing--;
}

/* After an evaluation that started with this thread unseeded: unseed it again. */
static __attribute__((noinline)) void throw_unseed(PyThreadState *ts, int64_t gen, int failed)
{
    PyObject *et = 0, *ev = 0, *etb = 0;
    ts->tracing++;
    if (failed) {
        DATA.PyErr_Fetch(&et, &ev, &etb);
    }
    if (DATA.gen == gen && get_cell(ts) != 0) {
        if (DATA.PyObject_SetAttr(DATA.tls, DATA.str_cell, 0) < 0) {
            DATA.PyErr_Clear();
        }
    }
    if (failed) {
        DATA.PyErr_Restore(et, ev, etb);
    }
    ts->tracing--;
}

/* A filtered frame evaluated with throwflag. */
static __attribute__((noinline)) PyObject *filtered_throw(PyThreadState *ts, _PyInterpreterFrame *frame)
{
    PyObject *et = 0, *ev = 0, *etb = 0;
    int64_t gen = DATA.gen;
    int unseeded = 0;
    ts->tracing++;
    DATA.PyErr_Fetch(&et, &ev, &etb);
    PyObject *saved = throw_resync(ts, gen, &unseeded);
    DATA.PyErr_Restore(et, ev, etb);
    ts->tracing--;
    if (saved == 0) {
        PyObject *res = DATA._PyEval_EvalFrameDefault(ts, frame, 1);
        if (unseeded) {
            throw_unseed(ts, gen, res == 0);
        }
        return res;
    }
    PyObject *res = DATA._PyEval_EvalFrameDefault(ts, frame, 1);
    throw_restore(ts, saved, gen, res == 0);
    return res;
}

/* Take the record's `restore` (see linked_restore) after a push: the top to put back
 * after the evaluation, unless one is already to be put back (`saved`: a throw). (The
 * dropped one is still held: it is the activation's node or in the chain below the
 * node just pushed; tracing raised all the same.) */
static __attribute__((noinline)) PyObject *take_restore(PyThreadState *ts, struct ms_rec *r, PyObject *saved)
{
    PyObject *lr = r->restore;
    r->restore = 0;
    if (saved != 0) {
        ts->tracing++;
        ms_decref(lr);
        ts->tracing--;
        return saved;
    }
    return lr;
}

static __attribute__((noinline)) PyObject *
tracked_eval(PyThreadState *ts, _PyInterpreterFrame *frame, int throwflag, int decided)
{
    PyObject *et = 0, *ev = 0, *etb = 0;
    int64_t gen = DATA.gen;
    PyObject *node = 0;
    ts->tracing++;
    if (throwflag) {
        DATA.PyErr_Fetch(&et, &ev, &etb);
    }
    if (decided < 0) {
        decided = decide_slow(ts, frame->f_code, frame->f_globals, !throwflag);
        if (decided == -2) { /* a signal handler's exception: this frame raises it */
            ts->tracing--;
            return 0;
        }
    }
    PyObject *saved = 0;
    if (decided > 0 && DATA.enabled && DATA.gen == gen) {
        if (throwflag) { /* frames may be linked in: a rebuilt chain must not outlive the pop */
            struct ms_rec *r = get_rec(ts);
            PyObject *cell = get_cell_r(ts, r);
            /* only a top known to be right (the innermost activation's node) is put back */
            if (cell != 0 && r->active_frame != 0 && list_items(cell)[0] == r->active_node) {
                saved = list_items(cell)[0];
                ms_incref(saved);
            }
        }
        node = push(ts, frame, gen);
        if (node == 0 && saved != 0) {
            ms_decref(saved);
            saved = 0;
        }
    }
    if (throwflag) {
        DATA.PyErr_Restore(et, ev, etb);
    }
    ts->tracing--;
    if (node == 0) {
        if (UNLIKELY(throwflag && decided == 0)) { /* decided just now: filtered */
            return filtered_throw(ts, frame);
        }
        return DATA._PyEval_EvalFrameDefault(ts, frame, throwflag);
    }
    struct ms_rec *r = get_rec(ts);
    if (UNLIKELY(r->restore != 0)) { /* pushed on frames gen.throw() linked in */
        saved = take_restore(ts, r, saved);
    }
    _PyInterpreterFrame *prev_frame = r->active_frame;
    PyObject *prev_node = r->active_node;
    r->active_frame = frame;
    r->active_node = node;
    PyObject *res = DATA._PyEval_EvalFrameDefault(ts, frame, throwflag);
    pop(ts, node, prev_frame, prev_node, gen, res == 0);
    if (saved != 0) {
        throw_restore(ts, saved, gen, res == 0);
    }
    return res;
}

static inline uintptr_t stack_pointer(void)
{
    uintptr_t sp;
#if defined(__x86_64__)
    __asm__ volatile("mov %%rsp, %0" : "=r"(sp));
#elif defined(__aarch64__)
    __asm__ volatile("mov %0, sp" : "=r"(sp));
#else
#error "unsupported architecture"
#endif
    return sp;
}

static __attribute__((noinline)) PyObject *stack_exhausted(PyThreadState *ts)
{
    (void)ts;
    DATA.n_stack_refused++;
    DATA.PyErr_SetString(DATA.exc_recursion,
                         "maximum recursion depth exceeded (the C stack is nearly exhausted: "
                         "monstack's eval_frame shim refused to start another Python frame)");
    return 0;
}

/* The part of ms_eval_frame after the thread's record is known, for every case but
 * "filtered, no throw" (which ms_eval_frame finishes itself). */
static __attribute__((noinline)) PyObject *eval_decided(PyThreadState *ts, _PyInterpreterFrame *frame,
                                                        int throwflag, int d)
{
    if (d == 0) {
        return filtered_throw(ts, frame);
    }
    return tracked_eval(ts, frame, throwflag, d);
}

/* ms_eval_frame when this thread's record is not ready (first frame of a thread, a new
 * install): claim or reset it, then go on as ms_eval_frame does. */
static __attribute__((noinline)) PyObject *eval_new_rec(PyThreadState *ts, _PyInterpreterFrame *frame,
                                                        int throwflag)
{
    struct ms_rec *r = get_rec(ts);
    if (UNLIKELY(stack_pointer() < r->stack_limit)) {
        return stack_exhausted(ts);
    }
    int d = cached_decision(frame->f_code);
    if (d == 0 && !throwflag) {
        return DATA._PyEval_EvalFrameDefault(ts, frame, 0);
    }
    return eval_decided(ts, frame, throwflag, d);
}

/* Coroutine exits (monstack._backend.COROUTINE_EXIT): a coroutine frame's evaluation
 * failed. When its caller (frame->previous, read before the evaluation: the frame is
 * cleared by then) runs no generator, coroutine or async generator code -- nothing
 * awaits it: the outermost coroutine of an asyncio task's step -- and the exception is
 * an Exception, call the handler with (code, exception), the exception normalized (as
 * whoever catches it normalizes it) and put back. The handler's failures are cleared. */
static __attribute__((noinline, cold)) void coro_exit(PyThreadState *ts, PyCodeObject *code,
                                                      _PyInterpreterFrame *caller)
{
    PyObject *handler = list_items(DATA.coro_exit)[0];
    if (handler == DATA.py_none) {
        return;
    }
    if (caller != 0 && (caller->f_code->co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE |
                                                     CO_ASYNC_GENERATOR))) {
        return; /* awaited by that frame */
    }
    PyObject *et = 0, *ev = 0, *etb = 0;
    ts->tracing++;
    DATA.PyErr_Fetch(&et, &ev, &etb);
    if (et != 0 && DATA.PyErr_GivenExceptionMatches(et, DATA.exc_exception)) {
        DATA.PyErr_NormalizeException(&et, &ev, &etb);
        if (ev != 0) {
            PyObject *res = DATA.PyObject_CallFunctionObjArgs(handler, (PyObject *)code, ev, (PyObject *)0);
            if (res == 0) {
                DATA.PyErr_Clear();
                DATA.n_errors++;
            }
            else {
                ms_decref(res);
            }
        }
    }
    DATA.PyErr_Restore(et, ev, etb);
    ts->tracing--;
}

/* ms_eval_frame's dispatch, once the frame is known to be evaluated by the shim. */
__attribute__((always_inline)) static inline PyObject *eval_dispatch(PyThreadState *ts, _PyInterpreterFrame *frame,
                                                         int throwflag)
{
    uintptr_t h = ((uintptr_t)ts * 0x9E3779B97F4A7C15ULL) >> (64 - MS_REC_BITS);
    struct ms_rec *r = &DATA.recs[h];
    if (UNLIKELY(r->ts != ts || r->id != ts->id || r->gen != DATA.gen)) {
        return eval_new_rec(ts, frame, throwflag); /* what get_rec would claim or reset */
    }
    if (UNLIKELY(stack_pointer() < r->stack_limit)) {
        return stack_exhausted(ts);
    }
    int d = cached_decision(frame->f_code);
    if (LIKELY(d == 0 && !throwflag)) {
        return DATA._PyEval_EvalFrameDefault(ts, frame, 0);
    }
    return eval_decided(ts, frame, throwflag, d);
}

/* A coroutine frame's evaluation, watched for its exit with an exception. */
static __attribute__((noinline)) PyObject *coro_eval(PyThreadState *ts, _PyInterpreterFrame *frame, int throwflag)
{
    PyCodeObject *code = frame->f_code;
    _PyInterpreterFrame *caller = frame->previous;
    ms_incref((PyObject *)code);
    PyObject *res = eval_dispatch(ts, frame, throwflag);
    if (UNLIKELY(res == 0)) {
        coro_exit(ts, code, caller);
    }
    ms_decref((PyObject *)code);
    return res;
}

/* The entry. Filtered code (the decision cached in co_extra) without a throw is the
 * hot case: it ends in a tail call of the default evaluator, and every other case in a
 * tail call of an out-of-line function, so that this path saves no register.
 * Coroutine frames, while a handler of their exits is set, go through coro_eval. */
__attribute__((used, section(".text.ms_entry")))
PyObject *ms_eval_frame(PyThreadState *ts, _PyInterpreterFrame *frame, int throwflag)
{
    if (UNLIKELY(!DATA.enabled || ts->tracing || ts->interp != DATA.interp)) {
        return DATA._PyEval_EvalFrameDefault(ts, frame, throwflag);
    }
    if (UNLIKELY((frame->f_code->co_flags & CO_COROUTINE) && list_items(DATA.coro_exit)[0] != DATA.py_none)) {
        return coro_eval(ts, frame, throwflag);
    }
    return eval_dispatch(ts, frame, throwflag);
}


/* ---- the native snapshot ------------------------------------------------------
 *
 * monstack.snapshot()'s O(1) case without running Python, as the 3.12/3.13 callbacks
 * have it (sysmon.c's ms_snapshot_new / ms_capture), answering exactly what
 * snapshot()'s inline Python path answers, or declining (then that path runs):
 *   - the frame: snapshot()'s caller (ms_snapshot_new, called from snapshot()) or the
 *     caller of ms_capture itself (snapshotter()'s function), incomplete frames
 *     skipped as frame.f_back skips them;
 *   - when that frame's file is filtered (a framework taking the snapshot for its
 *     user), up to MS_FILTERED_HOPS frames of files known to be filtered are looked
 *     through to the nearest tracked frame; a file not decided yet: decline;
 *   - the thread's top node must run that frame's code with a known call site;
 *   - the Snapshot is (top, f_lasti, None, None, 0), or under a current origin of
 *     exactly the Snapshot class (top, f_lasti, origin, None, origin's meta + 1) --
 *     Snapshot._new's layout (checked by the loader); a chain due to be shortened
 *     declines (Snapshot._new makes the shortened copy).
 * Tracked/filtered is the policy's per-file decision: the co_extra cache of this epoch
 * (set from the same policy), else its tracked_files() dict.
 * Declines too when the install retired the paths (uninstall, a distrusted stack: its
 * token is no longer DATA.snap_live), when another eval_frame function replaced ours
 * (the shadow stack is stale), and in another interpreter. */

#define MS_FILTERED_HOPS 16
#define MS_HOP_BITS 32
#define MS_HOP_MASK ((1LL << MS_HOP_BITS) - 1)

/* The policy's decision for co's file: 1 tracked, 0 filtered, -1 not decided (or not
 * a plain str file name). Runs no Python code. */
static inline int file_decision(PyCodeObject *co)
{
    int d = cached_decision(co);
    if (LIKELY(d >= 0)) {
        return d;
    }
    PyObject *by_file = DATA.by_file;
    PyObject *name = co->co_filename;
    if (by_file == 0 || Py_TYPE(name) != DATA.str_type) {
        return -1;
    }
    PyObject *v = DATA.PyDict_GetItemWithError(by_file, name);
    if (v == DATA.py_true) {
        return 1;
    }
    if (v == DATA.py_false) {
        return 0;
    }
    if (v == 0 && DATA.PyErr_Occurred() != 0) {
        DATA.PyErr_Clear();
    }
    return -1;
}

static inline _PyInterpreterFrame *complete_from(_PyInterpreterFrame *f)
{
    while (f != 0 && frame_incomplete(f)) {
        f = f->previous;
    }
    return f;
}

/* The meta int of a snapshot linked to `origin` (new reference), or NULL: decline. */
static __attribute__((noinline)) PyObject *linked_meta(PyObject *origin)
{
    PyObject *shorten = DATA.shorten;
    if (Py_TYPE(origin) != DATA.snap_cls || Py_SIZE(origin) != 5 || shorten == 0 ||
        Py_TYPE(shorten) != DATA.list_type || Py_SIZE(shorten) != 1) {
        return 0;
    }
    PyObject *m = tuple_items(origin)[4];
    PyObject *at = list_items(shorten)[0];
    if (Py_TYPE(m) != DATA.long_type || Py_TYPE(at) != DATA.long_type) {
        return 0;
    }
    Py_ssize_t meta = DATA.PyLong_AsSsize_t(m);
    Py_ssize_t shorten_at = DATA.PyLong_AsSsize_t(at);
    if (meta < 0 || shorten_at < 0 || meta >= PY_SSIZE_T_MAX) {
        if (DATA.PyErr_Occurred() != 0) {
            DATA.PyErr_Clear();
        }
        return 0;
    }
    meta += 1;
    if ((meta & MS_HOP_MASK) >= shorten_at) {
        return 0;
    }
    PyObject *out = DATA.PyLong_FromSsize_t(meta);
    if (out == 0) {
        DATA.PyErr_Clear();
    }
    return out;
}

/* The Snapshot (new reference), NULL with an exception (out of memory), or None
 * (new reference): take the Python path. from_caller: the frame is the current
 * frame's caller (called from snapshot()), else the current frame. */
static PyObject *build_snapshot(PyObject *self, int from_caller)
{
    PyTypeObject *cls = DATA.snap_cls;
    if (UNLIKELY(self != DATA.snap_live || self == 0 || cls == 0 || !DATA.enabled ||
                 *DATA.eval_slot != (void *)ms_eval_frame)) {
        goto decline;
    }
    PyThreadState *ts = DATA.PyThreadState_Get();
    if (UNLIKELY(ts->interp != DATA.interp)) {
        goto decline;
    }
    _PyInterpreterFrame *f = ts->cframe->current_frame;
    if (f == 0) {
        goto decline;
    }
    f = complete_from(from_caller ? f->previous : f);
    PyObject *cell = get_cell(ts);
    if (UNLIKELY(cell == 0)) {
        goto decline;
    }
    PyObject *top = list_items(cell)[0];
    /* An empty shadow stack with only frames of files known to be filtered looked at
     * (the bottom reached, or the limit: the user's code excluded, a framework's
     * thread): the empty snapshot, (None, -1), as snapshot()'s Python path answers. */
    int empty = top == DATA.py_none;
    if (!empty && !is_node(top)) {
        goto decline;
    }
    Py_ssize_t lasti = -1;
    for (int hops = 0;; hops++) {
        if (f == 0) {
            if (empty) {
                goto found;
            }
            goto decline;
        }
        int d = file_decision(f->f_code);
        if (LIKELY(d > 0)) {
            if (empty) {
                goto decline;
            }
            break;
        }
        if (d < 0) {
            goto decline;
        }
        if (hops == MS_FILTERED_HOPS) {
            if (empty) {
                goto found;
            }
            goto decline;
        }
        f = complete_from(f->previous);
    }
    PyObject *site = tuple_items(top)[2];
    if (tuple_items(top)[0] != (PyObject *)f->f_code || Py_TYPE(site) != DATA.long_type || Py_SIZE(site) < 0) {
        goto decline;
    }
    lasti = frame_lasti(f);
    if (lasti < 0) {
        goto decline;
    }
found:;
    PyObject *origin = 0;
    if (DATA.PyContextVar_Get(DATA.origin_var, 0, &origin) < 0) {
        DATA.PyErr_Clear();
        goto decline;
    }
    if (origin == 0) {
        origin = DATA.py_none;
        ms_incref(origin);
    }
    PyObject *meta;
    if (LIKELY(origin == DATA.py_none)) {
        meta = lasti_int(0); /* the int 0 (a small int: never fails) */
        if (meta == 0) {
            DATA.PyErr_Clear();
            ms_decref(origin);
            goto decline;
        }
    } else {
        meta = linked_meta(origin);
        if (meta == 0) {
            ms_decref(origin);
            goto decline;
        }
    }
    /* The same snapshot as the last one (a loop submitting jobs or creating tasks at one
     * call site): that one again, not an equal copy. A snapshot is an immutable value,
     * and while kept it holds its top node, which so cannot have been freed and reused
     * for another frame: the same items make the same snapshot. */
    PyObject *last = DATA.last_snap;
    if (last != 0 && DATA.last_lasti == (int64_t)lasti && tuple_items(last)[0] == top &&
        tuple_items(last)[2] == origin && tuple_items(last)[4] == meta && Py_TYPE(last) == cls) {
        ms_incref(last);
        ms_decref(meta);
        ms_decref(origin);
        DATA.n_snap++;
        return last;
    }
    PyObject *off = lasti_int(lasti);
    if (off == 0) {
        ms_decref(meta);
        ms_decref(origin);
        return 0;
    }
    ms_incref(top); /* before the allocation: a collection may run code that replaces cell[0] */
    PyObject *snap = cls->tp_alloc(cls, 5); /* as tuple.__new__(cls, ...) allocates */
    if (snap == 0) {
        ms_decref(top);
        ms_decref(off);
        ms_decref(meta);
        ms_decref(origin);
        return 0;
    }
    PyObject **items = tuple_items(snap);
    items[0] = top;
    items[1] = off;
    items[2] = origin;
    ms_incref(DATA.py_none);
    items[3] = DATA.py_none;
    items[4] = meta;
    DATA.n_snap++;
    ms_incref(snap);
    last = DATA.last_snap;
    DATA.last_snap = snap;
    DATA.last_lasti = (int64_t)lasti;
    if (last != 0) {
        ms_decref(last); /* (may run Python code: the kept one is consistent) */
    }
    return snap;
decline:
    DATA.n_snap_py++;
    ms_incref(DATA.py_none);
    return DATA.py_none;
}

/* snapshot_new() -> the Snapshot of the caller of the Python function calling it
 * (monstack.snapshot()), or None: take the Python path. */
__attribute__((used, noinline))
PyObject *ms_snapshot_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (UNLIKELY(nargs != 0)) {
        ms_incref(DATA.py_none);
        return DATA.py_none;
    }
    return build_snapshot(self, 1);
}

/* snapshot_forget() -> None: let go of the kept snapshot (the install retires its native
 * snapshot paths). */
__attribute__((used, noinline))
PyObject *ms_snapshot_forget(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    (void)args;
    (void)nargs;
    PyObject *last = DATA.last_snap;
    DATA.last_snap = 0;
    if (last != 0) {
        ms_decref(last);
    }
    ms_incref(DATA.py_none);
    return DATA.py_none;
}

/* capture() -> the Snapshot of its caller, always: monstack.snapshotter()'s function
 * (self: the install's token, a 1-tuple holding monstack.snapshot). What the native
 * case does not cover, and everything once the install retired its paths, goes to
 * monstack.snapshot, called from C so that its caller is capture()'s caller. */
__attribute__((used, noinline))
PyObject *ms_capture(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (UNLIKELY(self == 0 || Py_TYPE(self) != DATA.tuple_type || Py_SIZE(self) != 1)) {
        DATA.PyErr_SetString(DATA.exc_type_error, "monstack capture(): not set up");
        return 0;
    }
    if (UNLIKELY(nargs != 0)) {
        DATA.PyErr_SetString(DATA.exc_type_error, "capture() takes no arguments");
        return 0;
    }
    PyObject *snap = build_snapshot(self, 0);
    if (LIKELY(snap != DATA.py_none)) {
        return snap;
    }
    ms_decref(snap);
    PyObject *slow = tuple_items(self)[0];
    ms_incref(slow);
    ms_incref(self);
    PyObject *res = DATA.PyObject_CallFunctionObjArgs(slow, (PyObject *)0);
    ms_decref(self);
    ms_decref(slow);
    return res;
}

/* The origin carrier (after ms_decref). */
#include "carrier.h"
