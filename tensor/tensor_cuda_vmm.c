/* Chunked device memory through the driver's virtual memory management
 * (tensor_cuda_vmm.h). The driver API is reached through libcuda.so.1's own
 * symbols (the runtime is linked statically and the driver loaded at run
 * time), on the primary context the runtime made current. */
#include "tensor/tensor_cuda_vmm.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- the driver's entry points, resolved once ---- */

static struct {
  CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*unreserve)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*attribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*error_name)(CUresult, const char **);
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static const char *drv_missing; /* the first symbol not found, or NULL */

#define DRV_SYM(slot, name)                                  \
  do {                                                       \
    void *s_ = dlsym(h, name);                               \
    if (!s_) {                                               \
      drv_missing = name;                                    \
      return;                                                \
    }                                                        \
    memcpy(&drv.slot, &s_, sizeof s_); /* as POSIX allows */ \
  } while (0)

static void drv_load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); /* kept open, as the runtime keeps it */
  if (!h) {
    drv_missing = "libcuda.so.1";
    return;
  }
  DRV_SYM(granularity, "cuMemGetAllocationGranularity");
  DRV_SYM(reserve, "cuMemAddressReserve");
  DRV_SYM(unreserve, "cuMemAddressFree");
  DRV_SYM(create, "cuMemCreate");
  DRV_SYM(release, "cuMemRelease");
  DRV_SYM(map, "cuMemMap");
  DRV_SYM(unmap, "cuMemUnmap");
  DRV_SYM(set_access, "cuMemSetAccess");
  DRV_SYM(attribute, "cuDeviceGetAttribute");
  DRV_SYM(error_name, "cuGetErrorName");
}

static const char *drv_error(CUresult r) {
  const char *s = NULL;
  if (drv.error_name && drv.error_name(r, &s) == CUDA_SUCCESS && s) return s;
  return "unknown driver error";
}

/* A driver call that must not fail once the set is open: a panic. */
#define DRV_CHECK(call)                                                                           \
  do {                                                                                            \
    CUresult r_ = (call);                                                                         \
    if (r_ != CUDA_SUCCESS) rumor_panic(__FILE__, __LINE__, "%s failed: %s", #call, drv_error(r_)); \
  } while (0)

/* ---- blocks ---- */

struct vmm_block {
  CUdeviceptr va;
  size_t nchunks;
  CUmemGenericAllocationHandle *h; /* per chunk; 0: given back (mapped to the zero chunk) */
  struct vmm_block *next;
};

struct cuda_vmm {
  int device;
  size_t chunk;
  CUmemAllocationProp prop;
  CUmemGenericAllocationHandle zero; /* the shared zeroed chunk */
  CUdeviceptr zero_va;               /* where it is mapped read-write, for its fill */
  struct vmm_block *blocks;
  size_t live; /* bytes of live chunks */
};

static CUmemAccessDesc access_of(const struct cuda_vmm *v, bool write) {
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location = v->prop.location;
  a.flags = write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  return a;
}

/* Maps `h` at va read-write (or, `write` false, read-only). */
static CUresult map_chunk(const struct cuda_vmm *v, CUdeviceptr va, CUmemGenericAllocationHandle h, bool write) {
  CUresult r = drv.map(va, v->chunk, 0, h, 0);
  if (r != CUDA_SUCCESS) return r;
  CUmemAccessDesc a = access_of(v, write);
  r = drv.set_access(va, v->chunk, &a, 1);
  if (r != CUDA_SUCCESS) (void)drv.unmap(va, v->chunk);
  return r;
}

struct cuda_vmm *cuda_vmm_open(int device, struct rumor_err *e) {
  pthread_once(&drv_once, drv_load);
  if (drv_missing) {
    rumor_err_set(e, RUMOR_EDEVICE, "the driver lacks %s", drv_missing);
    return NULL;
  }
  int supported = 0;
  CUresult r = drv.attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
  if (r != CUDA_SUCCESS || !supported) {
    rumor_err_set(e, RUMOR_EDEVICE, "device %d has no virtual memory management (%s)", device,
                  r != CUDA_SUCCESS ? drv_error(r) : "not supported");
    return NULL;
  }
  struct cuda_vmm *v = xcalloc(1, sizeof *v);
  v->device = device;
  v->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  v->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  v->prop.location.id = device;
  if ((r = drv.granularity(&v->chunk, &v->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS || v->chunk == 0) {
    rumor_err_set(e, RUMOR_EDEVICE, "cuMemGetAllocationGranularity: %s", drv_error(r));
    free(v);
    return NULL;
  }
  /* The zero chunk: filled once through a read-write mapping of its own. */
  bool made = false, reserved = false;
  if ((r = drv.create(&v->zero, v->chunk, &v->prop, 0)) == CUDA_SUCCESS) made = true;
  if (r == CUDA_SUCCESS && (r = drv.reserve(&v->zero_va, v->chunk, 0, 0, 0)) == CUDA_SUCCESS) reserved = true;
  if (r == CUDA_SUCCESS) r = map_chunk(v, v->zero_va, v->zero, true);
  if (r == CUDA_SUCCESS && cudaMemset((void *)(uintptr_t)v->zero_va, 0, v->chunk) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)drv.unmap(v->zero_va, v->chunk);
    r = CUDA_ERROR_UNKNOWN;
  }
  if (r != CUDA_SUCCESS) {
    rumor_err_set(e, RUMOR_EDEVICE, "the shared zero chunk of %zu bytes: %s", v->chunk, drv_error(r));
    if (reserved) (void)drv.unreserve(v->zero_va, v->chunk);
    if (made) (void)drv.release(v->zero);
    free(v);
    return NULL;
  }
  return v;
}

static struct vmm_block *block_of(struct cuda_vmm *v, const void *p, struct vmm_block ***link) {
  CUdeviceptr a = (CUdeviceptr)(uintptr_t)p;
  for (struct vmm_block **l = &v->blocks; *l; l = &(*l)->next) {
    struct vmm_block *b = *l;
    if (a >= b->va && a < b->va + b->nchunks * v->chunk) {
      if (link) *link = l;
      return b;
    }
  }
  return NULL;
}

/* Unmaps chunk i of b and releases its memory (the zero chunk's mapping,
 * when given back, is only unmapped). */
static void drop_chunk(struct cuda_vmm *v, struct vmm_block *b, size_t i) {
  DRV_CHECK(drv.unmap(b->va + i * v->chunk, v->chunk));
  if (b->h[i]) {
    DRV_CHECK(drv.release(b->h[i]));
    b->h[i] = 0;
    v->live -= v->chunk;
  }
}

static void block_free(struct cuda_vmm *v, struct vmm_block *b, size_t mapped) {
  for (size_t i = 0; i < mapped; i++) drop_chunk(v, b, i);
  DRV_CHECK(drv.unreserve(b->va, b->nchunks * v->chunk));
  free(b->h);
  free(b);
}

void *cuda_vmm_alloc(struct cuda_vmm *v, size_t bytes) {
  struct vmm_block *b = xcalloc(1, sizeof *b);
  b->nchunks = bytes ? (bytes + v->chunk - 1) / v->chunk : 1;
  b->h = xcalloc(b->nchunks, sizeof *b->h);
  if (drv.reserve(&b->va, b->nchunks * v->chunk, 0, 0, 0) != CUDA_SUCCESS) {
    free(b->h);
    free(b);
    return NULL;
  }
  for (size_t i = 0; i < b->nchunks; i++) {
    CUresult r = drv.create(&b->h[i], v->chunk, &v->prop, 0);
    if (r == CUDA_SUCCESS && (r = map_chunk(v, b->va + i * v->chunk, b->h[i], true)) != CUDA_SUCCESS)
      (void)drv.release(b->h[i]);
    if (r != CUDA_SUCCESS) {
      b->h[i] = 0;
      block_free(v, b, i);
      return NULL;
    }
    v->live += v->chunk;
  }
  b->next = v->blocks;
  v->blocks = b;
  return (void *)(uintptr_t)b->va;
}

bool cuda_vmm_free(struct cuda_vmm *v, void *p) {
  struct vmm_block **link = NULL, *b = v ? block_of(v, p, &link) : NULL;
  if (!b) return false;
  *link = b->next;
  block_free(v, b, b->nchunks);
  return true;
}

void cuda_vmm_discard(struct cuda_vmm *v, void *p, size_t bytes) {
  struct vmm_block *b = v ? block_of(v, p, NULL) : NULL;
  if (!b) return;
  size_t off = (size_t)((CUdeviceptr)(uintptr_t)p - b->va), end = off + bytes;
  if (end > b->nchunks * v->chunk) end = b->nchunks * v->chunk;
  for (size_t i = (off + v->chunk - 1) / v->chunk; (i + 1) * v->chunk <= end; i++) {
    if (!b->h[i]) continue;
    drop_chunk(v, b, i);
    DRV_CHECK(map_chunk(v, b->va + i * v->chunk, v->zero, false));
  }
}

int cuda_vmm_recommit(struct cuda_vmm *v, void *p, size_t bytes, void *stream, struct rumor_err *e) {
  struct vmm_block *b = v ? block_of(v, p, NULL) : NULL;
  if (!b || bytes == 0) return 0;
  size_t off = (size_t)((CUdeviceptr)(uintptr_t)p - b->va), end = off + bytes;
  if (end > b->nchunks * v->chunk) end = b->nchunks * v->chunk;
  for (size_t i = off / v->chunk; i * v->chunk < end; i++) {
    if (b->h[i]) continue;
    CUmemGenericAllocationHandle h;
    CUresult r = drv.create(&h, v->chunk, &v->prop, 0);
    if (r != CUDA_SUCCESS)
      return rumor_err_set(e, -ENOMEM, "cannot take back %zu bytes of device %d's memory (%s) with %zu bytes live",
                           v->chunk, v->device, drv_error(r), v->live);
    CUdeviceptr va = b->va + i * v->chunk;
    DRV_CHECK(drv.unmap(va, v->chunk)); /* the zero chunk's read-only mapping */
    DRV_CHECK(map_chunk(v, va, h, true));
    b->h[i] = h;
    v->live += v->chunk;
    cudaError_t ce = cudaMemsetAsync((void *)(uintptr_t)va, 0, v->chunk, (cudaStream_t)stream);
    if (ce != cudaSuccess) rumor_panic(__FILE__, __LINE__, "cudaMemsetAsync failed: %s", cudaGetErrorString(ce));
  }
  return 0;
}

size_t cuda_vmm_live_bytes(const struct cuda_vmm *v) { return v ? v->live : 0; }

size_t cuda_vmm_chunk_bytes(const struct cuda_vmm *v) { return v ? v->chunk : 0; }

void cuda_vmm_close(struct cuda_vmm *v) {
  if (!v) return;
  while (v->blocks) {
    struct vmm_block *b = v->blocks;
    v->blocks = b->next;
    block_free(v, b, b->nchunks);
  }
  (void)drv.unmap(v->zero_va, v->chunk);
  (void)drv.unreserve(v->zero_va, v->chunk);
  (void)drv.release(v->zero);
  free(v);
}
