/*
 * tensor_cuda_vmm.h — device memory that gives whole chunks of itself back
 * and takes them again (tensor_discard and tensor_recommit on CUDA), through
 * the driver's virtual memory management. Private to the CUDA backend.
 *
 * A block is a reserved address range cut into chunks (the device's
 * allocation granularity, 2 MiB on current GPUs). A chunk is either live,
 * mapped read-write to physical memory of its own, or given back: mapped
 * read-only to one zeroed chunk that the whole set shares. A given-back
 * chunk reads as zeros, as a discarded page does on the CPU, and costs no
 * device memory; a write to it faults (the kernel fails with an illegal
 * address), so a writer that forgot tensor_recommit stops loudly instead of
 * corrupting another chunk.
 *
 * Threads: a set belongs to its backend, used from one thread at a time
 * with the backend's device current (the backend's rule). The driver's
 * entry points are resolved once per process.
 */
#ifndef RUMOR_TENSOR_CUDA_VMM_H
#define RUMOR_TENSOR_CUDA_VMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

struct cuda_vmm;

/* A set for `device`, or NULL with the reason in `e` where the driver or
 * the device has no virtual memory management (then the backend allocates
 * with cudaMalloc and gives nothing back). */
struct cuda_vmm *cuda_vmm_open(int device, struct rumor_err *e);
/* Frees the shared chunk and every block still allocated. NULL is fine. */
void cuda_vmm_close(struct cuda_vmm *v);

/* A block of at least `bytes`, every chunk live; NULL when the device has
 * no room (nothing is left allocated). */
void *cuda_vmm_alloc(struct cuda_vmm *v, size_t bytes);
/* Frees p's block and returns true, or returns false when p is no block of
 * this set. The caller has waited for the work that uses it. */
bool cuda_vmm_free(struct cuda_vmm *v, void *p);
/* Gives back the live chunks wholly inside [p, p + bytes) when p lies in a
 * block of this set; else does nothing. The caller has waited for the work
 * that uses them. A driver failure is a panic (the device state is unknown). */
void cuda_vmm_discard(struct cuda_vmm *v, void *p, size_t bytes);
/* Makes live again every given-back chunk that [p, p + bytes) touches,
 * zero-filled on `stream` (a cudaStream_t) before any later work on it.
 * Returns 0, or -ENOMEM with the reason in `e` when the device has no room
 * (the chunks taken so far stay live). Nothing when p is in no block. */
int cuda_vmm_recommit(struct cuda_vmm *v, void *p, size_t bytes, void *stream, struct rumor_err *e);
/* Bytes of physical memory the set's blocks hold now (live chunks). */
size_t cuda_vmm_live_bytes(const struct cuda_vmm *v);
/* The allocation granularity: the unit discard and recommit work in. */
size_t cuda_vmm_chunk_bytes(const struct cuda_vmm *v);

#endif
