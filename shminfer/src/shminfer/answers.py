"""The worker's answers: a batch's outputs (or an error) written into its slots, the
batch's record in the metrics ring, DONE and the clients' wake-ups, the slow_infer event.
Worker (worker.py) serves with these."""

from __future__ import annotations

import time

import numpy as np

from shminfer import _sys
from shminfer.codec import PayloadError
from shminfer.queue import (
    CPU_NOT_MEASURED,
    DONE,
    ERROR,
    S32,
    S32_BATCH_SIZE,
    S32_RESPONSE_LEN,
    S64,
    S64_DONE_NS,
    S64_ENQUEUE_NS,
    S64_RESPONSE_SEQ,
    queue_wait_ns,
)
from shminfer.worker_process import log_event, threading_count

MAX_ERROR = 1024  # bytes of error text in an ERROR response


class Answers:
    """Worker's answering steps; they use its segment (``seg``), response views, request
    tags, encoder, slow-batch thresholds, CPU and scheduling policy."""

    def _fail(self, index, message):
        raw = message.encode("utf-8", "replace")[: min(self.seg.response_bytes, MAX_ERROR)]
        self.responses[index][: len(raw)] = raw
        self.seg.slot32[index * S32 + S32_RESPONSE_LEN] = len(raw)
        self.seg.slot64[index * S64 + S64_RESPONSE_SEQ] = self.tags[index]
        if _sys.FAST is not None:
            _sys.FAST.answer(self.seg.state_addr(index), self.seg.slot_addr(index), ERROR)
            return
        self.seg.state_words[index] = ERROR
        self.seg.wake_slot(index)

    def _after_infer(self, entries, start_ns, *, out, outputs, error, clocks):
        """Answer a batch the backend ran: ERROR each slot, or its outputs (in place when
        the backend wrote into ``out``), its ring record, DONE."""
        seg = self.seg
        wall, cpu, thread, measured = clocks
        total_rows = entries[0][2] if len(entries) == 1 else sum(e[2] for e in entries)
        if error is not None:
            for index, _, _ in entries:
                self._fail(index, f"inference failed: {error}")
            return
        done_ns = time.monotonic_ns()
        if out is not None and outputs is out:
            # The backend wrote into the response slot: the header is all that is left.
            index = entries[0][0]
            answered = self._answer_in_place(index, out, total_rows, done_ns)
            enqueued = seg.slot64[index * S64 + S64_ENQUEUE_NS] if answered else start_ns
            queue_wait = queue_wait_ns(start_ns, enqueued)
        else:
            answered, queue_wait = self._encode_answers(
                entries, outputs, total_rows, start_ns, done_ns
            )
        # The batch's record goes in before its answers are published: a client that has
        # seen DONE finds its batch in the metrics ring.
        seg.ring_append((done_ns, wall, cpu, thread, queue_wait, total_rows))
        if _sys.FAST is not None:
            answer = _sys.FAST.answer
            for index in answered:  # DONE, fence, wake a sleeping client: in C
                answer(seg.state_addr(index), seg.slot_addr(index), DONE)
        else:
            for index in answered:
                seg.state_words[index] = DONE
            _sys.full_fence()  # DONE stores before the loads of the waiter flags
            for index in answered:
                seg.wake_slot(index, fenced=True)
        if wall > self.slow_wall_ns or (measured and cpu > self.slow_cpu_ns):
            self._log_slow(
                len(entries),
                total_rows,
                measured=measured,
                cpu=cpu,
                thread=thread,
                wall=wall,
                queue_wait=queue_wait,
            )

    def _answer_in_place(self, index, out, total_rows, done_ns):
        seg = self.seg
        try:
            length = self.encoder.encode_in_place(self.responses[index], out, index)
        except PayloadError as exc:
            self._fail(index, f"response does not fit: {exc}")
            return ()
        lengths = seg.slot32
        fields = seg.slot64
        lengths[index * S32 + S32_RESPONSE_LEN] = length
        lengths[index * S32 + S32_BATCH_SIZE] = total_rows
        fields[index * S64 + S64_RESPONSE_SEQ] = self.tags[index]
        fields[index * S64 + S64_DONE_NS] = done_ns
        return (index,)

    def _encode_answers(self, entries, outputs, total_rows, start_ns, done_ns):
        """Copy each request's part of ``outputs`` into its slot: (answered, the longest
        queue wait among them, queue.queue_wait_ns)."""
        seg = self.seg
        row = 0
        queue_wait = 0
        answered = []
        fields = seg.slot64
        lengths = seg.slot32
        whole = len(entries) == 1  # the outputs are this one request's, unless shaped otherwise
        if whole:
            rows = entries[0][2]
            for value in outputs.values():
                if type(value) is not np.ndarray or not value.ndim or value.shape[0] != rows:
                    whole = False
                    break
        for index, _, rows in entries:
            if whole:
                part = outputs
            else:
                part = {name: value[row : row + rows] for name, value in outputs.items()}
            row += rows
            try:
                length = self.encoder.encode_into(self.responses[index], part, slot=index)
            except Exception as exc:
                self._fail(
                    index,
                    f"response does not fit: {exc}; send smaller batches or start the server "
                    "with a larger --response-bytes",
                )
                continue
            base = index * S64
            enqueued = fields[base + S64_ENQUEUE_NS]
            queue_wait = max(queue_wait, queue_wait_ns(start_ns, enqueued))
            lengths[index * S32 + S32_RESPONSE_LEN] = length
            lengths[index * S32 + S32_BATCH_SIZE] = total_rows
            fields[base + S64_RESPONSE_SEQ] = self.tags[index]
            fields[base + S64_DONE_NS] = done_ns
            answered.append(index)
        return answered, queue_wait

    def _log_slow(self, slots, total_rows, *, measured, cpu, thread, wall, queue_wait):
        log_event(
            "slow_infer",
            cpu=self.cpu,
            slots=slots,
            total_batch=total_rows,
            engine_cpu_ms=round(cpu / 1e6, 3) if measured else None,
            engine_thread_cpu_ms=None if thread == CPU_NOT_MEASURED else round(thread / 1e6, 3),
            wall_ms=round(wall / 1e6, 3),
            deschedule_ms=round(max(0, wall - (cpu if measured else 0)) / 1e6, 3),
            queue_wait_ms=round(queue_wait / 1e6, 3),
            sched_fifo=self.policy.enabled,
            threads=threading_count(),
        )
