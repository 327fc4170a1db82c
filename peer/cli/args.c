/* Declarative long-option parsing. */
#include "peer/cli/cli_impl.h"

#include <stdio.h>
#include <string.h>

#include "util/util.h"

#define ARGS_MAX_SPECS 128

/* Which specs were seen in the last parse, keyed by the specs array. One
 * command line is parsed per process, from the main thread. */
static const struct arg_spec *g_last_specs;
static bool g_given[ARGS_MAX_SPECS];

static void print_default(const struct arg_spec *s) {
  switch (s->type) {
  case ARG_STR: {
    const char *v = *(const char **)s->dest;
    if (v && *v) printf(" (default: %s)", v);
    break;
  }
  case ARG_INT: printf(" (default: %lld)", (long long)*(int64_t *)s->dest); break;
  case ARG_FLOAT: printf(" (default: %g)", *(double *)s->dest); break;
  case ARG_FLAG: break;
  }
}

static void print_help(const struct arg_spec *specs, const char *synopsis, const char *about) {
  printf("usage: %s\n\n", synopsis);
  if (about && *about) printf("%s\n\n", about);
  printf("options:\n");
  for (const struct arg_spec *s = specs; s->name; s++) {
    char left[64];
    if (s->type == ARG_FLAG) snprintf(left, sizeof left, "--%s", s->name);
    else snprintf(left, sizeof left, "--%s %s", s->name, s->metavar ? s->metavar : "VALUE");
    printf("  %-28s %s", left, s->help);
    print_default(s);
    printf("\n");
  }
  printf("  %-28s %s\n", "--help", "show this help and exit");
}

static int set_value(const struct arg_spec *s, const char *cmd, const char *val) {
  bool bounded = !(s->min == 0 && s->max == 0);
  switch (s->type) {
  case ARG_STR:
    if (!*val) {
      fprintf(stderr, "rumor %s: --%s needs a non-empty value\n", cmd, s->name);
      return ARGS_ERROR;
    }
    *(const char **)s->dest = val;
    return ARGS_OK;
  case ARG_INT: {
    int64_t v;
    if (parse_i64(val, bounded ? (int64_t)s->min : INT64_MIN, bounded ? (int64_t)s->max : INT64_MAX, &v)) {
      if (bounded)
        fprintf(stderr, "rumor %s: --%s: '%s' is not an integer in [%lld, %lld]\n", cmd, s->name, val,
                (long long)s->min, (long long)s->max);
      else
        fprintf(stderr, "rumor %s: --%s: '%s' is not an integer\n", cmd, s->name, val);
      return ARGS_ERROR;
    }
    *(int64_t *)s->dest = v;
    return ARGS_OK;
  }
  case ARG_FLOAT: {
    double v;
    if (parse_f64(val, bounded ? s->min : -1e308, bounded ? s->max : 1e308, &v)) {
      if (bounded)
        fprintf(stderr, "rumor %s: --%s: '%s' is not a number in [%g, %g]\n", cmd, s->name, val, s->min, s->max);
      else
        fprintf(stderr, "rumor %s: --%s: '%s' is not a number\n", cmd, s->name, val);
      return ARGS_ERROR;
    }
    *(double *)s->dest = v;
    return ARGS_OK;
  }
  case ARG_FLAG: break;
  }
  return ARGS_ERROR;
}

int args_parse(const struct arg_spec *specs, int argc, char **argv, const char *synopsis,
               const char *about) {
  const char *cmd = argc > 0 ? argv[0] : "(command)";
  size_t nspecs = 0;
  while (specs[nspecs].name) nspecs++;
  RUMOR_ASSERT(nspecs <= ARGS_MAX_SPECS);
  g_last_specs = specs;
  memset(g_given, 0, sizeof g_given);

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      print_help(specs, synopsis, about);
      return ARGS_HELP;
    }
    if (!STR_PREFIX(a, "--")) {
      fprintf(stderr, "rumor %s: unexpected argument '%s' (options start with --; see --help)\n", cmd, a);
      return ARGS_ERROR;
    }
    const char *name = a + STR_LEN("--");
    const char *eq = strchr(name, '=');
    size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
    const struct arg_spec *s = NULL;
    size_t idx = 0;
    for (; idx < nspecs; idx++)
      if (strlen(specs[idx].name) == nlen && strncmp(specs[idx].name, name, nlen) == 0) {
        s = &specs[idx];
        break;
      }
    if (!s) {
      fprintf(stderr, "rumor %s: unknown option '--%.*s' (see --help)\n", cmd, (int)nlen, name);
      return ARGS_ERROR;
    }
    g_given[idx] = true;
    if (s->type == ARG_FLAG) {
      if (eq) {
        fprintf(stderr, "rumor %s: --%s takes no value\n", cmd, s->name);
        return ARGS_ERROR;
      }
      *(bool *)s->dest = true;
      continue;
    }
    const char *val;
    if (eq) {
      val = eq + 1;
    } else {
      if (i + 1 >= argc) {
        fprintf(stderr, "rumor %s: --%s needs a value (%s)\n", cmd, s->name, s->metavar ? s->metavar : "VALUE");
        return ARGS_ERROR;
      }
      val = argv[++i];
    }
    int rc = set_value(s, cmd, val);
    if (rc != ARGS_OK) return rc;
  }
  return ARGS_OK;
}

bool args_given(const struct arg_spec *specs, const char *name) {
  if (specs != g_last_specs) return false;
  for (size_t i = 0; specs[i].name; i++)
    if (strcmp(specs[i].name, name) == 0) return g_given[i];
  return false;
}

void args_append(struct arg_spec *out, size_t *n, size_t max, const struct arg_spec *specs, size_t count) {
  for (size_t i = 0; i < count; i++) {
    RUMOR_ASSERT(*n < max);
    out[(*n)++] = specs[i];
  }
}

void args_log_json_spec(bool *log_json, struct arg_spec *out, size_t *n, size_t max) {
  RUMOR_ASSERT(*n < max);
  out[(*n)++] = (struct arg_spec){"log-json", ARG_FLAG, log_json, NULL, "log one JSON object per line"};
}
