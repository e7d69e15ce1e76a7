/* bench-only variant: calls a Python push hook and pop hook per frame */
#include "shim311.h"
#pragma GCC visibility push(hidden)
struct ms_data DATA __attribute__((section(".bss.ms_data"), aligned(64)));
static inline void dec(PyObject *o) { if (--o->ob_refcnt == 0) DATA._Py_Dealloc(o); }
__attribute__((used, section(".text.ms_entry")))
PyObject *ms_eval_frame(PyThreadState *ts, _PyInterpreterFrame *frame, int throwflag)
{
    if (!DATA.enabled || ts->tracing) return DATA._PyEval_EvalFrameDefault(ts, frame, throwflag);
    PyObject *et = 0, *ev = 0, *etb = 0;
    ts->tracing++;
    if (throwflag) DATA.PyErr_Fetch(&et, &ev, &etb);
    PyObject *r = DATA.PyObject_CallFunctionObjArgs(DATA.decide, (PyObject *)frame->f_code, (PyObject *)0);
    if (r) dec(r); else DATA.PyErr_Clear();
    if (throwflag) DATA.PyErr_Restore(et, ev, etb);
    ts->tracing--;
    PyObject *res = DATA._PyEval_EvalFrameDefault(ts, frame, throwflag);
    ts->tracing++;
    if (!res) DATA.PyErr_Fetch(&et, &ev, &etb);
    r = DATA.PyObject_CallFunctionObjArgs(DATA.tls, (PyObject *)frame->f_code, (PyObject *)0);
    if (r) dec(r); else DATA.PyErr_Clear();
    if (!res) DATA.PyErr_Restore(et, ev, etb);
    ts->tracing--;
    return res;
}
