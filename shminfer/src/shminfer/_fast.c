/* shminfer._fast: the optional C hot path (stable ABI, Python >= 3.9: one abi3 wheel).
 *
 * Same memory layout and semantics as the pure-Python path (queue.py, client.py,
 * worker.py, answers.py): the per-request foreign calls and the stores, fences and spins around
 * them, and the worker's serve step for a request of a layout its slot had before (Loop,
 * below). Addresses are plain integers into the segment mapping, computed once by the
 * caller (_sys.address_of); the caller keeps the mapping alive (Loop holds an export).
 * Only Loop and Port.recv read what a peer can write beyond state words: each such word
 * once, into a local, checked as the Python worker and client check it (see the comments
 * above Loop and Port); every payload descriptor is still parsed and validated by the
 * Python decoder, and what the C code reuses is what that decoder validated.
 *
 * Port (the client's side) does the same for Client.start's encode and publish and
 * Client.finish's spin and checks, for a slot's last layout.
 *
 * Offsets must match queue.py: header doorbell 48, worker_sleeping 52, ring_head 72;
 * slot header waiter 4, seq 8, request_len 20, response_len 32, batch_size 36,
 * enqueue_ns 40, start_ns 48, done_ns 56, response_seq 72; states READY 2, PROCESSING
 * 3, DONE 4; ring records 6 x u64.
 * SHMINFER_PURE=1 (read by _sys.py) keeps this module unused.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef __linux__
#error "shminfer._fast needs Linux futexes"
#endif

#include <errno.h>
#include <limits.h>
#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2 (every x86-64): the streaming stores of copy_to_peer */
#endif
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define H_DOORBELL 48
#define H_WORKER_SLEEPING 52
#define S_SEQ 8
#define S_REQUEST_LEN 20
#define S_ENQUEUE_NS 40
#define S_WAITER 4
#define ST_READY 2u
#define ST_PROCESSING 3u

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("" ::: "memory"); /* no PAUSE: in a VM it can trap (pause-loop exiting) */
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint32_t load32(uintptr_t addr)
{
    return __atomic_load_n((uint32_t *)addr, __ATOMIC_ACQUIRE);
}

static inline long futex(uintptr_t addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static int get_addr(PyObject *obj, uintptr_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v == 0 || (v & 3)) {
        PyErr_SetString(PyExc_ValueError, "shminfer._fast: bad address");
        return -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

/* fence(): a full memory barrier (store -> load ordering), as _sys.full_fence. */
static PyObject *fast_fence(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* futex_wait(addr, expected, timeout_s or None) -> bool (False on timeout). */
static PyObject *fast_futex_wait(PyObject *self, PyObject *args)
{
    PyObject *a, *t;
    unsigned long expected;
    uintptr_t addr;
    struct timespec ts, *tsp = NULL;
    long ret;
    int err;
    (void)self;
    if (!PyArg_ParseTuple(args, "OkO", &a, &expected, &t) || get_addr(a, &addr) < 0)
        return NULL;
    if (t != Py_None) {
        double s = PyFloat_AsDouble(t);
        if (s == -1.0 && PyErr_Occurred())
            return NULL;
        if (s < 0)
            s = 0;
        ts.tv_sec = (time_t)s;
        ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec > 999999999)
            ts.tv_nsec = 999999999;
        tsp = &ts;
    }
    Py_BEGIN_ALLOW_THREADS
    ret = futex(addr, FUTEX_WAIT, (uint32_t)expected, tsp);
    err = errno;
    Py_END_ALLOW_THREADS
    if (ret == 0 || err == EAGAIN || err == EINTR)
        Py_RETURN_TRUE;
    if (err == ETIMEDOUT)
        Py_RETURN_FALSE;
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* futex_wake(addr, count=INT_MAX) -> woken. */
static PyObject *fast_futex_wake(PyObject *self, PyObject *args)
{
    PyObject *a;
    int count = INT_MAX;
    uintptr_t addr;
    long ret;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i", &a, &count) || get_addr(a, &addr) < 0)
        return NULL;
    ret = futex(addr, FUTEX_WAKE, (uint32_t)count, NULL);
    if (ret < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(ret);
}

/* ring_doorbell(header_addr): bump the doorbell, fence, wake the worker if it sleeps. */
static void doorbell(uintptr_t head)
{
    uint32_t *bell = (uint32_t *)(head + H_DOORBELL);
    __atomic_store_n(bell, __atomic_load_n(bell, __ATOMIC_RELAXED) + 1u, __ATOMIC_RELAXED);
    /* READY and the doorbell before the load of worker_sleeping (see queue.ring_doorbell). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load32(head + H_WORKER_SLEEPING))
        futex(head + H_DOORBELL, FUTEX_WAKE, INT_MAX, NULL);
}

static PyObject *fast_ring_doorbell(PyObject *self, PyObject *arg)
{
    uintptr_t head;
    (void)self;
    if (get_addr(arg, &head) < 0)
        return NULL;
    doorbell(head);
    Py_RETURN_NONE;
}

/* publish(slot_addr, state_addr, header_addr, length, seq): the client's end of start():
 * request_len, seq, enqueue_ns, then READY (release: after the payload and the fields),
 * then the doorbell. */
static PyObject *fast_publish(PyObject *self, PyObject *args)
{
    PyObject *s, *st, *h;
    unsigned long length;
    unsigned long long seq;
    uintptr_t slot, state, head;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOkK", &s, &st, &h, &length, &seq) || get_addr(s, &slot) < 0 ||
        get_addr(st, &state) < 0 || get_addr(h, &head) < 0)
        return NULL;
    if (length > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "request length over 2**32");
        return NULL;
    }
    *(volatile uint32_t *)(slot + S_REQUEST_LEN) = (uint32_t)length;
    *(volatile uint64_t *)(slot + S_SEQ) = (uint64_t)seq;
    *(volatile uint64_t *)(slot + S_ENQUEUE_NS) = monotonic_ns();
    __atomic_store_n((uint32_t *)state, ST_READY, __ATOMIC_RELEASE);
    doorbell(head);
    Py_RETURN_NONE;
}

/* spin_state(state_addr, spin_ns) -> state: spin (GIL released) while the slot is READY
 * or PROCESSING, at most spin_ns; returns the last state read. */
static PyObject *fast_spin_state(PyObject *self, PyObject *args)
{
    PyObject *a;
    long long spin_ns;
    uintptr_t addr;
    uint32_t state;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL", &a, &spin_ns) || get_addr(a, &addr) < 0)
        return NULL;
    state = load32(addr);
    if ((state == ST_READY || state == ST_PROCESSING) && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        uint64_t until = monotonic_ns() + (uint64_t)spin_ns;
        unsigned n = 0;
        for (;;) {
            state = load32(addr);
            if (state != ST_READY && state != ST_PROCESSING)
                break;
            cpu_relax();
            if (!(++n & 31) && monotonic_ns() >= until)
                break;
        }
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromUnsignedLong(state);
}

/* spin_ready(states_addr, count, spin_ns) -> bool: spin (GIL released) until one of the
 * count states is READY, at most spin_ns. */
static PyObject *fast_spin_ready(PyObject *self, PyObject *args)
{
    PyObject *a;
    Py_ssize_t count, i;
    long long spin_ns;
    uintptr_t addr;
    int found = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnL", &a, &count, &spin_ns) || get_addr(a, &addr) < 0)
        return NULL;
    if (count < 0 || count > 65536) {
        PyErr_SetString(PyExc_ValueError, "bad slot count");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint64_t until = monotonic_ns() + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
    for (;;) {
        const volatile uint32_t *states = (const volatile uint32_t *)addr;
        for (i = 0; i < count; i++)
            if (states[i] == ST_READY) {
                found = 1;
                break;
            }
        if (found || monotonic_ns() >= until)
            break;
        cpu_relax();
    }
    Py_END_ALLOW_THREADS
    if (found)
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return PyBool_FromLong(found);
}

/* answer(state_addr, slot_addr, state): the worker's publish of DONE or ERROR (the
 * response and its fields are written already): store, fence, wake a sleeping client. */
static PyObject *fast_answer(PyObject *self, PyObject *args)
{
    PyObject *st, *s;
    unsigned long value;
    uintptr_t state, slot;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOk", &st, &s, &value) || get_addr(st, &state) < 0 ||
        get_addr(s, &slot) < 0)
        return NULL;
    __atomic_store_n((uint32_t *)state, (uint32_t)value, __ATOMIC_RELEASE);
    /* The state store before the load of the waiter flag (see client._wait). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load32(slot + S_WAITER))
        futex(state, FUTEX_WAKE, INT_MAX, NULL);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the worker's loop
 *
 * loop(keep, base, map_len, geometry, offsets, claims, status, slow_wall_ns, slow_cpu_ns,
 * one_at_a_time=False): the worker's serve step for the common case, one READY request
 * (with one_at_a_time, the lowest-seq one of several) whose layout this slot has had before (Worker._serve_one, _run_group, _answer_in_place, queue.ring_append and
 * the answer, in C). Everything else is handed back to the Python worker.
 *
 * Addresses: ``base`` is the segment mapping's address and ``map_len`` its length; every
 * region the geometry names is checked to lie inside it, here, once, and every address
 * used later is base + a region offset + index * its size with index < slot_count.
 * ``keep`` holds what keeps the memory alive (an export of the mmap, so it cannot be
 * closed under us, and the claims/status arrays).
 *
 * What a peer can write and this code reads: each slot's state word (compared with READY),
 * seq (the tag, a plain value), request_len (checked against the cached minimum and the
 * slot size), the request's descriptor bytes (compared byte for byte with the prefix the
 * Python decoder validated; the views handed to the backend are the decoder's, inside the
 * slot whatever the bytes say later), enqueue_ns (a plain value, clamped as in Python),
 * ring_head (taken modulo ring_records) and the waiter flag (decides a wake only). Each
 * is read once into a local. */

#define SLOT_HEADER 128u
#define S_RESPONSE_LEN 32
#define S_BATCH_SIZE 36
#define S_START_NS 48
#define S_DONE_NS 56
#define S_RESPONSE_SEQ 72
#define H_RING_HEAD 72
#define RING_RECORD 48u
#define ST_DONE 4u
#define CPU_EXACT_NS 100000ull
#define CPU_NOT_MEASURED UINT64_MAX
#define THREAD_SAMPLE_EVERY 16u
#define QUEUE_WAIT_MAX_NS 60000000000ull /* queue.QUEUE_WAIT_MAX_NS */
/* The process CPU clock is a syscall (0.6 us here, on the critical path when read at the
 * claim). While Loop.serve spins for work it reads that clock every SPIN_CPU_REFRESH_NS;
 * a request claimed within SPIN_CPU_MAX_AGE_NS of such a reading, in the same spin, takes
 * its batch's CPU from it: the clock's advance since the reading less the wall time from
 * the reading to the batch's start, which the thread spent spinning, i.e. on a CPU. A
 * deschedule inside that short stretch would count as the batch's: an error of at most
 * SPIN_CPU_MAX_AGE_NS (0.01 ms, 10x below CPU_EXACT_NS, 100x below the smallest gate). */
#define SPIN_CPU_REFRESH_NS 5000ull
#define SPIN_CPU_MAX_AGE_NS 10000ull

struct slot_cache {
    PyObject *prefix; /* bytes: u32 descriptor length + descriptor, as the decoder saw */
    const char *prefix_data;
    Py_ssize_t prefix_len;
    uint64_t min_len;
    PyObject *inputs; /* the decoder's views of this slot (a dict) */
    uint32_t rows;
    PyObject *out;    /* the response slot's arrays (a dict) or NULL */
    PyObject *header; /* bytes: the response payload's header for ``out`` */
    const char *header_data;
    Py_ssize_t header_len;
    uint64_t total;
};

/* A segment's layout as Loop and Port both take it: the mapping (base, map_len), the
 * geometry tuple (slot_count, request_bytes, response_bytes, ring_records) and the region
 * offsets (states, slot table, requests, responses, ring). PyArg_ParseTuple fills all but
 * base from GEOMETRY_FORMAT with GEOMETRY_ARGS(&geo); geometry_check checks it. */
struct geometry {
    uintptr_t base;
    unsigned long long map_len, slot_count, request_bytes, response_bytes, ring_records;
    unsigned long long states_off, table_off, requests_off, responses_off, ring_off;
};
#define GEOMETRY_FORMAT "K(KKKK)(KKKKK)"
#define GEOMETRY_ARGS(a)                                                                  \
    &(a)->map_len, &(a)->slot_count, &(a)->request_bytes, &(a)->response_bytes,           \
        &(a)->ring_records, &(a)->states_off, &(a)->table_off, &(a)->requests_off,        \
        &(a)->responses_off, &(a)->ring_off

typedef struct {
    PyObject_HEAD
    PyObject *keep;
    struct geometry geo;
    uint32_t *claims;
    int64_t *status;
    double slow_wall_ns, slow_cpu_ns;
    int one_at_a_time; /* max_batch 1: of several READY, the lowest seq, as Worker._claim */
    uint64_t batches;
    struct slot_cache *cache;
} Loop;

static PyObject *loop_type;

static inline uint64_t clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* off + count * size <= limit, without overflow. */
static int region_fits(uint64_t off, uint64_t count, uint64_t size, uint64_t limit)
{
    if (off > limit || (size && count > (limit - off) / size))
        return 0;
    return 1;
}

/* 0 where every region of the geometry lies inside its mapping, else -1 with ValueError
 * "shminfer._fast.<what>: geometry outside the mapping" (also when ``misaligned``: the
 * caller's own alignment checks failed). */
static int geometry_check(const struct geometry *g, int misaligned, const char *what)
{
    if (misaligned || g->slot_count < 1 || g->slot_count > 65536 || g->ring_records < 1 ||
        (g->base & 7) || (g->states_off & 3) || (g->table_off & 7) ||
        /* header page, states, slot table, requests, responses, ring: in this order, none
         * overlapping the next, the last inside the mapping */
        g->states_off < 4096 || !region_fits(g->states_off, g->slot_count, 4, g->table_off) ||
        !region_fits(g->table_off, g->slot_count, SLOT_HEADER, g->requests_off) ||
        !region_fits(g->requests_off, g->slot_count, g->request_bytes, g->responses_off) ||
        !region_fits(g->responses_off, g->slot_count, g->response_bytes, g->ring_off) ||
        !region_fits(g->ring_off, g->ring_records, RING_RECORD, g->map_len)) {
        PyErr_Format(PyExc_ValueError, "shminfer._fast.%s: geometry outside the mapping", what);
        return -1;
    }
    return 0;
}

/* Where slot ``i``'s words live in a checked geometry: its state word, its slot-table
 * entry, its request and its response (the segment layout of queue.py, in one place). */
static inline uintptr_t geo_state(const struct geometry *g, uintptr_t i)
{
    return g->base + g->states_off + 4u * i;
}

static inline uintptr_t geo_slot(const struct geometry *g, uintptr_t i)
{
    return g->base + g->table_off + i * SLOT_HEADER;
}

static inline uintptr_t geo_request(const struct geometry *g, uintptr_t i)
{
    return g->base + g->requests_off + i * g->request_bytes;
}

static inline uintptr_t geo_response(const struct geometry *g, uintptr_t i)
{
    return g->base + g->responses_off + i * g->response_bytes;
}

static void cache_clear(struct slot_cache *c)
{
    Py_CLEAR(c->prefix);
    Py_CLEAR(c->inputs);
    Py_CLEAR(c->out);
    Py_CLEAR(c->header);
    c->prefix_data = c->header_data = NULL;
    c->prefix_len = c->header_len = 0;
    c->min_len = c->total = 0;
    c->rows = 0;
}

static void loop_dealloc(PyObject *obj)
{
    Loop *self = (Loop *)obj;
    PyTypeObject *type = Py_TYPE(obj);
    uint32_t i;
    if (self->cache) {
        for (i = 0; i < self->geo.slot_count; i++)
            cache_clear(&self->cache[i]);
        PyMem_Free(self->cache);
    }
    Py_XDECREF(self->keep);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(obj);
    Py_DECREF(type);
}

static PyObject *fast_loop(PyObject *module, PyObject *args)
{
    PyObject *keep, *base_obj, *claims_obj, *status_obj;
    struct geometry geo;
    double slow_wall_ns, slow_cpu_ns;
    int one_at_a_time = 0;
    uintptr_t claims, status = 0;
    Loop *self;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O" GEOMETRY_FORMAT "OOdd|p", &PyTuple_Type, &keep, &base_obj,
                          GEOMETRY_ARGS(&geo), &claims_obj, &status_obj, &slow_wall_ns,
                          &slow_cpu_ns, &one_at_a_time))
        return NULL;
    if (get_addr(base_obj, &geo.base) < 0 || get_addr(claims_obj, &claims) < 0)
        return NULL;
    if (status_obj != Py_None && get_addr(status_obj, &status) < 0)
        return NULL;
    /* The status word and the ring's records: 8-byte words this loop stores. */
    if (geometry_check(&geo, (status & 7) || (geo.ring_off & 7), "loop") < 0)
        return NULL;
    self = (Loop *)PyType_GenericAlloc((PyTypeObject *)loop_type, 0);
    if (!self)
        return NULL;
    self->geo = geo;
    self->cache = PyMem_Calloc((size_t)geo.slot_count, sizeof(struct slot_cache));
    if (!self->cache) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(keep);
    self->keep = keep;
    self->claims = (uint32_t *)claims;
    self->status = (int64_t *)status;
    self->slow_wall_ns = slow_wall_ns;
    self->slow_cpu_ns = slow_cpu_ns;
    self->one_at_a_time = one_at_a_time;
    return (PyObject *)self;
}

/* A slot index from Python, checked against the slot count the object was built with. */
static int slot_index(PyObject *obj, uint32_t slot_count, const char *what, uint32_t *out)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v >= slot_count) {
        PyErr_Format(PyExc_IndexError, "shminfer._fast.%s: slot index out of range", what);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* learn(index, prefix, min_len, inputs, rows, out, header, total): what the Python worker
 * validated for this slot: the decoder's prefix and views, and (out not None) the
 * response arrays the backend may fill and their payload header. */
static PyObject *loop_learn(PyObject *obj, PyObject *args)
{
    Loop *self = (Loop *)obj;
    PyObject *index_obj, *prefix, *inputs, *out, *header;
    unsigned long long min_len, total;
    unsigned long rows;
    uint32_t index;
    char *pdata, *hdata;
    Py_ssize_t plen, hlen;
    struct slot_cache *c;
    if (!PyArg_ParseTuple(args, "OO!KO!kOO!K", &index_obj, &PyBytes_Type, &prefix, &min_len,
                          &PyDict_Type, &inputs, &rows, &out, &PyBytes_Type, &header, &total) ||
        slot_index(index_obj, self->geo.slot_count, "Loop", &index) < 0)
        return NULL;
    if (PyBytes_AsStringAndSize(prefix, &pdata, &plen) < 0 ||
        PyBytes_AsStringAndSize(header, &hdata, &hlen) < 0)
        return NULL;
    if (out != Py_None && !PyDict_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "out must be a dict or None");
        return NULL;
    }
    if (plen < 6 || (uint64_t)plen > min_len || min_len > self->geo.request_bytes ||
        rows > UINT32_MAX || (uint64_t)hlen > total || total > self->geo.response_bytes ||
        total > UINT32_MAX || (out != Py_None && hlen < 6)) {
        PyErr_SetString(PyExc_ValueError, "shminfer._fast.Loop.learn: sizes outside the slot");
        return NULL;
    }
    c = &self->cache[index];
    cache_clear(c);
    Py_INCREF(prefix);
    Py_INCREF(inputs);
    c->prefix = prefix;
    c->prefix_data = pdata;
    c->prefix_len = plen;
    c->min_len = min_len;
    c->inputs = inputs;
    c->rows = (uint32_t)rows;
    if (out != Py_None) {
        Py_INCREF(out);
        Py_INCREF(header);
        c->out = out;
        c->header = header;
        c->header_data = hdata;
        c->header_len = hlen;
        c->total = total;
    }
    Py_RETURN_NONE;
}

static PyObject *loop_forget(PyObject *obj, PyObject *arg)
{
    Loop *self = (Loop *)obj;
    uint32_t index;
    if (slot_index(arg, self->geo.slot_count, "Loop", &index) < 0)
        return NULL;
    cache_clear(&self->cache[index]);
    Py_RETURN_NONE;
}

/* serve(infer_into, spin_ns=0) -> None (nothing READY, after spinning up to spin_ns), False (more than one READY and not
 * one_at_a_time: the Python worker claims and batches them), an int (that slot was served and answered here), or a
 * tuple for the Python worker to finish a slot claimed here:
 *   (0, index, tag, start_ns)                 its request is not of the cached layout;
 *   (1, index, tag, start_ns, rows, outputs or None, exception or None, wall, cpu,
 *    thread, measured)                        the backend raised or answered elsewhere;
 *   (2, index, rows, measured, cpu, thread, wall, queue_wait)   answered, but slow. */
static PyObject *loop_serve(PyObject *obj, PyObject *args)
{
    Loop *self = (Loop *)obj;
    PyObject *infer_into;
    long long spin_ns = 0;
    const volatile uint32_t *states = (const volatile uint32_t *)geo_state(&self->geo, 0);
    uint32_t i, index = 0, found = 0;
    uintptr_t slot, request, response;
    uint64_t tag, start_ns, length, cpu0, thread0 = 0, wall0, wall, cpu, thread, done_ns;
    uint64_t enqueued, queue_wait, head, *record;
    int sample, measured, from_spin;
    uint64_t spun_cpu = 0, spun_wall = 0; /* this call's last spin reading */
    struct slot_cache *c;
    PyObject *result, *inputs, *out, *header;
    const char *header_data;
    Py_ssize_t header_len;
    uint64_t total;
    uint32_t rows;

    uint64_t oldest = 0, seq;
    if (!PyArg_ParseTuple(args, "O|L", &infer_into, &spin_ns))
        return NULL;
scan:
    for (i = 0; i < self->geo.slot_count; i++)
        if (states[i] == ST_READY) {
            /* A peer's seq only orders the READY slots (ties: the lowest index). */
            seq = *(volatile uint64_t *)(geo_slot(&self->geo, i) + S_SEQ);
            if (++found > 1 && !self->one_at_a_time)
                Py_RETURN_FALSE;
            if (found == 1 || seq < oldest) {
                index = i;
                oldest = seq;
            }
        }
    if (!found && spin_ns > 0) {
        /* Nothing READY: spin here (GIL released) as spin_ready does, then scan once more;
         * the detection-to-claim path then runs no Python. */
        Py_BEGIN_ALLOW_THREADS
        uint64_t now, until = monotonic_ns() + (uint64_t)spin_ns;
        unsigned n = 0;
        int ready = 0;
        spun_cpu = clock_ns(CLOCK_PROCESS_CPUTIME_ID); /* see SPIN_CPU_MAX_AGE_NS */
        spun_wall = monotonic_ns();
        while (!ready) {
            for (i = 0; i < self->geo.slot_count; i++)
                if (states[i] == ST_READY) {
                    ready = 1;
                    break;
                }
            cpu_relax();
            if (!ready && !(++n & 31)) {
                now = monotonic_ns();
                if (now >= until)
                    break;
                if (now - spun_wall >= SPIN_CPU_REFRESH_NS) {
                    spun_cpu = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
                    spun_wall = monotonic_ns();
                }
            }
        }
        Py_END_ALLOW_THREADS
        spin_ns = 0;
        goto scan;
    }
    if (!found)
        Py_RETURN_NONE;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    slot = geo_slot(&self->geo, index);
    request = geo_request(&self->geo, index);
    response = geo_response(&self->geo, index);
    /* The claim, as Worker._claim: recorded before PROCESSING; then the tag, read once. */
    __atomic_store_n(&self->claims[index], 1u, __ATOMIC_RELAXED);
    __atomic_store_n((uint32_t *)geo_state(&self->geo, index), ST_PROCESSING, __ATOMIC_RELEASE);
    if (self->status) /* claims made: progress, for the supervisor's health check */
        __atomic_add_fetch(self->status + 1, 1, __ATOMIC_RELAXED);
    tag = *(volatile uint64_t *)(slot + S_SEQ);
    start_ns = monotonic_ns();
    *(volatile uint64_t *)(slot + S_START_NS) = start_ns;

    c = &self->cache[index];
    length = *(volatile uint32_t *)(slot + S_REQUEST_LEN);
    if (!c->prefix || length < c->min_len || length > self->geo.request_bytes ||
        memcmp((const void *)request, c->prefix_data, (size_t)c->prefix_len) != 0)
        return Py_BuildValue("(iIKK)", 0, index, (unsigned long long)tag,
                             (unsigned long long)start_ns);

    /* Own references for the call: the backend runs arbitrary Python, which could even
     * make this slot learn anew; what is answered below is what was passed. */
    inputs = c->inputs;
    out = c->out;
    header = c->header;
    header_data = c->header_data;
    header_len = c->header_len;
    total = c->total;
    rows = c->rows;
    Py_INCREF(inputs);
    Py_XINCREF(out);
    Py_XINCREF(header);
    if (self->status)
        __atomic_store_n(self->status, (int64_t)monotonic_ns(), __ATOMIC_RELAXED);
    sample = !(++self->batches % THREAD_SAMPLE_EVERY);
    /* Both CPU clocks in the same order at both ends, as the Python worker reads them;
     * the process clock's start from this call's spin when it is fresh enough, but not
     * in a batch whose thread clock is read (the ratio of the two compares exact reads). */
    from_spin = !sample && spun_wall && monotonic_ns() - spun_wall <= SPIN_CPU_MAX_AGE_NS;
    cpu0 = from_spin ? spun_cpu : clock_ns(CLOCK_PROCESS_CPUTIME_ID);
    if (sample)
        thread0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    wall0 = monotonic_ns();
    result = PyObject_CallFunctionObjArgs(infer_into, inputs, out ? out : Py_None, NULL);
    Py_DECREF(inputs);
    wall = monotonic_ns() - wall0;
    if (self->status)
        __atomic_store_n(self->status, (int64_t)0, __ATOMIC_RELAXED);
    measured = wall >= CPU_EXACT_NS || sample;
    cpu = measured ? clock_ns(CLOCK_PROCESS_CPUTIME_ID) - cpu0 : CPU_NOT_MEASURED;
    if (measured && from_spin) /* less the spin from the reading to the start */
        cpu -= cpu > wall0 - spun_wall ? wall0 - spun_wall : cpu;
    thread = sample ? clock_ns(CLOCK_THREAD_CPUTIME_ID) - thread0 : CPU_NOT_MEASURED;

    if (result == NULL || out == NULL || result != out) {
        PyObject *exc = Py_None, *type = NULL, *value = NULL, *tb = NULL, *back;
        Py_XDECREF(out);
        Py_XDECREF(header);
        if (result == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL; /* SystemExit, KeyboardInterrupt: as in Python, not a batch's */
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            exc = value ? value : Py_None;
        }
        back = Py_BuildValue("(iIKKIOOKKKO)", 1, index, (unsigned long long)tag,
                             (unsigned long long)start_ns, rows, result ? result : Py_None, exc,
                            (unsigned long long)wall, (unsigned long long)cpu,
                            (unsigned long long)thread, measured ? Py_True : Py_False);
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return back;
    }
    Py_DECREF(result);
    Py_DECREF(out);

    /* The backend wrote into the response slot: the header, the fields, the ring, DONE. */
    done_ns = monotonic_ns();
    memcpy((void *)response, header_data, (size_t)header_len);
    Py_DECREF(header);
    *(volatile uint32_t *)(slot + S_RESPONSE_LEN) = (uint32_t)total;
    *(volatile uint32_t *)(slot + S_BATCH_SIZE) = rows;
    *(volatile uint64_t *)(slot + S_RESPONSE_SEQ) = tag;
    *(volatile uint64_t *)(slot + S_DONE_NS) = done_ns;
    enqueued = *(volatile uint64_t *)(slot + S_ENQUEUE_NS);
    /* As queue.queue_wait_ns: a stamp after the start or over QUEUE_WAIT_MAX_NS before it
     * is another clock's (a client in another time namespace), recorded as no wait. */
    queue_wait = enqueued <= start_ns && start_ns - enqueued <= QUEUE_WAIT_MAX_NS
                     ? start_ns - enqueued
                     : 0;
    head = *(volatile uint64_t *)(self->geo.base + H_RING_HEAD);
    record = (uint64_t *)(self->geo.base + self->geo.ring_off +
                          (head % self->geo.ring_records) * RING_RECORD);
    record[0] = done_ns;
    record[1] = wall;
    record[2] = cpu;
    record[3] = thread;
    record[4] = queue_wait;
    record[5] = rows;
    /* The record before the answer: a client that has seen DONE finds its batch. */
    __atomic_store_n((uint64_t *)(self->geo.base + H_RING_HEAD), head + 1, __ATOMIC_RELEASE);
    __atomic_store_n((uint32_t *)geo_state(&self->geo, index), ST_DONE, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* DONE before the load of the waiter flag */
    if (load32(slot + S_WAITER))
        futex(geo_state(&self->geo, index), FUTEX_WAKE, INT_MAX, NULL);
    __atomic_store_n(&self->claims[index], 0u, __ATOMIC_RELEASE); /* answered: leasable */
    if ((double)wall > self->slow_wall_ns || (measured && (double)cpu > self->slow_cpu_ns))
        return Py_BuildValue("(iIIOKKKK)", 2, index, rows, measured ? Py_True : Py_False,
                             (unsigned long long)cpu, (unsigned long long)thread,
                             (unsigned long long)wall, (unsigned long long)queue_wait);
    return PyLong_FromUnsignedLong(index);
}

static PyMethodDef loop_methods[] = {
    {"learn", loop_learn, METH_VARARGS,
     "learn(index, prefix, min_len, inputs, rows, out, header, total)"},
    {"forget", loop_forget, METH_O, "forget(index)"},
    {"serve", loop_serve, METH_VARARGS,
     "serve(infer_into, spin_ns=0) -> None, False, index or a tuple"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot loop_slots[] = {
    {Py_tp_dealloc, (void *)loop_dealloc},
    {Py_tp_methods, loop_methods},
    {Py_tp_doc, (void *)"the worker's serve step (see shminfer.worker)"},
    {0, NULL},
};

static PyType_Spec loop_spec = {
    "shminfer._fast.Loop", sizeof(Loop), 0, Py_TPFLAGS_DEFAULT, loop_slots,
};

/* ------------------------------------------------------------------ the client's port
 *
 * port(keep, base, map_len, geometry, offsets, ndarray): the client's two per-request steps
 * for a lane (one worker's segment), each one call: send (Client.start's encode of the
 * layout this slot had last, then publish) and recv (Client.finish's spin, state and tag
 * check and the decoder's reuse test). Anything else returns to the Python client, which
 * then does everything as on the pure path. Addresses as in Loop: base + region + index *
 * size, index < slot_count, the regions checked against the mapping once, here.
 *
 * What a peer can write and recv reads: the slot's state word, response_seq,
 * response_len and the response's descriptor bytes, each once into a local (the bytes by
 * one memcmp), checked as Client.finish and Decoder.decode check them: DONE, the
 * request's tag, the cached minimum length <= response_len <= the slot size, the prefix
 * byte for byte the one the Python decoder validated. The views returned are the
 * decoder's own (inside the slot whatever a peer writes later). A mismatch of any of them
 * is not judged here: the Python client reads the words afresh and decides. send reads
 * nothing a peer can write (its inputs are the caller's own arrays); start (send with
 * Client.start's slot, tag and Pending) reads the header's worker state word, once, and
 * goes on only when it is READY (anything else: None, the Python client decides). */

struct send_cache {
    Py_ssize_t count;
    PyObject *names, *dtypes, *shapes, *dests; /* tuples: the encoder's last layout */
    PyObject *header;                          /* bytes: u32 length + descriptor */
    const char *header_data;
    Py_ssize_t header_len;
    uint64_t total;
    uint64_t *spans; /* per array: offset in the request slot, bytes (0: an empty array) */
};

struct recv_cache {
    PyObject *prefix; /* bytes: the response's u32 length + descriptor, as validated */
    const char *prefix_data;
    Py_ssize_t prefix_len;
    uint64_t min_len;
    PyObject *views; /* the decoder's views of this response slot (a dict) */
};

typedef struct {
    PyObject_HEAD
    PyObject *keep;
    PyObject *ndarray;
    struct geometry geo;
    struct send_cache *send;
    struct recv_cache *recv;
    /* bind(): the client's lane (see port_bind) */
    PyObject *free, *counter, *lane_index, *lane_ref, *pending;
    uint64_t *generation; /* per slot: 1 << 32 | lease generation when leased to the lane */
    unsigned stream;      /* copies left to stream (see copy_to_peer) */
} Port;

#define ST_FREE 0u
#define ST_WRITING 1u
#define H_WORKER_STATE 44
#define WORKER_READY 1u

static void port_unbind_refs(Port *self)
{
    Py_CLEAR(self->free);
    Py_CLEAR(self->counter);
    Py_CLEAR(self->lane_index);
    Py_CLEAR(self->lane_ref);
    Py_CLEAR(self->pending);
}
#define MAX_PORT_ARRAYS 64

static PyObject *port_type;
static PyObject *str_dtype, *str_shape, *str_array_struct;

/* numpy's array interface, C side (the __array_struct__ capsule's pointer; documented by
 * numpy as a stable protocol): how an input's memory is reached without the buffer API,
 * which the stable ABI has only from 3.11. */
typedef struct {
    int two; /* 2: the protocol's own check */
    int nd;
    char typekind;
    int itemsize;
    int flags;
    Py_intptr_t *shape;
    Py_intptr_t *strides;
    void *data;
    PyObject *descr;
} array_interface;
#define AI_C_CONTIGUOUS 0x1

/* The address and byte length of an ndarray's memory when it is one C-contiguous block
 * (1), not (0: copy it with numpy), or -1 on error. ``capsule`` holds it alive with the
 * address; the caller drops it. */
static int array_span(PyObject *array, PyObject **capsule, uintptr_t *addr, uint64_t *len)
{
    array_interface *ai;
    uint64_t n;
    int i;
    *capsule = PyObject_GetAttr(array, str_array_struct);
    if (!*capsule)
        return -1;
    ai = PyCapsule_IsValid(*capsule, NULL) ? PyCapsule_GetPointer(*capsule, NULL) : NULL;
    if (!ai || ai->two != 2 || !(ai->flags & AI_C_CONTIGUOUS) || ai->nd < 0 || ai->nd > 64 ||
        ai->itemsize <= 0 || !ai->data)
        return 0;
    n = (uint64_t)ai->itemsize;
    for (i = 0; i < ai->nd; i++) {
        if (ai->shape[i] < 0 || (ai->shape[i] && n > UINT64_MAX / (uint64_t)ai->shape[i]))
            return 0;
        n *= (uint64_t)ai->shape[i];
    }
    *addr = (uintptr_t)ai->data;
    *len = n;
    return 1;
}

/* A copy of an input into a request slot, which the worker reads next on another CPU and
 * which that CPU read last (the slot is reused). On x86-64, spans of at least STREAM_MIN
 * bytes can go out with streaming (non-temporal) stores, which invalidate the worker's
 * copies of those lines without reading them into this cache first; the worker then reads
 * them from memory. Which is faster depends on where the two CPUs sit: measured here (16
 * KiB, a C ping-pong between the VM's two CPUs, 2026-12-01) plain stores took 2.5-3 us a
 * round trip in one mode of the host and 7-11 us in another, streaming stores 2.9-3.8 us
 * in both. So the port times its plain copies (two vDSO clock reads) and streams the next
 * STREAM_RUN copies after one slower than SLOW_NS_PER_KIB, then tries a plain one again.
 * The bytes are memcpy's either way; the caller issues copy_fence() before the release
 * store of READY (streaming stores are not ordered by it). */
#define STREAM_MIN 4096u
#define STREAM_RUN 64u
#define SLOW_NS_PER_KIB 128u

static void copy_to_peer(unsigned *stream, char *dst, const char *src, size_t len)
{
#if defined(__x86_64__)
    if (len >= STREAM_MIN && *stream) {
        size_t head = (size_t)(-(uintptr_t)dst & 63u), i;
        --*stream;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        len -= head;
        for (i = 0; i + 64 <= len; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, len - i);
        return;
    }
    if (len >= STREAM_MIN) {
        uint64_t t0 = monotonic_ns(), took;
        memcpy(dst, src, len);
        took = monotonic_ns() - t0;
        if (took > (uint64_t)SLOW_NS_PER_KIB * (len >> 10))
            *stream = STREAM_RUN;
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, len);
}

/* Orders copy_to_peer's streaming stores before the stores that follow (READY). */
static inline void copy_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

static void send_clear(struct send_cache *c)
{
    Py_CLEAR(c->names);
    Py_CLEAR(c->dtypes);
    Py_CLEAR(c->shapes);
    Py_CLEAR(c->dests);
    Py_CLEAR(c->header);
    PyMem_Free(c->spans);
    c->spans = NULL;
    c->header_data = NULL;
    c->header_len = 0;
    c->count = 0;
    c->total = 0;
}

static void recv_clear(struct recv_cache *c)
{
    Py_CLEAR(c->prefix);
    Py_CLEAR(c->views);
    c->prefix_data = NULL;
    c->prefix_len = 0;
    c->min_len = 0;
}

static void port_dealloc(PyObject *obj)
{
    Port *self = (Port *)obj;
    PyTypeObject *type = Py_TYPE(obj);
    uint32_t i;
    for (i = 0; self->send && i < self->geo.slot_count; i++)
        send_clear(&self->send[i]);
    for (i = 0; self->recv && i < self->geo.slot_count; i++)
        recv_clear(&self->recv[i]);
    PyMem_Free(self->send);
    PyMem_Free(self->recv);
    PyMem_Free(self->generation);
    port_unbind_refs(self);
    Py_XDECREF(self->keep);
    Py_XDECREF(self->ndarray);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(obj);
    Py_DECREF(type);
}

static PyObject *fast_port(PyObject *module, PyObject *args)
{
    PyObject *keep, *base_obj, *ndarray;
    struct geometry geo;
    Port *self;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O" GEOMETRY_FORMAT "O", &PyTuple_Type, &keep, &base_obj,
                          GEOMETRY_ARGS(&geo), &ndarray) ||
        get_addr(base_obj, &geo.base) < 0)
        return NULL;
    if (!PyType_Check(ndarray)) {
        PyErr_SetString(PyExc_TypeError, "shminfer._fast.port: ndarray must be a type");
        return NULL;
    }
    /* The ring: this port never touches it (no alignment of its own asked). */
    if (geometry_check(&geo, 0, "port") < 0)
        return NULL;
    self = (Port *)PyType_GenericAlloc((PyTypeObject *)port_type, 0);
    if (!self)
        return NULL;
    self->geo = geo;
    self->send = PyMem_Calloc((size_t)geo.slot_count, sizeof(struct send_cache));
    self->recv = PyMem_Calloc((size_t)geo.slot_count, sizeof(struct recv_cache));
    self->generation = PyMem_Calloc((size_t)geo.slot_count, sizeof(uint64_t));
    if (!self->send || !self->recv || !self->generation) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(keep);
    self->keep = keep;
    Py_INCREF(ndarray);
    self->ndarray = ndarray;
    return (PyObject *)self;
}

/* learn_send(index, names, dtypes, shapes, dests, header, total): the layout the Python
 * encoder last wrote to this slot (dests: its ndarrays in the request slot, None for an
 * empty array). */
static PyObject *port_learn_send(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *index_obj, *names, *dtypes, *shapes, *dests, *header;
    unsigned long long total;
    uint32_t index;
    char *hdata;
    Py_ssize_t hlen, count, i;
    struct send_cache *c;
    uint64_t *spans;
    uintptr_t request;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!K", &index_obj, &PyTuple_Type, &names, &PyTuple_Type,
                          &dtypes, &PyTuple_Type, &shapes, &PyTuple_Type, &dests, &PyBytes_Type,
                          &header, &total) ||
        slot_index(index_obj, self->geo.slot_count, "Port", &index) < 0 ||
        PyBytes_AsStringAndSize(header, &hdata, &hlen) < 0)
        return NULL;
    count = PyTuple_Size(names);
    if (count < 0 || count > MAX_PORT_ARRAYS || PyTuple_Size(dtypes) != count ||
        PyTuple_Size(shapes) != count || PyTuple_Size(dests) != count || hlen < 6 ||
        (uint64_t)hlen > total || total > self->geo.request_bytes || total > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "shminfer._fast.Port.learn_send: layout outside the slot");
        return NULL;
    }
    spans = PyMem_Calloc((size_t)(count ? count : 1), 2 * sizeof(uint64_t));
    if (!spans)
        return PyErr_NoMemory();
    request = geo_request(&self->geo, index);
    for (i = 0; i < count; i++) {
        PyObject *dest = PyTuple_GetItem(dests, i), *capsule = NULL;
        uintptr_t addr = 0;
        uint64_t len = 0;
        int r = 0;
        if (PyUnicode_CheckExact(PyTuple_GetItem(names, i)) &&
            (dest == Py_None || Py_TYPE(dest) == (PyTypeObject *)self->ndarray)) {
            r = dest == Py_None ? 1 : array_span(dest, &capsule, &addr, &len);
            Py_XDECREF(capsule);
        }
        if (r < 0) {
            PyMem_Free(spans);
            return NULL;
        }
        /* Every destination one block inside this request slot, after the header. */
        if (!r || (dest != Py_None && (addr < request + (uint64_t)hlen ||
                                        addr - request > self->geo.request_bytes ||
                                        len > self->geo.request_bytes - (addr - request)))) {
            PyMem_Free(spans);
            PyErr_SetString(PyExc_TypeError, "shminfer._fast.Port.learn_send: bad layout");
            return NULL;
        }
        spans[2 * i] = dest == Py_None ? 0 : (uint64_t)(addr - request);
        spans[2 * i + 1] = len;
    }
    c = &self->send[index];
    send_clear(c);
    c->spans = spans;
    Py_INCREF(names);
    Py_INCREF(dtypes);
    Py_INCREF(shapes);
    Py_INCREF(dests);
    Py_INCREF(header);
    c->names = names;
    c->dtypes = dtypes;
    c->shapes = shapes;
    c->dests = dests;
    c->header = header;
    c->header_data = hdata;
    c->header_len = hlen;
    c->count = count;
    c->total = total;
    Py_RETURN_NONE;
}

/* learn_recv(index, prefix, min_len, views): the Python decoder's cached response layout
 * of this slot (Decoder.cached). */
static PyObject *port_learn_recv(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *index_obj, *prefix, *views;
    unsigned long long min_len;
    uint32_t index;
    char *pdata;
    Py_ssize_t plen;
    struct recv_cache *c;
    if (!PyArg_ParseTuple(args, "OO!KO!", &index_obj, &PyBytes_Type, &prefix, &min_len,
                          &PyDict_Type, &views) ||
        slot_index(index_obj, self->geo.slot_count, "Port", &index) < 0 ||
        PyBytes_AsStringAndSize(prefix, &pdata, &plen) < 0)
        return NULL;
    if (plen < 6 || (uint64_t)plen > min_len || min_len > self->geo.response_bytes) {
        PyErr_SetString(PyExc_ValueError, "shminfer._fast.Port.learn_recv: sizes outside the slot");
        return NULL;
    }
    c = &self->recv[index];
    recv_clear(c);
    Py_INCREF(prefix);
    Py_INCREF(views);
    c->prefix = prefix;
    c->prefix_data = pdata;
    c->prefix_len = plen;
    c->min_len = min_len;
    c->views = views;
    Py_RETURN_NONE;
}

static PyObject *port_forget(PyObject *obj, PyObject *arg)
{
    Port *self = (Port *)obj;
    uint32_t index;
    if (slot_index(arg, self->geo.slot_count, "Port", &index) < 0)
        return NULL;
    send_clear(&self->send[index]);
    recv_clear(&self->recv[index]);
    Py_RETURN_NONE;
}

/* 1: same, 0: not, -1: error. */
static inline int same(PyObject *a, PyObject *b)
{
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* Encoder.encode_into's reuse test for slot cache ``c``: the same names in order, exact
 * ndarrays, equal dtypes and shapes. 1 (the arrays in ``values``, borrowed), 0 (not the
 * learned layout) or -1 (an error). Only exact str keys and exact ndarrays: no Python code
 * runs while the dict is walked (the comparisons are str's and numpy's own). */
static int send_match(Port *self, struct send_cache *c, PyObject *inputs, PyObject **values)
{
    PyObject *key, *value, *attr;
    Py_ssize_t pos = 0, i = 0;
    int r;
    if (!c->names || !PyDict_CheckExact(inputs) || PyDict_Size(inputs) != c->count)
        return 0;
    while (PyDict_Next(inputs, &pos, &key, &value)) {
        if (i >= c->count || !PyUnicode_CheckExact(key) ||
            Py_TYPE(value) != (PyTypeObject *)self->ndarray)
            return 0;
        r = same(key, PyTuple_GetItem(c->names, i));
        if (r <= 0)
            return r;
        attr = PyObject_GetAttr(value, str_dtype);
        if (!attr)
            return -1;
        r = same(attr, PyTuple_GetItem(c->dtypes, i));
        Py_DECREF(attr);
        if (r <= 0)
            return r;
        attr = PyObject_GetAttr(value, str_shape);
        if (!attr)
            return -1;
        r = same(attr, PyTuple_GetItem(c->shapes, i));
        Py_DECREF(attr);
        if (r <= 0)
            return r;
        values[i++] = value;
    }
    return i == c->count;
}

/* The write of a matched request (send_match): WRITING, the header, one copy per array,
 * request_len, seq, enqueue_ns, READY and the doorbell, as Client.start. -1 on an error
 * (the state is left WRITING: the caller frees the slot, as after a failed encode). */
static int send_write(Port *self, uint32_t index, struct send_cache *c, PyObject **values,
                      uint64_t seq)
{
    Py_ssize_t i, n = c->count;
    uintptr_t slot = geo_slot(&self->geo, index), request = geo_request(&self->geo, index);
    uintptr_t state = geo_state(&self->geo, index);
    int r = 0;
    __atomic_store_n((uint32_t *)state, ST_WRITING, __ATOMIC_RELAXED);
    memcpy((void *)request, c->header_data, (size_t)c->header_len);
    for (i = 0; i < n; i++)
        Py_INCREF(values[i]);
    for (i = 0; i < n && r == 0; i++) {
        PyObject *capsule = NULL;
        uintptr_t addr;
        uint64_t len;
        if (!c->spans[2 * i + 1])
            continue; /* an empty array: nothing to copy */
        /* One block of exactly the learned length (the same dtype and shape, checked
         * before): a copy into the learned span of this slot. Anything else (a strided
         * view, a broken capsule): numpy's own assignment into the learned view. */
        r = array_span(values[i], &capsule, &addr, &len);
        if (r == 1 && len == c->spans[2 * i + 1]) {
            copy_to_peer(&self->stream, (char *)(request + c->spans[2 * i]), (const char *)addr,
                         (size_t)len);
            r = 0;
        } else if (r >= 0) {
            r = PyObject_SetItem(PyTuple_GetItem(c->dests, i), Py_Ellipsis, values[i]);
        }
        Py_XDECREF(capsule);
    }
    for (i = 0; i < n; i++)
        Py_DECREF(values[i]);
    copy_fence();
    if (r < 0)
        return -1;
    *(volatile uint32_t *)(slot + S_REQUEST_LEN) = (uint32_t)c->total;
    *(volatile uint64_t *)(slot + S_SEQ) = seq;
    *(volatile uint64_t *)(slot + S_ENQUEUE_NS) = monotonic_ns();
    __atomic_store_n((uint32_t *)state, ST_READY, __ATOMIC_RELEASE);
    doorbell(self->geo.base);
    return 0;
}

/* send(index, inputs, seq) -> payload length, or None (not the learned layout: nothing
 * was written): send_match, then send_write. */
static PyObject *port_send(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *index_obj, *inputs, *values[MAX_PORT_ARRAYS];
    unsigned long long seq;
    uint32_t index;
    struct send_cache *c;
    int r;
    if (!PyArg_ParseTuple(args, "OOK", &index_obj, &inputs, &seq) ||
        slot_index(index_obj, self->geo.slot_count, "Port", &index) < 0)
        return NULL;
    c = &self->send[index];
    r = send_match(self, c, inputs, values);
    if (r <= 0)
        return r < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    if (send_write(self, index, c, values, (uint64_t)seq) < 0)
        return NULL; /* the caller frees the slot, as after a failed encode */
    return PyLong_FromUnsignedLongLong((unsigned long long)c->total);
}

/* bind(free, generations, counter, lane_index, lane_ref, pending): what start and finish
 * need of the client's lane: its free list (a list of slot indices, the client's own
 * memory), each leased slot's lease generation ({index: generation}), the client's tag
 * counter (an iterator of ints), this lane's index, a weak reference to the lane and the
 * Pending class. unbind() drops them. */
static PyObject *port_bind(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *free_list, *generations, *counter, *lane_index, *lane_ref, *pending, *key, *value;
    Py_ssize_t pos = 0;
    uint32_t index;
    if (!PyArg_ParseTuple(args, "O!O!OOOO", &PyList_Type, &free_list, &PyDict_Type, &generations,
                          &counter, &lane_index, &lane_ref, &pending))
        return NULL;
    if (!PyIter_Check(counter) || !PyCallable_Check(pending) || !PyWeakref_Check(lane_ref)) {
        PyErr_SetString(PyExc_TypeError, "shminfer._fast.Port.bind: bad arguments");
        return NULL;
    }
    memset(self->generation, 0, (size_t)self->geo.slot_count * sizeof(uint64_t));
    while (PyDict_Next(generations, &pos, &key, &value)) {
        unsigned long gen = PyLong_AsUnsignedLong(value);
        if (gen == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        if (slot_index(key, self->geo.slot_count, "Port", &index) < 0)
            return NULL;
        if (gen > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "lease generation over 2**32");
            return NULL;
        }
        /* bit 32: leased to this lane */
        self->generation[index] = ((uint64_t)1 << 32) | gen;
    }
    Py_INCREF(free_list);
    Py_INCREF(counter);
    Py_INCREF(lane_index);
    Py_INCREF(lane_ref);
    Py_INCREF(pending);
    port_unbind_refs(self);
    self->free = free_list;
    self->counter = counter;
    self->lane_index = lane_index;
    self->lane_ref = lane_ref;
    self->pending = pending;
    Py_RETURN_NONE;
}

/* stream(count) -> the count before: the next count copies of STREAM_MIN bytes or more
 * stream (copy_to_peer); the tests check both copies write the encoder's bytes. */
static PyObject *port_stream(PyObject *obj, PyObject *arg)
{
    Port *self = (Port *)obj;
    unsigned long count = PyLong_AsUnsignedLong(arg);
    unsigned before = self->stream;
    if (count == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    self->stream = count > STREAM_RUN ? STREAM_RUN : (unsigned)count;
    return PyLong_FromUnsignedLong(before);
}

static PyObject *port_unbind(PyObject *obj, PyObject *arg)
{
    (void)arg;
    port_unbind_refs((Port *)obj);
    Py_RETURN_NONE;
}

/* start(inputs, timeout) -> Pending, or None: Client.start of a bound lane whose worker is
 * READY, of the layout the last free slot had: the slot taken off the free list, its tag
 * (generation << 32 | the counter's next value, low 32 bits), send_match and send_write,
 * the deadline (CLOCK_MONOTONIC, time.monotonic's clock, + timeout). None when the worker
 * state word is not READY (the one word of the header read here: compared only), the free
 * list is empty, its last slot is not one this lane leased, or the inputs are not the
 * slot's last layout: then nothing was taken or written and the Python client goes on. */
static PyObject *port_start(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *inputs, *values[MAX_PORT_ARRAYS], *next, *lane, *pending, *slot_obj;
    double timeout;
    Py_ssize_t n;
    uint32_t index;
    uint64_t tag;
    struct send_cache *c;
    int r;
    if (!PyArg_ParseTuple(args, "Od", &inputs, &timeout))
        return NULL;
    if (!self->free || load32(self->geo.base + H_WORKER_STATE) != WORKER_READY)
        Py_RETURN_NONE;
    n = PyList_Size(self->free);
    if (n <= 0)
        Py_RETURN_NONE;
    {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GetItem(self->free, n - 1));
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (v >= self->geo.slot_count || !(self->generation[v] >> 32))
            Py_RETURN_NONE;
        index = (uint32_t)v;
    }
    c = &self->send[index];
    r = send_match(self, c, inputs, values);
    if (r <= 0)
        return r < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    lane = PyWeakref_GetObject(self->lane_ref); /* borrowed */
    if (lane == NULL || lane == Py_None)
        Py_RETURN_NONE;
    next = PyIter_Next(self->counter);
    if (!next) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "shminfer._fast.Port.start: tag counter ended");
        return NULL;
    }
    tag = (uint64_t)PyLong_AsUnsignedLongLongMask(next);
    Py_DECREF(next);
    if (tag == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    tag = (self->generation[index] & 0xFFFFFFFFu) << 32 | (tag & 0xFFFFFFFFu);
    slot_obj = PyList_GetItem(self->free, n - 1);
    Py_INCREF(slot_obj);
    if (PyList_SetSlice(self->free, n - 1, n, NULL) < 0) {
        Py_DECREF(slot_obj);
        return NULL;
    }
    if (send_write(self, index, c, values, tag) < 0) {
        /* As Client.start after a failed send: the slot FREE and back on the free list. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        __atomic_store_n((uint32_t *)geo_state(&self->geo, index), ST_FREE, __ATOMIC_RELEASE);
        if (PyList_Append(self->free, slot_obj) < 0)
            PyErr_Clear();
        Py_DECREF(slot_obj);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_INCREF(lane);
    pending = PyObject_CallFunction(self->pending, "OOKdO", self->lane_index, slot_obj,
                                    (unsigned long long)tag,
                                    (double)monotonic_ns() / 1e9 + timeout, lane);
    Py_DECREF(lane);
    Py_DECREF(slot_obj);
    return pending;
}

/* recv(index, seq, spin_ns) -> the decoder's views (a dict: the answer to this request, of
 * the learned layout) or the state word read last (an int: the Python client decides).
 * Spins (GIL released) at most spin_ns while the slot is READY or PROCESSING. */
static PyObject *port_recv(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *index_obj;
    unsigned long long seq;
    long long spin_ns;
    uint32_t index, state;
    uint64_t answered, length;
    uintptr_t slot, response, addr;
    struct recv_cache *c;
    if (!PyArg_ParseTuple(args, "OKL", &index_obj, &seq, &spin_ns) ||
        slot_index(index_obj, self->geo.slot_count, "Port", &index) < 0)
        return NULL;
    addr = geo_state(&self->geo, index);
    state = load32(addr);
    if ((state == ST_READY || state == ST_PROCESSING) && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        uint64_t until = monotonic_ns() + (uint64_t)spin_ns;
        unsigned k = 0;
        for (;;) {
            state = load32(addr);
            if (state != ST_READY && state != ST_PROCESSING)
                break;
            cpu_relax();
            if (!(++k & 31) && monotonic_ns() >= until)
                break;
        }
        Py_END_ALLOW_THREADS
    }
    c = &self->recv[index];
    if (state != ST_DONE || !c->views)
        return PyLong_FromUnsignedLong(state);
    slot = geo_slot(&self->geo, index);
    response = geo_response(&self->geo, index);
    length = *(volatile uint32_t *)(slot + S_RESPONSE_LEN);
    answered = *(volatile uint64_t *)(slot + S_RESPONSE_SEQ);
    if (answered != (uint64_t)seq || length < c->min_len || length > self->geo.response_bytes ||
        memcmp((const void *)response, c->prefix_data, (size_t)c->prefix_len) != 0)
        return PyLong_FromUnsignedLong(state);
    Py_INCREF(c->views);
    return c->views;
}

/* finish(index, seq, spin_ns) -> recv's answer; when it is the views (a dict), the slot is
 * FREE again and back on the bound free list, as Client.finish does after an answer. */
static PyObject *port_finish(PyObject *obj, PyObject *args)
{
    Port *self = (Port *)obj;
    PyObject *answer = port_recv(obj, args), *index_obj;
    uint32_t index;
    if (!answer || !PyDict_Check(answer) || !self->free)
        return answer;
    /* recv parsed the same arguments: the index is in range. */
    index_obj = PyTuple_GetItem(args, 0);
    if (slot_index(index_obj, self->geo.slot_count, "Port", &index) < 0 ||
        (__atomic_store_n((uint32_t *)geo_state(&self->geo, index), ST_FREE, __ATOMIC_RELEASE),
         PyList_Append(self->free, index_obj) < 0)) {
        Py_DECREF(answer);
        return NULL;
    }
    return answer;
}

static PyMethodDef port_methods[] = {
    {"learn_send", port_learn_send, METH_VARARGS,
     "learn_send(index, names, dtypes, shapes, dests, header, total)"},
    {"learn_recv", port_learn_recv, METH_VARARGS, "learn_recv(index, prefix, min_len, views)"},
    {"forget", port_forget, METH_O, "forget(index)"},
    {"send", port_send, METH_VARARGS, "send(index, inputs, seq) -> length or None"},
    {"recv", port_recv, METH_VARARGS, "recv(index, seq, spin_ns) -> views or state"},
    {"bind", port_bind, METH_VARARGS,
     "bind(free, generations, counter, lane_index, lane_ref, pending)"},
    {"unbind", port_unbind, METH_NOARGS, "unbind()"},
    {"stream", port_stream, METH_O, "stream(count) -> count before"},
    {"start", port_start, METH_VARARGS, "start(inputs, timeout) -> Pending or None"},
    {"finish", port_finish, METH_VARARGS, "finish(index, seq, spin_ns) -> views or state"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot port_slots[] = {
    {Py_tp_dealloc, (void *)port_dealloc},
    {Py_tp_methods, port_methods},
    {Py_tp_doc, (void *)"the client's send and receive steps (see shminfer.client)"},
    {0, NULL},
};

static PyType_Spec port_spec = {
    "shminfer._fast.Port", sizeof(Port), 0, Py_TPFLAGS_DEFAULT, port_slots,
};

static PyMethodDef methods[] = {
    {"fence", fast_fence, METH_NOARGS, "full memory fence"},
    {"futex_wait", fast_futex_wait, METH_VARARGS, "futex_wait(addr, expected, timeout_s)"},
    {"futex_wake", fast_futex_wake, METH_VARARGS, "futex_wake(addr, count=INT_MAX)"},
    {"ring_doorbell", fast_ring_doorbell, METH_O, "ring_doorbell(header_addr)"},
    {"publish", fast_publish, METH_VARARGS, "publish(slot, state, header, length, seq)"},
    {"spin_state", fast_spin_state, METH_VARARGS, "spin_state(state_addr, spin_ns) -> state"},
    {"spin_ready", fast_spin_ready, METH_VARARGS, "spin_ready(states, count, spin_ns)"},
    {"answer", fast_answer, METH_VARARGS, "answer(state_addr, slot_addr, state)"},
    {"port", fast_port, METH_VARARGS,
     "port(keep, base, map_len, geometry, offsets, ndarray)"},
    {"loop", fast_loop, METH_VARARGS,
     "loop(keep, base, map_len, geometry, offsets, claims, status, slow_wall_ns, slow_cpu_ns, "
     "one_at_a_time=False)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shminfer._fast", "shminfer's optional C hot path", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void)
{
    PyObject *m;
    if (!loop_type) {
        loop_type = PyType_FromSpec(&loop_spec);
        if (!loop_type)
            return NULL;
    }
    if (!port_type) {
        port_type = PyType_FromSpec(&port_spec);
        if (!port_type)
            return NULL;
    }
    if (!str_dtype && !(str_dtype = PyUnicode_InternFromString("dtype")))
        return NULL;
    if (!str_shape && !(str_shape = PyUnicode_InternFromString("shape")))
        return NULL;
    if (!str_array_struct && !(str_array_struct = PyUnicode_InternFromString("__array_struct__")))
        return NULL;
    m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(loop_type);
    if (PyModule_AddObject(m, "Loop", loop_type) < 0) {
        Py_DECREF(loop_type);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(port_type);
    if (PyModule_AddObject(m, "Port", port_type) < 0) {
        Py_DECREF(port_type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
