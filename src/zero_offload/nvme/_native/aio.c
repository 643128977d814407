/*
 * Native submission path of the NVMe swapper: one call moves a whole request between a host buffer and a file
 * with Linux native AIO (io_setup / io_submit / io_getevents), keeping `queue_depth` requests of `block_size`
 * bytes in flight on the device, all from one thread that holds no GIL (ctypes releases it for the call).
 *
 * This is what DeepSpeed's aio handle does per I/O thread (csrc/aio/common/deepspeed_aio_common.cpp: a libaio
 * context of queue_depth, blocks of block_size, refilled as events complete). The syscalls are issued
 * directly, so neither libaio nor its headers are needed: <linux/aio_abi.h> ships with the kernel headers.
 *
 * Short transfers are resubmitted for the remainder; a read that meets the end of the file fills the rest of
 * its block with zeros (a sparse swap file reads as zeros). Every function returns 0, or -errno of the first
 * failure (ENOSYS where native AIO is missing: the caller then uses its portable path).
 *
 * Contexts are made by zo_aio_open and kept by the caller for reuse: io_setup + io_destroy cost tens of
 * milliseconds in a virtual machine (io_destroy waits for an RCU grace period), as long as a whole request.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#if defined(__linux__)
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ZO_MAX_DEPTH 256

static long zo_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(__NR_io_setup, nr, ctx); }
static long zo_io_destroy(aio_context_t ctx) { return syscall(__NR_io_destroy, ctx); }
static long zo_io_submit(aio_context_t ctx, long n, struct iocb **iocbs) {
    return syscall(__NR_io_submit, ctx, n, iocbs);
}
static long zo_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events) {
    return syscall(__NR_io_getevents, ctx, min_nr, nr, events, (struct timespec *)0);
}

/* One slot of the queue: the block it is moving and how much of it is done. */
typedef struct {
    struct iocb cb;
    int64_t lo, hi, done;
} zo_slot;

static void zo_prepare(zo_slot *s, int fd, char *buf, int64_t offset, int write) {
    memset(&s->cb, 0, sizeof s->cb);
    s->cb.aio_fildes = (uint32_t)fd;
    s->cb.aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    s->cb.aio_buf = (uint64_t)(uintptr_t)(buf + s->lo + s->done);
    s->cb.aio_nbytes = (uint64_t)(s->hi - s->lo - s->done);
    s->cb.aio_offset = offset + s->lo + s->done;
    s->cb.aio_data = (uint64_t)(uintptr_t)s;
}

/* Submit the `n` control blocks, retrying on EAGAIN and partial acceptance. Returns how many were accepted;
 * sets *err to -errno when the kernel refuses one. */
static long zo_submit_all(aio_context_t ctx, struct iocb **cbs, long n, int *err) {
    long sent = 0;
    while (sent < n) {
        long r = zo_io_submit(ctx, n - sent, cbs + sent);
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            if (!*err) *err = -errno;
            break;
        }
        sent += r;
    }
    return sent;
}

/* A context for up to `depth` requests in flight (at most ZO_MAX_DEPTH), in *ctx_out. */
int zo_aio_open(int depth, uint64_t *ctx_out) {
    aio_context_t ctx = 0;
    if (depth < 1 || depth > ZO_MAX_DEPTH) return -EINVAL;
    if (zo_io_setup((unsigned)depth, &ctx) < 0) return -errno;
    *ctx_out = (uint64_t)ctx;
    return 0;
}

int zo_aio_close(uint64_t ctx) { return zo_io_destroy((aio_context_t)ctx) < 0 ? -errno : 0; }

/* Move `nbytes` between `buffer` and byte `offset` of `fd` through `ctx` (opened with depth >= queue_depth). */
int zo_aio_transfer(uint64_t ctx_handle, int fd, void *buffer, int64_t nbytes, int64_t offset, int64_t block_size,
                    int queue_depth, int write) {
    if (nbytes <= 0) return 0;
    if (block_size <= 0 || queue_depth < 1 || queue_depth > ZO_MAX_DEPTH) return -EINVAL;
    char *buf = (char *)buffer;
    aio_context_t ctx = (aio_context_t)ctx_handle;

    zo_slot slots[ZO_MAX_DEPTH];
    struct iocb *cbs[ZO_MAX_DEPTH];
    struct io_event events[ZO_MAX_DEPTH];
    int64_t next = 0;           /* first byte not yet given to a slot */
    long in_flight = 0, n = 0;
    int err = 0;

    for (; n < queue_depth && next < nbytes; ++n) {
        slots[n].lo = next;
        slots[n].hi = next + block_size < nbytes ? next + block_size : nbytes;
        slots[n].done = 0;
        next = slots[n].hi;
        zo_prepare(&slots[n], fd, buf, offset, write);
        cbs[n] = &slots[n].cb;
    }
    in_flight = zo_submit_all(ctx, cbs, n, &err);

    while (in_flight > 0) {
        long got = zo_io_getevents(ctx, 1, in_flight, events);
        if (got < 0) {
            if (errno == EINTR) continue;
            err = err ? err : -errno;
            break;
        }
        long resubmit = 0;
        for (long k = 0; k < got; ++k) {
            zo_slot *s = (zo_slot *)(uintptr_t)events[k].data;
            long long res = (long long)events[k].res;
            --in_flight;
            if (res < 0) { err = err ? err : (int)res; continue; }
            if (err) continue;                       /* draining after a failure */
            if (res == 0 && !write) {                /* end of file: the rest reads as zeros */
                memset(buf + s->lo + s->done, 0, (size_t)(s->hi - s->lo - s->done));
                s->done = s->hi - s->lo;
            } else if (res == 0) {
                err = -EIO;                          /* a write that makes no progress */
                continue;
            } else {
                s->done += res;
            }
            if (s->done < s->hi - s->lo) {           /* short transfer: the remainder again */
                zo_prepare(s, fd, buf, offset, write);
            } else if (next < nbytes) {              /* block done: the slot takes the next one */
                s->lo = next;
                s->hi = next + block_size < nbytes ? next + block_size : nbytes;
                s->done = 0;
                next = s->hi;
                zo_prepare(s, fd, buf, offset, write);
            } else {
                continue;
            }
            cbs[resubmit++] = &s->cb;
        }
        if (resubmit) in_flight += zo_submit_all(ctx, cbs, resubmit, &err);
    }
    return err;
}

#else
int zo_aio_open(int depth, uint64_t *ctx_out) { (void)depth; (void)ctx_out; return -ENOSYS; }
int zo_aio_close(uint64_t ctx) { (void)ctx; return -ENOSYS; }
int zo_aio_transfer(uint64_t ctx, int fd, void *buffer, int64_t nbytes, int64_t offset, int64_t block_size,
                    int queue_depth, int write) {
    (void)ctx; (void)fd; (void)buffer; (void)nbytes; (void)offset; (void)block_size; (void)queue_depth;
    (void)write;
    return -ENOSYS;
}
#endif
