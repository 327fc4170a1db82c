/*
 * cuBLAS, loaded at run time (private to tensor/: tensor_cuda.c and the
 * tests). A CUDA build does not link libcublas, so it starts on hosts that
 * have no CUDA libraries, or only the driver, and trains on the CPU there.
 *
 * The entries are cuBLAS's own functions, with their own types (taken from
 * cublas_v2.h with __typeof__, so a signature cannot drift from the header
 * the build used); call them through tensor_cublas()->sgemm(...) and so on.
 */
#ifndef RUMOR_TENSOR_CUBLAS_H
#define RUMOR_TENSOR_CUBLAS_H

#include <cublas_v2.h>

#include "util/util.h" /* struct rumor_err */

/* The library tensor_cublas_load opens unless RUMOR_CUBLAS_LIB names
 * another (a path or a soname; tests name one that does not exist to check
 * the CPU fallback). The major version is the one the build compiled
 * against: cuBLAS changes its ABI between majors. */
#define TENSOR_CUBLAS_LIB_ENV "RUMOR_CUBLAS_LIB"

struct tensor_cublas {
  __typeof__(&cublasCreate) create;
  __typeof__(&cublasDestroy) destroy;
  __typeof__(&cublasSetStream) set_stream;
  __typeof__(&cublasSetMathMode) set_math_mode;
  __typeof__(&cublasSgemm) sgemm;
  __typeof__(&cublasSgemmStridedBatched) sgemm_strided_batched;
  __typeof__(&cublasGetStatusName) status_name;
  __typeof__(&cublasGetStatusString) status_string;
};

/* Opens cuBLAS and resolves every entry, once per process (thread-safe; the
 * outcome, success or failure, is kept, and the library stays loaded until
 * exit). Returns 0, or RUMOR_EDEVICE with a message naming the library and
 * dlopen's or dlsym's reason. */
int tensor_cublas_load(struct rumor_err *e);

/* The table; only after tensor_cublas_load returned 0. */
const struct tensor_cublas *tensor_cublas(void);

/* The library name or path tensor_cublas_load opens (the environment's
 * override, or libcublas.so.<major of the build>). */
const char *tensor_cublas_lib_name(void);

#endif /* RUMOR_TENSOR_CUBLAS_H */
