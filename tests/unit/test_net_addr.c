/*
 * Address text (net_addr_*): the forms a listener takes and those a dialer
 * takes, host names kept as they are, and every refusal quoting the input
 * with what is wrong (a port out of [1, 65535], no host, an empty list
 * entry) — the checks every address flag goes through before a command
 * starts.
 */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <string.h>

#include "net/net.h"
#include "../integration/test_net_lsan.h"

Test(addr, parse_splits_the_forms_and_keeps_names) {
  const struct {
    const char *in, *host;
    int min, port;
  } ok[] = {
      {"127.0.0.1:7470", "127.0.0.1", 1, 7470},
      {"[::1]:9", "::1", 1, 9},
      {"rumor-bootstrap.default.svc.cluster.local:7470", "rumor-bootstrap.default.svc.cluster.local", 1, 7470},
      {"node-3:65535", "node-3", 1, 65535},
      {":7470", "", 0, 7470},
      {"0.0.0.0:0", "0.0.0.0", 0, 0},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    char host[NET_HOST_MAX];
    int port = -1;
    struct rumor_err e = {0};
    cr_assert_eq(net_addr_parse(ok[i].in, ok[i].min, host, sizeof host, &port, &e), 0, "%s: %s", ok[i].in, e.msg);
    cr_assert_str_eq(host, ok[i].host, "%s", ok[i].in);
    cr_assert_eq(port, ok[i].port, "%s", ok[i].in);
  }
}

/* Each refusal quotes the whole input and says what is wrong with it. */
Test(addr, dial_addresses_need_a_host_and_a_port_in_1_to_65535) {
  const struct {
    const char *in, *says;
  } bad[] = {
      {"127.0.0.1:99999", "port must be in [1, 65535]"},
      {"127.0.0.1:0", "port must be in [1, 65535]"},
      {"127.0.0.1:-1", "port must be in [1, 65535]"},
      {"127.0.0.1:http", "port must be a number in [1, 65535]"},
      {"127.0.0.1:", "port must be a number"},
      {"127.0.0.1", "expected host:port"},
      {":7470", "the host is missing"},
      {"::1:7470", "write IPv6 addresses as [address]:port"},
      {"[::1]7470", "expected [address]:port"},
      {"my host:7470", "space or a control character"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct rumor_err e = {0};
    cr_assert_eq(net_addr_check_dial(bad[i].in, &e), RUMOR_EFORMAT, "'%s' was accepted", bad[i].in);
    char quoted[96];
    snprintf(quoted, sizeof quoted, "'%s'", bad[i].in);
    cr_assert(strstr(e.msg, quoted) && strstr(e.msg, bad[i].says), "%s: %s", bad[i].in, e.msg);
  }
  struct rumor_err e = {0};
  cr_assert_eq(net_addr_check_dial("peer-7.example:1", &e), 0, "%s", e.msg);
  cr_assert_eq(net_addr_check_dial("[fe80::1]:65535", &e), 0, "%s", e.msg);
}

Test(addr, lists_refuse_empty_entries_and_name_the_bad_one) {
  struct rumor_err e = {0};
  cr_assert_eq(net_addr_list_check("a:1,b.example:2,[::1]:3", &e), 0, "%s", e.msg);
  cr_assert_eq(net_addr_list_check("127.0.0.1:7470", &e), 0, "%s", e.msg);
  const struct {
    const char *in, *says;
  } bad[] = {
      {",", "',' has an empty entry"},
      {"a:1,,b:2", "'a:1,,b:2' has an empty entry"},
      {"a:1,", "'a:1,' has an empty entry"},
      {"", "no address"},
      {"a:1,127.0.0.1:99999,b:2", "'127.0.0.1:99999': port must be in [1, 65535]"},
      {"a:1;b:2", "write IPv6 addresses as [address]:port"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_eq(net_addr_list_check(bad[i].in, &e), RUMOR_EFORMAT, "'%s' was accepted", bad[i].in);
    cr_assert(strstr(e.msg, bad[i].says), "%s: %s", bad[i].in, e.msg);
  }
}

/* A listener's address resolves on the caller's loop; ":port" is every
 * IPv4 address. */
Test(addr, lists_split_into_rows_and_refuse_too_many_or_too_long) {
  struct rumor_err e = {0};
  char out[3][16];
  size_t n = 99;
  cr_assert_eq(net_addr_list_split("a:1,[::1]:2,b.example:3", &out[0][0], 16, 3, &n, &e), 0, "%s", e.msg);
  cr_assert_eq(n, 3);
  cr_assert_str_eq(out[0], "a:1");
  cr_assert_str_eq(out[1], "[::1]:2");
  cr_assert_str_eq(out[2], "b.example:3");
  cr_assert_eq(net_addr_list_split("a:1,b:2,c:3,d:4", &out[0][0], 16, 3, &n, &e), RUMOR_EFORMAT);
  cr_assert_str_eq(e.msg, "more than 3 addresses");
  cr_assert_eq(net_addr_list_split("a:1,averylonghostname:2", &out[0][0], 16, 3, &n, &e), RUMOR_EFORMAT);
  cr_assert_str_eq(e.msg, "'averylonghostname:2' is longer than 15 characters");
  cr_assert_eq(net_addr_list_split("a:1,,b:2", &out[0][0], 16, 3, &n, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "has an empty entry"), "%s", e.msg);
}

Test(addr, listen_addresses_resolve_and_a_bad_one_is_named) {
  uv_loop_t loop;
  cr_assert_eq(uv_loop_init(&loop), 0);
  struct sockaddr_storage ss;
  struct rumor_err e = {0};
  cr_assert_eq(net_addr_resolve(&loop, ":7470", &ss, &e), 0, "%s", e.msg);
  cr_assert_eq(ss.ss_family, AF_INET);
  const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
  cr_assert_eq(in->sin_addr.s_addr, htonl(INADDR_ANY));
  cr_assert_eq(ntohs(in->sin_port), 7470);
  cr_assert_eq(net_addr_resolve(&loop, "[::1]:0", &ss, &e), 0, "%s", e.msg);
  cr_assert_eq(ss.ss_family, AF_INET6);
  cr_assert_eq(net_addr_resolve(&loop, "127.0.0.1", &ss, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "'127.0.0.1': expected host:port"), "%s", e.msg);
  cr_assert_neq(net_addr_resolve(&loop, "nohost.invalid:1", &ss, &e), 0);
  cr_assert(strstr(e.msg, "cannot resolve the host name 'nohost.invalid'"), "%s", e.msg);
  cr_assert_eq(uv_loop_close(&loop), 0);
}
