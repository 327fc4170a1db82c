/* The kernel's TCP counters of a socket (tcp_counters.c): apart from the
 * rest of net/ because <linux/tcp.h>, which has them, cannot be included
 * beside <netinet/tcp.h> (which uv.h includes). */
#ifndef RUMOR_NET_TCP_COUNTERS_H
#define RUMOR_NET_TCP_COUNTERS_H

#include <stdint.h>

/* Segments with data sent (retransmissions included), of them
 * retransmissions, and the smoothed round-trip time in µs, of TCP socket
 * `fd`. Returns 0, -errno, or -ENOTSUP on a kernel before 4.6 (no
 * tcpi_data_segs_out). */
int net_tcp_counters(int fd, uint64_t *data_segs_out, uint64_t *retrans_segs, uint32_t *rtt_us);

#endif
