/* Offsets build.py records in the metadata: read from the assembly gcc emits for
 * this file (so that cross builds need not run target code). Not part of the blob. */
#include "shim311.h"
#include <internal/pycore_interp.h>

#define MS_EMIT(name, expr) const unsigned long long ms_off__##name = (expr);

/* interpreter structs the shim reads (verified by the loader) */
MS_INTERP_OFFSETS(MS_EMIT)
MS_EMIT(interp_eval_frame, offsetof(PyInterpreterState, eval_frame))

/* struct ms_data: the table and the fields the loader writes */
#define MS_EMIT_API(ret, name, args) MS_EMIT(table__##name, offsetof(struct ms_data, name))
MS_API_TABLE(MS_EMIT_API)
#define MS_EMIT_FIELD(name, type) MS_EMIT(field__##name, offsetof(struct ms_data, name))
MS_OBJ_FIELDS(MS_EMIT_FIELD)
#define MS_EMIT_COUNTER(name) MS_EMIT(counter__##name, offsetof(struct ms_data, name))
MS_COUNTERS(MS_EMIT_COUNTER)
MS_EMIT(data__magic, offsetof(struct ms_data, magic))
MS_EMIT(data__size, sizeof(struct ms_data))
MS_EMIT(data__recs, offsetof(struct ms_data, recs))
MS_EMIT(data__sizeof_rec, sizeof(struct ms_rec))
MS_EMIT(data__nrec, MS_NREC)
