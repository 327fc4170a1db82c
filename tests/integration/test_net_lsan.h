/*
 * Criterion 2.4.1's runner leaks a few bytes of its own bookkeeping when it
 * runs tests in parallel (seen as "Direct leak of 96 byte(s) ... from
 * libcriterion.so"). LeakSanitizer reads this hook at start-up; the
 * suppression names only Criterion's shared object, so leaks in rumor's code
 * are still reported. Include from exactly one file per test binary.
 */
#ifndef RUMOR_TEST_NET_LSAN_H
#define RUMOR_TEST_NET_LSAN_H

const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libcriterion.so\n"; }

#endif /* RUMOR_TEST_NET_LSAN_H */
