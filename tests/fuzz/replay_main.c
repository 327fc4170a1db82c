/*
 * Corpus replay: runs every file under the given directories (or the given
 * files) through a harness's LLVMFuzzerTestOneInput, once each, with the
 * ordinary compiler. A crash, a sanitizer report or a trap fails the test;
 * an empty corpus fails it too.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/fuzz/fuzz.h"

#define REPLAY_MAX_INPUT (1u << 20)

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return -1;
  }
  uint8_t *buf = malloc(REPLAY_MAX_INPUT);
  size_t n = fread(buf, 1, REPLAY_MAX_INPUT, f);
  fclose(f);
  LLVMFuzzerTestOneInput(buf, n);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  int files = 0, failed = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      failed += run_file(argv[i]) != 0;
      files++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    struct dirent *ent;
    while (d && (ent = readdir(d))) {
      if (ent->d_name[0] == '.') continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], ent->d_name);
      failed += run_file(path) != 0;
      files++;
    }
    if (d) closedir(d);
  }
  printf("replayed %d corpus files\n", files);
  return files == 0 || failed ? 1 : 0;
}
