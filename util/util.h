/*
 * util — the small shared base of rumor: error codes and messages, logging,
 * clocks, checked allocation, always-on asserts and a seeded random
 * generator. Every other module may include this header; it includes
 * nothing of rumor's.
 */
#ifndef RUMOR_UTIL_H
#define RUMOR_UTIL_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define RUMOR_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#define RUMOR_MUST_CHECK __attribute__((warn_unused_result))
#define RUMOR_NORETURN __attribute__((noreturn))
#else
#define RUMOR_PRINTF(a, b)
#define RUMOR_MUST_CHECK
#define RUMOR_NORETURN
#endif

/* ---- lengths from the compiler -----------------------------------------------
 * A literal and its length for calls that take both: the compiler counts,
 * never a hand. `"" s ""` makes anything but a string literal a compile
 * error (sizeof of a pointer would be 8). */
#define STR_LEN(s) (sizeof("" s "") - 1)
#define STR_LIT(s) ("" s ""), STR_LEN(s)

/* Little-endian integers in byte buffers (wire metadata). */
static inline void le_put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void le_put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t le_get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t le_get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}
/* Whether the bytes p[0..n) (no NUL needed) are exactly the literal `s`. */
#define STR_EQ_LIT(p, n, s) ((n) == STR_LEN(s) && memcmp((p), (s), STR_LEN(s)) == 0)
/* Whether the NUL-terminated string `p` starts with the literal `s`. */
#define STR_PREFIX(p, s) (strncmp((p), (s), STR_LEN(s)) == 0)

/* ---- error codes -----------------------------------------------------------
 * Functions that can fail at run time return 0 on success and a negative code
 * on failure. Codes are negative errno values (-ENOENT, -EINVAL, ...) or one of
 * the rumor-specific codes below, which sit far below any errno.
 */
enum {
  RUMOR_OK = 0,
  RUMOR_ECORRUPT = -10001,  /* a file or message failed validation */
  RUMOR_EFORMAT = -10002,   /* malformed input (bad flag value, spec, syntax) */
  RUMOR_EAUTH = -10003,     /* authentication or admission failed */
  RUMOR_EPROTO = -10004,    /* protocol violation by the remote side */
  RUMOR_ETOOBIG = -10005,   /* a declared size exceeds its cap */
  RUMOR_EDEVICE = -10006,   /* device unavailable or a device call failed */
  RUMOR_ESHAPE = -10007,    /* tensor shape or dtype mismatch */
  RUMOR_ECANCELED = -10008, /* the operation was abandoned */
  RUMOR_ETIMEDOUT = -10009, /* a deadline passed */
  RUMOR_ENOTFOUND = -10010, /* a named thing does not exist */
  RUMOR_EDIVERGED = -10011, /* training's loss or parameters became NaN or infinite */
};

/* Returns a static, human-readable description of `code` (never NULL). */
const char *rumor_strerror(int code);

/* An error record: a code and a message that names the problem and the input.
 * Functions that report detail take a `struct rumor_err *` (which may be NULL
 * when the caller does not want the text). */
struct rumor_err {
  int code;
  char msg[512];
};

/* Records `code` and a formatted message in `e` (if not NULL) and returns
 * `code`, so callers can write `return rumor_err_set(e, -EINVAL, "...")`. */
int rumor_err_set(struct rumor_err *e, int code, const char *fmt, ...) RUMOR_PRINTF(3, 4);
/* Prepends "prefix: " to an existing message in `e`; returns e->code. */
int rumor_err_prefix(struct rumor_err *e, const char *fmt, ...) RUMOR_PRINTF(2, 3);

/* ---- logging ---------------------------------------------------------------
 * Human lines on stderr by default ("12:03:04.123 INFO  [name] message");
 * with log_set_json(true) one JSON object per line. Thread-safe: each line is
 * formatted in a local buffer and written with one write(2).
 */
enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3 };

void log_set_level(enum log_level level);
void log_set_json(bool on);
/* A short name for this process ("peer-3", "bootstrap") shown on each line.
 * The string is copied. Call before other threads log. */
void log_set_name(const char *name);
void log_msg(enum log_level level, const char *fmt, ...) RUMOR_PRINTF(2, 3);
void log_vmsg(enum log_level level, const char *fmt, va_list ap);
bool log_enabled(enum log_level level);

#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)

/* ---- asserts and checked allocation ------------------------------------------
 * RUMOR_ASSERT is for broken invariants of our own code only, never for input
 * from files or the network. It is always on (also in release builds).
 */
RUMOR_NORETURN void rumor_panic(const char *file, int line, const char *fmt, ...) RUMOR_PRINTF(3, 4);
#define RUMOR_ASSERT(cond)                                                   \
  do {                                                                       \
    if (!(cond)) rumor_panic(__FILE__, __LINE__, "assertion failed: %s", #cond); \
  } while (0)

/* Allocation that cannot fail: on out-of-memory it reports the call site and
 * size and aborts. Use only for sizes we chose; sizes read from a file or the
 * network are capped and allocated with plain malloc and checked. */
void *rumor_xmalloc_at(size_t n, const char *file, int line);
void *rumor_xcalloc_at(size_t count, size_t size, const char *file, int line);
void *rumor_xrealloc_at(void *p, size_t n, const char *file, int line);
char *rumor_xstrdup_at(const char *s, const char *file, int line);
#define xmalloc(n) rumor_xmalloc_at((n), __FILE__, __LINE__)
#define xcalloc(c, s) rumor_xcalloc_at((c), (s), __FILE__, __LINE__)
#define xrealloc(p, n) rumor_xrealloc_at((p), (n), __FILE__, __LINE__)
#define xstrdup(s) rumor_xstrdup_at((s), __FILE__, __LINE__)

/* ---- clocks ----------------------------------------------------------------- */
/* Monotonic time in nanoseconds (for durations and deadlines). */
uint64_t clock_now_ns(void);
/* Monotonic time in seconds, as a double (for rates and progress lines). */
double clock_now_s(void);
/* Wall-clock time in milliseconds since the Unix epoch (for logs and files). */
int64_t clock_wall_ms(void);
/* The same in microseconds (to order events of processes on one host). */
int64_t clock_wall_us(void);

/* ---- random numbers -----------------------------------------------------------
 * xoshiro256** seeded through splitmix64: fast, reproducible across platforms,
 * and independent streams from (seed, stream) pairs. Not for cryptography
 * (keys come from libsodium).
 */
struct rng {
  uint64_t s[4];
};
void rng_seed(struct rng *r, uint64_t seed, uint64_t stream);
uint64_t rng_next_u64(struct rng *r);
/* Uniform integer in [0, bound), bound > 0, without modulo bias. */
uint64_t rng_below(struct rng *r, uint64_t bound);
/* Uniform float in [0, 1) with 24 random bits. */
float rng_uniform(struct rng *r);
/* Standard normal (Box-Muller). */
float rng_normal(struct rng *r);

/* ---- small parsing helpers for command lines and files ------------------------
 * Each returns 0 and stores the value, or RUMOR_EFORMAT (the output untouched)
 * when `s` is not entirely a number in range. */
int parse_i64(const char *s, int64_t min, int64_t max, int64_t *out) RUMOR_MUST_CHECK;
int parse_f64(const char *s, double min, double max, double *out) RUMOR_MUST_CHECK;

/* ---- CPU lists ------------------------------------------------------------------
 * A set of CPUs written like taskset's lists, "0-3,8". Threads started by a
 * pinned thread inherit its CPUs. */
#define CPU_LIST_MAX 1024
struct cpu_list {
  uint64_t bits[CPU_LIST_MAX / 64];
};
/* Parses `s`; every CPU must be one this process may run on. Returns 0, or
 * RUMOR_EFORMAT with a message naming the list. */
int cpu_list_parse(const char *s, struct cpu_list *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Restricts the calling thread to the CPUs of `c`. */
int cpu_pin_self(const struct cpu_list *c, struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- files ----------------------------------------------------------------------
 * Atomic files: every file that must appear whole (keys, checkpoints,
 * config.json, charts) is written here, never in place. The data goes to a
 * new temporary file beside `path`, named `path`.tmp.PID.HEX (HEX: 16
 * random hex digits from getrandom(2), so the name cannot be guessed in
 * advance; the PID lets a later writer remove what a dead one left),
 * created with O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC (nothing planted at
 * that name is opened, written or followed) and given exactly `mode` with
 * fchmod (the umask neither widens nor narrows it: secrets are 0600). Then
 * the data, fsync of the file, and either rename over `path` or, with
 * FILE_ATOMIC_NO_REPLACE, link(2) to `path`, which fails with -EEXIST when
 * anything is there (a file, a directory, a symlink, dangling or not), so an
 * existing file is never replaced, even by a race; then fsync of the
 * directory.
 *
 * On a failure before the rename or link, `path` is untouched, the
 * temporary is removed and a negative errno is returned with a message in
 * `e` naming `path` (an unwritable directory: "cannot create a temporary
 * file in DIR for PATH: Permission denied"). A failed fsync of the
 * directory after the rename is reported the same way, but then `path`
 * already holds the new content (whether the rename survives a crash is
 * what is unknown). Not thread-safe on one handle; distinct handles are
 * independent. */
#define FILE_ATOMIC_NO_REPLACE 1u /* link, not rename: -EEXIST when `path` exists */

/* A whole-buffer write: the data is given as `nparts` pieces written in
 * order, so callers need not concatenate large buffers. `flags`: 0 or
 * FILE_ATOMIC_NO_REPLACE. */
struct file_part {
  const void *data;
  size_t len;
};
int file_write_atomic(const char *path, const struct file_part *parts, size_t nparts, unsigned mode, unsigned flags,
                      struct rumor_err *e) RUMOR_MUST_CHECK;

/* The streaming form, for a file written in pieces as it is made:
 * file_atomic_open creates the temporary; file_atomic_write (or
 * file_write_full on `fd`) appends to it; file_atomic_sync fsyncs and
 * closes it (the data is then durable under the temporary name: a caller
 * may do something between that and the rename, as a checkpoint keeps its
 * previous file); file_atomic_commit syncs when that was not done and puts
 * the file in place; file_atomic_abort removes the temporary. Commit and
 * abort both release the handle, whatever the outcome; abort after a
 * commit, or twice, does nothing, so a clean-up path may always call it. A
 * handle that file_atomic_open refused needs neither. */
struct file_atomic {
  int fd;      /* the temporary, open for writing; -1 once synced */
  char *path;  /* where the file goes; NULL once released */
  char *tmp;   /* the temporary's name */
  unsigned mode;
};
int file_atomic_open(struct file_atomic *fa, const char *path, unsigned mode, struct rumor_err *e) RUMOR_MUST_CHECK;
int file_atomic_write(struct file_atomic *fa, const void *buf, size_t n, struct rumor_err *e) RUMOR_MUST_CHECK;
int file_atomic_sync(struct file_atomic *fa, struct rumor_err *e) RUMOR_MUST_CHECK;
int file_atomic_commit(struct file_atomic *fa, unsigned flags, struct rumor_err *e) RUMOR_MUST_CHECK;
void file_atomic_abort(struct file_atomic *fa);

/* Makes `linkpath` another name (a hard link) of the file at `target`,
 * replacing whatever `linkpath` was, atomically: the link is made under a
 * temporary name as above and renamed over `linkpath`, so `linkpath` is
 * never missing or partial. Returns 0, -ENOENT (with a message) when there
 * is no `target`, or another negative errno with a message; on a failure
 * `linkpath` is untouched and no temporary is left. */
int file_link_atomic(const char *target, const char *linkpath, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Whether `name` is a temporary this writer makes for a file named `base`
 * (in the same directory): `base`.tmp.PID.HEX, or the older forms
 * `base`.tmp.PID and `base`.tmp.PID.tmp.PID. Returns the writer's PID (> 0),
 * or 0 when it is not one. */
long file_atomic_temp_pid(const char *name, const char *base);

/* Writes all n bytes to fd (retrying short writes and EINTR). Returns 0 or
 * a negative errno. */
int file_write_full(int fd, const void *buf, size_t n) RUMOR_MUST_CHECK;

/* Opens a path the user named, for reading: open(2) with `flags` (O_RDONLY,
 * or e.g. O_RDWR | O_CREAT | O_APPEND with `mode`) plus O_NONBLOCK and
 * O_CLOEXEC, so that opening a FIFO does not wait for a writer; then
 * refuses anything but a regular file and clears O_NONBLOCK. Every read of
 * a file given on the command line goes through here (or file_read_all):
 * the stop signals are blocked in every thread, so an open(2) that waits
 * for a FIFO's writer could not even be interrupted. Returns the descriptor
 * (the caller closes it), with its fstat in `*st` when `st` is not NULL;
 * or a negative errno with a message naming the path: -EINVAL and "PATH is
 * not a regular file (it is a FIFO)" and the like. */
struct stat;
/* What a file of mode `m` is, for messages: "a directory", "a FIFO", ... */
const char *file_kind(unsigned m);
int file_open_regular(const char *path, int flags, unsigned mode, struct stat *st,
                      struct rumor_err *e) RUMOR_MUST_CHECK;

/* Reads a whole regular file (file_open_regular) of at most `max_len`
 * bytes into a new buffer (caller frees). Returns 0, or a negative errno /
 * RUMOR_ETOOBIG with a message. */
int file_read_all(const char *path, size_t max_len, uint8_t **out, size_t *out_len,
                  struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- stop signals ------------------------------------------------------------------
 * SIGINT, SIGTERM and SIGHUP are never delivered to a computing thread: a
 * handler running on the thread that executes oneDNN's JIT GEMM corrupted the
 * heap (the kernel's signal frame landed on memory the kernel was using; 14
 * of 30 `rumor train` runs killed by SIGTERM mid-step aborted). Instead,
 * signals_init() blocks them in the calling thread (call it first in main,
 * before any thread exists, so that every later thread inherits the mask)
 * and starts a small thread that waits for them with sigwait. It also
 * ignores SIGPIPE (a closed socket is an error code, not a death). */
int signals_init(void) RUMOR_MUST_CHECK;
/* The first stop signal received (SIGINT, SIGTERM, SIGHUP), or 0. Any thread. */
int signals_stop_requested(void);
/* Address of the flag, for APIs that poll a `const atomic_int *`. */
const atomic_int *signals_stop_flag(void);

/* ---- half precision ---------------------------------------------------------------
 * IEEE binary16 and bfloat16 conversion for storage and the wire.
 * Round-to-nearest-even; NaN stays NaN (quiet), overflow becomes ±Inf. */
uint16_t half_from_f32(float f);
float half_to_f32(uint16_t h);
uint16_t bf16_from_f32(float f);
float bf16_to_f32(uint16_t h);
/* Bulk forms over n elements. */
void half_from_f32_n(uint16_t *dst, const float *src, size_t n);
void half_to_f32_n(float *dst, const uint16_t *src, size_t n);
void bf16_from_f32_n(uint16_t *dst, const float *src, size_t n);
void bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);

#endif /* RUMOR_UTIL_H */
