/* cuBLAS loaded at run time (tensor_cublas.h). */
#include "tensor/tensor_cublas.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define CUBLAS_STR_(x) #x
#define CUBLAS_STR(x) CUBLAS_STR_(x)

/* The soname of the cuBLAS major this build compiled against. */
#define CUBLAS_DEFAULT_LIB "libcublas.so." CUBLAS_STR(CUBLAS_VER_MAJOR)

/* Written once under g_once, read-only after it: the table, and the outcome
 * of the load (0, or the error with its message). */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct tensor_cublas g_blas;
static struct rumor_err g_load_err;

const char *tensor_cublas_lib_name(void) {
  const char *over = getenv(TENSOR_CUBLAS_LIB_ENV);
  return over && *over ? over : CUBLAS_DEFAULT_LIB;
}

/* Resolves `name` (after macro expansion: cublasSgemm is cublasSgemm_v2)
 * into `slot`; on failure records the error and jumps to `fail`. */
#define CUBLAS_SYM(slot, name)                                                                         \
  do {                                                                                                 \
    void *sym_ = dlsym(h, CUBLAS_STR(name));                                                           \
    if (!sym_) {                                                                                       \
      rumor_err_set(&g_load_err, RUMOR_EDEVICE, "cuBLAS (%s) lacks %s: %s", lib, CUBLAS_STR(name),     \
                    dlerror());                                                                        \
      goto fail;                                                                                       \
    }                                                                                                  \
    memcpy(&t.slot, &sym_, sizeof sym_); /* object pointer to function pointer, as POSIX allows */    \
  } while (0)

static void cublas_load_once(void) {
  const char *lib = tensor_cublas_lib_name();
  struct tensor_cublas t;
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    rumor_err_set(&g_load_err, RUMOR_EDEVICE, "cuBLAS cannot be loaded (%s): %s", lib, why ? why : "unknown");
    return;
  }
  CUBLAS_SYM(create, cublasCreate);
  CUBLAS_SYM(destroy, cublasDestroy);
  CUBLAS_SYM(set_stream, cublasSetStream);
  CUBLAS_SYM(set_math_mode, cublasSetMathMode);
  CUBLAS_SYM(sgemm, cublasSgemm);
  CUBLAS_SYM(sgemm_strided_batched, cublasSgemmStridedBatched);
  CUBLAS_SYM(status_name, cublasGetStatusName);
  CUBLAS_SYM(status_string, cublasGetStatusString);
  g_blas = t;
  g_load_err.code = 0;
  log_debug("cuda: loaded %s", lib);
  return;
fail:
  dlclose(h);
}

int tensor_cublas_load(struct rumor_err *e) {
  pthread_once(&g_once, cublas_load_once);
  if (g_load_err.code != 0) return rumor_err_set(e, g_load_err.code, "%s", g_load_err.msg);
  return 0;
}

const struct tensor_cublas *tensor_cublas(void) {
  RUMOR_ASSERT(g_load_err.code == 0 && g_blas.create != NULL);
  return &g_blas;
}
