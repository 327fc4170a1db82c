/*
 * args — declarative long-option parsing for the subcommands.
 *
 * A subcommand lists its options in an array of struct arg_spec ending with
 * a zero entry. args_parse accepts "--name value" and "--name=value", checks
 * types and ranges, and prints either the generated --help or one clear
 * error naming the option and the bad value.
 */
#ifndef RUMOR_PEER_ARGS_H
#define RUMOR_PEER_ARGS_H

#include <stdbool.h>
#include <stdint.h>

enum arg_type {
  ARG_FLAG,  /* bool *: set to true when present */
  ARG_STR,   /* const char **: points into argv */
  ARG_INT,   /* int64_t *, checked against [min, max] */
  ARG_FLOAT, /* double *, checked against [min, max] */
};

struct arg_spec {
  const char *name; /* without the leading "--" */
  enum arg_type type;
  void *dest;
  const char *metavar; /* shown in --help, e.g. "N" or "FILE" */
  const char *help;    /* one line; the default is appended when known */
  double min, max;     /* for ARG_INT / ARG_FLOAT; both 0 means unbounded */
};

enum { ARGS_OK = 0, ARGS_HELP = 1, ARGS_ERROR = 2 };

/* Parses argv[1..argc) (argv[0] is the subcommand name). `synopsis` is the
 * first line of --help ("rumor train [options]") and `about` a paragraph
 * under it. Returns ARGS_OK, ARGS_HELP (help printed on stdout) or ARGS_ERROR
 * (message printed on stderr). Defaults are whatever `dest` holds before. */
int args_parse(const struct arg_spec *specs, int argc, char **argv, const char *synopsis,
               const char *about);

/* True when the option was given on the command line in the last args_parse
 * call with these specs (for options whose presence matters). */
bool args_given(const struct arg_spec *specs, const char *name);

#endif /* RUMOR_PEER_ARGS_H */
