/* cuBLAS is opened at run time (tensor/tensor_cublas.h): where the CUDA
 * build's library is installed, every entry rumor calls must resolve in
 * it. This needs no GPU: a missing or renamed symbol (cublasSgemm is
 * cublasSgemm_v2 in the library, a macro in the header) would otherwise be
 * found only on the first GPU machine. */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <stdlib.h>

#ifdef RUMOR_HAVE_CUDA
#include "tensor/tensor_cublas.h"

Test(cublas, every_entry_resolves_where_the_library_is_installed) {
  unsetenv(TENSOR_CUBLAS_LIB_ENV);
  void *h = dlopen(tensor_cublas_lib_name(), RTLD_NOW | RTLD_LOCAL);
  if (!h) cr_skip_test("%s is not installed here: nothing to resolve", tensor_cublas_lib_name());
  dlclose(h);
  struct rumor_err e = {0};
  cr_assert_eq(tensor_cublas_load(&e), 0, "%s", e.msg);
  const struct tensor_cublas *b = tensor_cublas();
  cr_assert(b->create && b->destroy && b->set_stream && b->set_math_mode && b->sgemm && b->sgemm_strided_batched &&
            b->status_name && b->status_string);
  cr_assert_str_eq(b->status_name(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
}
#else
Test(cublas, every_entry_resolves_where_the_library_is_installed) {
  cr_skip_test("a CPU-only build: it opens no cuBLAS");
}
#endif
