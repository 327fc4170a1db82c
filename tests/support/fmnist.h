/*
 * fmnist.h — whether Debian's Fashion-MNIST is installed, and a skip with
 * the reason for tests that train on it. Header-only; include after
 * criterion.
 */
#ifndef RUMOR_TESTS_FMNIST_H
#define RUMOR_TESTS_FMNIST_H

#include <stdbool.h>
#include <sys/stat.h>

static inline bool have_fmnist(void) {
  struct stat st;
  return stat(RUMOR_FMNIST_DIR "/train-images-idx3-ubyte.gz", &st) == 0;
}

#define SKIP_WITHOUT_DATA()                                                                      \
  do {                                                                                           \
    if (!have_fmnist())                                                                          \
      cr_skip_test("Fashion-MNIST not installed at " RUMOR_FMNIST_DIR                            \
                   " (apt-get install dataset-fashion-mnist)");                                  \
  } while (0)

#endif /* RUMOR_TESTS_FMNIST_H */
