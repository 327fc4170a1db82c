/* Stop signals received by one waiting thread; no thread runs a handler. */
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

/* Process-wide: there is one set of stop signals per process. Written by the
 * signal thread, read by any thread. */
static atomic_int g_stop;
static atomic_bool g_started;

static void fill_set(sigset_t *set) {
  sigemptyset(set);
  sigaddset(set, SIGINT);
  sigaddset(set, SIGTERM);
  sigaddset(set, SIGHUP);
}

static void *signal_thread(void *arg) {
  sigset_t set;
  fill_set(&set);
  for (;;) {
    int sig;
    if (sigwait(&set, &sig) != 0) continue;
    int none = 0;
    atomic_compare_exchange_strong(&g_stop, &none, sig); /* keep the first */
  }
  return NULL;
}

int signals_init(void) {
  if (atomic_exchange(&g_started, true)) return 0;
  signal(SIGPIPE, SIG_IGN);
  /* A write past RLIMIT_FSIZE (a full quota) must fail with EFBIG and an
   * error message, not kill the process. */
  signal(SIGXFSZ, SIG_IGN);
  sigset_t set;
  fill_set(&set);
  int rc = pthread_sigmask(SIG_BLOCK, &set, NULL);
  if (rc) return -rc;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  /* Default stack size: libraries with large static TLS (oneDNN, cuBLAS)
   * make small stacks fail with EINVAL. */
  rc = pthread_create(&t, &attr, signal_thread, NULL);
  pthread_attr_destroy(&attr);
  return rc ? -rc : 0;
}

int signals_stop_requested(void) { return atomic_load(&g_stop); }

const atomic_int *signals_stop_flag(void) { return &g_stop; }
