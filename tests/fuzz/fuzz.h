/*
 * The entry point every harness defines (libFuzzer's), so the same file
 * builds for libFuzzer (RUMOR_FUZZ) and for the corpus replay test.
 */
#ifndef RUMOR_FUZZ_H
#define RUMOR_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif /* RUMOR_FUZZ_H */
