/* shminfer._fast: the optional C hot path (stable ABI, Python >= 3.9: one abi3 wheel).
 *
 * Same memory layout and semantics as the pure-Python path (queue.py, client.py,
 * worker.py): this module only replaces the per-request foreign calls and the stores,
 * fences and spins around them. Addresses are plain integers into the segment mapping,
 * computed once by the caller (_sys.address_of); the caller keeps the mapping alive.
 * Nothing here reads a length or an index from shared memory: what a peer writes is
 * validated by the Python code as before.
 *
 * Offsets must match queue.py: header doorbell 48, worker_sleeping 52; slot header
 * seq 8, request_len 20, enqueue_ns 40; states READY 2, PROCESSING 3.
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
#include <linux/futex.h>
#include <stdint.h>
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

static PyMethodDef methods[] = {
    {"fence", fast_fence, METH_NOARGS, "full memory fence"},
    {"futex_wait", fast_futex_wait, METH_VARARGS, "futex_wait(addr, expected, timeout_s)"},
    {"futex_wake", fast_futex_wake, METH_VARARGS, "futex_wake(addr, count=INT_MAX)"},
    {"ring_doorbell", fast_ring_doorbell, METH_O, "ring_doorbell(header_addr)"},
    {"publish", fast_publish, METH_VARARGS, "publish(slot, state, header, length, seq)"},
    {"spin_state", fast_spin_state, METH_VARARGS, "spin_state(state_addr, spin_ns) -> state"},
    {"spin_ready", fast_spin_ready, METH_VARARGS, "spin_ready(states, count, spin_ns)"},
    {"answer", fast_answer, METH_VARARGS, "answer(state_addr, slot_addr, state)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shminfer._fast", "shminfer's optional C hot path", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void)
{
    return PyModule_Create(&module);
}
