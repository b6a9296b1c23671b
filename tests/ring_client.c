/* A client of the kernel's syscall rings in C, written from docs/syscalls.md alone
 * ("Sessions and identity", "From another language", "pred on the lifeline",
 * "pred through the syscall rings", "Limits", "Errors") and syscalls/symphony.proto.
 * libc and POSIX only: PredRequest is encoded and PredReply decoded by hand.
 *
 * Usage: ring_client SOCK
 *   Says hello on SOCK.hello, asks for rings, prints its session token (one line), then
 *   reads commands on stdin, one a line, and answers each with one line:
 *     decode FD N TOKEN...  greedy pred of the TOKENs on FD, then N-1 one-token greedy preds
 *                           of each token sampled (a decode loop): "tokens T1 ... TN"
 *     cancel FD TOKEN...    a pred and at once a CANCEL of its call id: "errno E" or "token T"
 *     bad                   a record of kind 99: "errno E"
 *     quit
 *   An error reply is "errno E MESSAGE"; no reply within 30 s is "timeout".
 *   tests/test_ring_c_client.py drives it. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Counters are little-endian u64s that both sides update in place: this client reads and
 * writes them as native atomics, so it needs a little-endian machine. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the ring's counters are little-endian");

/* Frame and record kinds ("pred on the lifeline", "pred through the syscall rings"). */
enum { PRED = 1, REPLY = 2, SHUTDOWN = 3, CANCEL = 4, RING_SETUP = 5, RING = 6 };
/* Counter i is a u64 at byte 64 * i of the memfd ("Layout"). */
enum { MAGIC = 0, SQ_HEAD, SQ_TAIL, CQ_HEAD, CQ_TAIL, KERNEL_WAKE, PROCESS_WAKE };
#define RING_MAGIC 0x53594D52494E4731ull /* "SYMRING1" */
#define COUNTERS 4096
#define MAX_PAYLOAD (64u << 20) /* "Limits": a message is at most 64 MiB */
#define WAIT_MS 30000

static int lifeline, kernel_bell, process_bell;
static uint8_t *mem, *sq, *cq;
static uint64_t sq_bytes, cq_bytes, sq_tail_local;
static uint32_t next_call = 1; /* call id 0 is RING_SETUP's: preds take others */

static void die(const char *what) { perror(what); exit(1); }
static _Atomic uint64_t *counter(int i) { return (_Atomic uint64_t *)(mem + 64 * i); }
static uint32_t get_le32(const uint8_t *p) {
    return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = v >> (8 * i);
}
static uint64_t pad16(uint64_t n) { return (n + 15) & ~(uint64_t)15; }

static void read_all(int fd, void *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r == 0) { fprintf(stderr, "ring_client: the kernel hung up\n"); exit(1); }
        if (r < 0 && errno != EINTR) die("read");
        if (r > 0) got += r;
    }
}
static void write_all(int fd, const void *buf, size_t n) {
    for (size_t put = 0; put < n;) {
        ssize_t w = write(fd, (const char *)buf + put, n - put);
        if (w < 0 && errno != EINTR) die("write");
        if (w > 0) put += w;
    }
}

/* -- protobuf, by hand (the wire format; field numbers from symphony.proto) ------------- */

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    do { p[n++] = (v & 0x7f) | (v > 0x7f ? 0x80 : 0); v >>= 7; } while (v);
    return n;
}
/* PredRequest{fd = 1, tokens = 2 (packed)}; no sampler: temperature 0 is greedy. An int32
 * goes as its sign-extended 64-bit varint. */
static size_t encode_pred(uint8_t *out, int32_t fd, const int32_t *tokens, int n) {
    uint8_t packed[10 * 512];
    size_t len = 0, o = 0;
    for (int i = 0; i < n; i++) len += put_varint(packed + len, (uint64_t)(int64_t)tokens[i]);
    out[o++] = 1 << 3 | 0;
    o += put_varint(out + o, (uint64_t)(int64_t)fd);
    out[o++] = 2 << 3 | 2;
    o += put_varint(out + o, len);
    memcpy(out + o, packed, len);
    return o + len;
}

typedef struct { const uint8_t *p, *end; } Reader;
static int get_varint(Reader *r, uint64_t *v) {
    *v = 0;
    for (int shift = 0; r->p < r->end && shift < 64; shift += 7) {
        uint8_t b = *r->p++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}
/* The next field: its number and wire type; a length-delimited one's bytes in *sub. */
static int next_field(Reader *r, uint32_t *field, uint64_t *value, Reader *sub) {
    uint64_t key, n;
    sub->p = sub->end = NULL; /* empty unless the field is length-delimited */
    if (get_varint(r, &key)) return -1;
    *field = key >> 3;
    switch (key & 7) {
    case 0: return get_varint(r, value);
    case 1: n = 8; break;
    case 5: n = 4; break;
    case 2:
        if (get_varint(r, &n) || n > (uint64_t)(r->end - r->p)) return -1;
        sub->p = r->p, sub->end = r->p + n, r->p += n;
        return 0;
    default: return -1;
    }
    if (n > (uint64_t)(r->end - r->p)) return -1;
    r->p += n;
    return 0;
}
typedef struct { int32_t err; char message[256]; int32_t tokens[64]; int n; } Reply;
/* PredReply{error = 1: Error{errno = 1, message = 2}, outputs = 2: PredOutput{token = 2}}:
 * a field left out is 0 (proto3), so a reply with no `error` is a success. */
static int decode_reply(const uint8_t *buf, size_t len, Reply *out) {
    Reader r = {buf, buf + len}, sub, f;
    uint32_t field, inner;
    uint64_t v;
    memset(out, 0, sizeof *out);
    while (r.p < r.end) {
        if (next_field(&r, &field, &v, &sub)) return -1;
        if (field != 1 && field != 2) continue;
        int32_t token = 0;
        while (sub.p < sub.end) {
            if (next_field(&sub, &inner, &v, &f)) return -1;
            if (field == 1 && inner == 1) out->err = (int32_t)v;
            if (field == 1 && inner == 2)
                snprintf(out->message, sizeof out->message, "%.*s", (int)(f.end - f.p), f.p);
            if (field == 2 && inner == 2) token = (int32_t)v;
        }
        if (field == 2 && out->n < 64) out->tokens[out->n++] = token;
    }
    return 0;
}

/* -- the lifeline: hello, RING_SETUP, RING, and frames after -------------------------- */

static void frame_header(uint8_t h[9], uint32_t len, uint32_t call, uint8_t kind) {
    put_le32(h, len), put_le32(h + 4, call), h[8] = kind; /* 9 bytes, unpadded */
}

/* Read one frame off the lifeline (with recvmsg: a RING frame's descriptors ride on its
 * bytes, and a plain read would discard them). Reads exactly the frame's bytes. */
static uint8_t *recv_frame(uint32_t *len, uint32_t *call, uint8_t *kind, int fds[3], int *nfds) {
    uint8_t h[9];
    size_t got = 0;
    *nfds = 0;
    while (got < sizeof h) {
        char control[CMSG_SPACE(3 * sizeof(int))];
        struct iovec iov = {h + got, sizeof h - got};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = control, .msg_controllen = sizeof control};
        ssize_t r = recvmsg(lifeline, &msg, MSG_CMSG_CLOEXEC);
        if (r == 0) { fprintf(stderr, "ring_client: the kernel hung up\n"); exit(1); }
        if (r < 0) { if (errno == EINTR) continue; die("recvmsg"); }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                int n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (int i = 0; i < n && *nfds < 3; i++)
                    memcpy(&fds[(*nfds)++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            }
        got += r;
    }
    *len = get_le32(h), *call = get_le32(h + 4), *kind = h[8];
    /* "a header announcing more than 64 MiB means the stream is not frames": hang up */
    if (*len > MAX_PAYLOAD) { fprintf(stderr, "ring_client: not frames (EPROTO)\n"); exit(1); }
    uint8_t *payload = malloc(*len + 1);
    if (!payload) die("malloc");
    read_all(lifeline, payload, *len);
    return payload;
}

static void connect_and_set_up(const char *sock) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s.hello", sock) >= (int)sizeof addr.sun_path) {
        fprintf(stderr, "ring_client: socket path too long\n");
        exit(1);
    }
    lifeline = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lifeline < 0) die("socket");
    if (connect(lifeline, (struct sockaddr *)&addr, sizeof addr)) die(addr.sun_path);

    /* The hello answer is one line, the token and "\n" (or "refused ERRNO MESSAGE").
     * Read a byte at a time, so that nothing after the newline is consumed; no descriptor
     * can come yet, as RING_SETUP is not sent. */
    char token[512];
    size_t n = 0;
    for (;;) {
        char c;
        read_all(lifeline, &c, 1);
        if (c == '\n') break;
        if (n + 1 >= sizeof token) { fprintf(stderr, "ring_client: hello line too long\n"); exit(1); }
        token[n++] = c;
    }
    token[n] = 0;
    if (strncmp(token, "refused ", 8) == 0) { fprintf(stderr, "ring_client: hello %s\n", token); exit(1); }

    /* "Right after the token line the process sends a RING_SETUP frame (call id 0, no
     * payload)". */
    uint8_t h[9];
    frame_header(h, 0, 0, RING_SETUP);
    write_all(lifeline, h, sizeof h);

    uint32_t len, call;
    uint8_t kind;
    int fds[3], nfds;
    uint8_t *payload = recv_frame(&len, &call, &kind, fds, &nfds);
    if (kind == REPLY) { /* "If the kernel cannot make them, ... a REPLY frame of call id 0" */
        Reply reply;
        decode_reply(payload, len, &reply);
        fprintf(stderr, "ring_client: RING_SETUP: errno %d %s\n", reply.err, reply.message);
        exit(1);
    }
    if (kind != RING || len != 16 || nfds != 3) {
        fprintf(stderr, "ring_client: expected RING with 16 bytes and 3 fds, got kind %d, %u bytes, %d fds\n",
                kind, len, nfds);
        exit(1);
    }
    /* Two little-endian u64: SQ_BYTES, CQ_BYTES; fds in order: memfd, kernel's bell,
     * process's bell. */
    sq_bytes = get_le32(payload) | (uint64_t)get_le32(payload + 4) << 32;
    cq_bytes = get_le32(payload + 8) | (uint64_t)get_le32(payload + 12) << 32;
    free(payload);
    kernel_bell = fds[1], process_bell = fds[2];
    size_t size = COUNTERS + sq_bytes + cq_bytes;
    struct stat st;
    if (fstat(fds[0], &st) || (uint64_t)st.st_size != size) {
        fprintf(stderr, "ring_client: memfd is not 4096 + SQ_BYTES + CQ_BYTES bytes\n");
        exit(1);
    }
    /* "The process maps the memfd shared, read and write, and may close it". */
    mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    if (mem == MAP_FAILED) die("mmap");
    close(fds[0]);
    sq = mem + COUNTERS, cq = sq + sq_bytes;
    if (atomic_load(counter(MAGIC)) != RING_MAGIC || memcmp(mem, "1GNIRMYS", 8) != 0) {
        fprintf(stderr, "ring_client: bad magic\n");
        exit(1);
    }
    /* "a process that waits on its bell stores 1 there first ... or the kernel never rings
     * it": kept at 1 all the time, as the clients do. */
    atomic_store(counter(PROCESS_WAKE), 1);
    sq_tail_local = atomic_load(counter(SQ_TAIL));
    printf("%s\n", token);
    fflush(stdout);
}

/* -- the submission ring -------------------------------------------------------------- */

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

/* Byte n of a ring is at offset n mod its size: a record may run past the ring's end and go
 * on at its start. */
static void ring_put(uint64_t pos, const uint8_t *src, size_t n) {
    for (size_t i = 0; i < n; i++) sq[(pos + i) % sq_bytes] = src[i];
}
static void ring_get(uint64_t pos, uint8_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = cq[(pos + i) % cq_bytes];
}

/* Write a record at the tail not yet published: a 16-byte header (u32 length, u32 call id,
 * u32 kind, u32 0), the payload, padded to a multiple of 16. Never past sq_head + SQ_BYTES;
 * like the clients, leave 16 bytes free after it (room for a FRAMED record). */
static void put_record(uint32_t kind, uint32_t call, const uint8_t *payload, uint32_t len) {
    uint64_t need = 16 + pad16(len);
    if (need + 16 > sq_bytes) { fprintf(stderr, "ring_client: record larger than the ring\n"); exit(1); }
    for (long long deadline = now_ms() + WAIT_MS;
         sq_tail_local + need + 16 > atomic_load_explicit(counter(SQ_HEAD), memory_order_acquire) + sq_bytes;) {
        if (now_ms() > deadline) { fprintf(stderr, "ring_client: the submission ring stays full\n"); exit(1); }
        poll(NULL, 0, 1);
    }
    uint8_t h[16] = {0};
    put_le32(h, len), put_le32(h + 4, call), put_le32(h + 8, kind);
    ring_put(sq_tail_local, h, 16);
    ring_put(sq_tail_local + 16, payload, len);
    sq_tail_local += need; /* the padding's bytes may be anything */
}

/* Store the new sq_tail; then, after a full barrier, read kernel_wake and, if it is 1,
 * ring the kernel's bell (write the u64 1 in the machine's byte order). */
static void publish(void) {
    atomic_store_explicit(counter(SQ_TAIL), sq_tail_local, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(counter(KERNEL_WAKE), memory_order_relaxed) == 1) {
        uint64_t one = 1;
        if (write(kernel_bell, &one, 8) != 8 && errno != EAGAIN) die("write kernel bell");
    }
}

/* -- completions ---------------------------------------------------------------------- */

/* The next reply, from the completion ring or (the ring full) as a REPLY frame on the
 * lifeline. Returns its payload (malloc'd), or NULL on timeout. */
static uint8_t *next_reply(uint32_t *call, uint32_t *len, long long deadline) {
    for (;;) {
        /* Clear the bell by reading its 8 bytes (EAGAIN at 0) before looking at the ring. */
        uint64_t count;
        if (read(process_bell, &count, 8) < 0 && errno != EAGAIN && errno != EINTR) die("read bell");
        uint64_t head = atomic_load_explicit(counter(CQ_HEAD), memory_order_relaxed);
        uint64_t tail = atomic_load_explicit(counter(CQ_TAIL), memory_order_acquire);
        if (head != tail) {
            uint8_t h[16];
            ring_get(head, h, 16);
            uint32_t kind = get_le32(h + 8);
            *len = get_le32(h), *call = get_le32(h + 4);
            if (*len > cq_bytes - 16 || head + 16 + pad16(*len) > tail || kind != REPLY) {
                fprintf(stderr, "ring_client: bad completion record\n");
                exit(1);
            }
            uint8_t *payload = malloc(*len + 1);
            if (!payload) die("malloc");
            ring_get(head + 16, payload, *len);
            /* Done with the bytes: hand them back by moving cq_head. */
            atomic_store_explicit(counter(CQ_HEAD), head + 16 + pad16(*len), memory_order_release);
            return payload;
        }
        /* process_wake stays 1, so the kernel rings after every turn that completes. */
        struct pollfd p[2] = {{process_bell, POLLIN, 0}, {lifeline, POLLIN, 0}};
        long long left = deadline - now_ms();
        if (left <= 0) return NULL;
        if (poll(p, 2, (int)left) < 0 && errno != EINTR) die("poll");
        if (p[1].revents) {
            uint8_t kind;
            int fds[3], nfds;
            uint8_t *payload = recv_frame(len, call, &kind, fds, &nfds);
            for (int i = 0; i < nfds; i++) close(fds[i]);
            if (kind == REPLY) return payload;
            if (kind == SHUTDOWN) { fprintf(stderr, "ring_client: the kernel is stopping\n"); exit(1); }
            free(payload);
        }
    }
}

/* The reply to `call`; replies of other call ids are reported and dropped. */
static int wait_reply(uint32_t want, Reply *out) {
    long long deadline = now_ms() + WAIT_MS;
    for (;;) {
        uint32_t call, len;
        uint8_t *payload = next_reply(&call, &len, deadline);
        if (!payload) return -1;
        int bad = decode_reply(payload, len, out);
        free(payload);
        if (bad) { fprintf(stderr, "ring_client: reply of call %u does not parse\n", call); exit(1); }
        if (call == want) return 0;
        fprintf(stderr, "ring_client: unexpected reply, call %u errno %d\n", call, out->err);
    }
}

/* -- commands ------------------------------------------------------------------------- */

static uint32_t submit_pred(int32_t fd, const int32_t *tokens, int n) {
    uint8_t payload[16 + 10 * 512];
    uint32_t call = next_call++;
    put_record(PRED, call, payload, encode_pred(payload, fd, tokens, n));
    return call;
}

static void print_error_or_timeout(int timed_out, const Reply *r) {
    if (timed_out) printf("timeout\n");
    else printf("errno %d %s\n", r->err, r->message);
}

static void decode(int32_t fd, int steps, int32_t *tokens, int n) {
    int32_t out[1024];
    Reply r;
    for (int i = 0; i < steps; i++) {
        uint32_t call = i == 0 ? submit_pred(fd, tokens, n) : submit_pred(fd, &out[i - 1], 1);
        publish();
        int timed_out = wait_reply(call, &r);
        if (timed_out || r.err || r.n != 1) { print_error_or_timeout(timed_out, &r); return; }
        out[i] = r.tokens[0];
    }
    printf("tokens");
    for (int i = 0; i < steps; i++) printf(" %d", out[i]);
    printf("\n");
}

static void cancel(int32_t fd, int32_t *tokens, int n) {
    /* Both records in one submission, one bell: the CANCEL names the PRED's call id and has
     * no payload. The PRED gets exactly one reply: ECANCELED, or its answer if that came
     * first (then the CANCEL is nothing and gets no reply). */
    uint32_t call = submit_pred(fd, tokens, n);
    put_record(CANCEL, call, NULL, 0);
    publish();
    Reply r;
    int timed_out = wait_reply(call, &r);
    if (!timed_out && !r.err && r.n == 1) printf("token %d\n", r.tokens[0]);
    else print_error_or_timeout(timed_out, &r);
}

static void bad(void) {
    /* "A record of another kind ... is answered with EINVAL, as on the lifeline." */
    uint32_t call = next_call++;
    put_record(99, call, NULL, 0);
    publish();
    Reply r;
    print_error_or_timeout(wait_reply(call, &r), &r);
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: ring_client SOCK\n"); return 2; }
    connect_and_set_up(argv[1]);
    char line[8192];
    while (fgets(line, sizeof line, stdin)) {
        char *words[600];
        int n = 0;
        for (char *w = strtok(line, " \t\n"); w && n < 600; w = strtok(NULL, " \t\n")) words[n++] = w;
        if (n == 0) continue;
        int32_t tokens[512];
        if (strcmp(words[0], "decode") == 0 && n >= 4 && atoi(words[2]) >= 1 && atoi(words[2]) <= 1024) {
            for (int i = 3; i < n && i - 3 < 512; i++) tokens[i - 3] = atoi(words[i]);
            decode(atoi(words[1]), atoi(words[2]), tokens, n - 3 < 512 ? n - 3 : 512);
        } else if (strcmp(words[0], "cancel") == 0 && n >= 3) {
            for (int i = 2; i < n && i - 2 < 512; i++) tokens[i - 2] = atoi(words[i]);
            cancel(atoi(words[1]), tokens, n - 2 < 512 ? n - 2 : 512);
        } else if (strcmp(words[0], "bad") == 0) {
            bad();
        } else if (strcmp(words[0], "quit") == 0) {
            break;
        } else {
            printf("usage: decode FD N TOKEN... | cancel FD TOKEN... | bad | quit\n");
        }
        fflush(stdout);
    }
    return 0; /* exit closes the lifeline, which ends the session */
}
