/* net_tcp_counters: TCP_INFO through <linux/tcp.h> (tcp_counters.h). */
#include <errno.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>

#include "net/tcp_counters.h"

int net_tcp_counters(int fd, uint64_t *data_segs_out, uint64_t *retrans_segs, uint32_t *rtt_us) {
  struct tcp_info ti;
  socklen_t len = sizeof ti;
  memset(&ti, 0, sizeof ti);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return -errno;
  if (len < offsetof(struct tcp_info, tcpi_data_segs_out) + sizeof ti.tcpi_data_segs_out) return -ENOTSUP;
  *data_segs_out = ti.tcpi_data_segs_out;
  *retrans_segs = ti.tcpi_total_retrans;
  *rtt_us = ti.tcpi_rtt;
  return 0;
}
