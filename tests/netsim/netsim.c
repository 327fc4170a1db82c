/*
 * netsim — a user-space Ethernet switch with per-link delay, loss, rate and
 * cuts, for test hosts (deploy/testnet.sh) on kernels without sch_netem.
 *
 * It runs in the switch's network namespace and owns N veth ends there
 * (vh1 .. vhN, the other ends are eth0 in each host's namespace). Frames are
 * read with AF_PACKET and written to the destination port, learning source
 * MACs and flooding broadcast and unknown destinations. Each port's frames
 * (what its host sends) pass through that port's impairments, the same place
 * as `tc qdisc ... netem` on the host's eth0:
 *
 *   loss    each frame is dropped with probability `loss`;
 *   rate    frames leave one after another at `rate` bit/s (a FIFO with a
 *           byte limit, tail drop beyond it);
 *   delay   then each is held `delay` ms before delivery (order kept);
 *   cut     every frame from or to the port is dropped (the host is cut off;
 *           its carrier stays up, like a partition in the network beyond).
 *
 * Offloads: the host side's veth hands over TCP segments of up to 64 KiB
 * (GSO) with checksums left to the hardware. PACKET_VNET_HDR passes the
 * virtio-net header with each frame, and writing it back on the other port
 * lets the kernel finish both: no frame is resegmented or checksummed here.
 * A lost GSO frame loses all of its segments, as with netem on a veth.
 *
 * Control: lines written to the FIFO DIR/ctl, one command a line:
 *   set PORT DELAY_MS LOSS_PERCENT RATE_MBIT CUT(0|1) SEQ
 *   quit
 * after each line it writes SEQ to DIR/applied (so the script knows the
 * change is in force). Counters per port go to DIR/stats every 500 ms.
 *
 *   netsim DIR N [SEED]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NETSIM_MAX_PORTS 64
#define NETSIM_FRAME_MAX (256 * 1024)       /* vnet header + a GSO frame */
#define NETSIM_QUEUE_BYTES (8u << 20)        /* per port, rate limiter FIFO */
#define NETSIM_MACS 256

struct frame {
  struct frame *next;
  uint64_t deliver_ns;
  int src;
  size_t len; /* bytes in data, vnet header included */
  uint8_t data[];
};

struct port {
  int fd;
  char name[IFNAMSIZ];
  /* Impairments (what the port's host sends). */
  uint64_t delay_ns;
  double loss;     /* probability */
  double rate_bps; /* 0: unlimited */
  bool cut;
  /* State. */
  uint64_t busy_until_ns; /* rate limiter: when the last frame has left */
  uint64_t last_deliver_ns;
  size_t queued_bytes;
  struct frame *head, *tail; /* frames waiting, in delivery order */
  /* Counters. */
  uint64_t rx, tx, lost, cut_drops, queue_drops, send_errors;
};

static struct port ports[NETSIM_MAX_PORTS];
static int nports;
static struct {
  uint8_t mac[6];
  int port;
} macs[NETSIM_MACS];
static int nmacs;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* xorshift64*: reproducible loss for a given seed. */
static double uniform(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}

static void die(const char *what) {
  fprintf(stderr, "netsim: %s: %s\n", what, strerror(errno));
  exit(1);
}

static int open_port(const char *ifname) {
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) die("socket(AF_PACKET)");
  int one = 1;
  if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0) die("PACKET_VNET_HDR");
  if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0) die("PACKET_IGNORE_OUTGOING");
  int idx = (int)if_nametoindex(ifname);
  if (!idx) die(ifname);
  struct sockaddr_ll sll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL), .sll_ifindex = idx};
  if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0) die("bind");
  struct packet_mreq mr = {.mr_ifindex = idx, .mr_type = PACKET_MR_PROMISC};
  if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) < 0) die("PACKET_MR_PROMISC");
  int buf = 4 << 20;
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  return fd;
}

static void learn(const uint8_t *mac, int port) {
  if (mac[0] & 1) return; /* a multicast source is bogus */
  for (int i = 0; i < nmacs; i++)
    if (memcmp(macs[i].mac, mac, 6) == 0) {
      macs[i].port = port;
      return;
    }
  if (nmacs < NETSIM_MACS) {
    memcpy(macs[nmacs].mac, mac, 6);
    macs[nmacs++].port = port;
  }
}

static int lookup(const uint8_t *mac) {
  if (mac[0] & 1) return -1; /* broadcast / multicast: flood */
  for (int i = 0; i < nmacs; i++)
    if (memcmp(macs[i].mac, mac, 6) == 0) return macs[i].port;
  return -1;
}

static void send_to(int dst, const struct frame *f) {
  struct port *p = &ports[dst];
  if (p->cut) {
    p->cut_drops++;
    return;
  }
  ssize_t w = send(p->fd, f->data, f->len, MSG_DONTWAIT);
  if (w < 0) p->send_errors++;
  else p->tx++;
}

static void deliver(struct frame *f) {
  const uint8_t *eth = f->data + sizeof(struct virtio_net_hdr);
  int dst = lookup(eth);
  if (dst >= 0) {
    if (dst != f->src) send_to(dst, f);
    return;
  }
  for (int i = 0; i < nports; i++)
    if (i != f->src) send_to(i, f);
}

/* A frame arrived from port i's host: impair it and queue it. */
static void on_frame(int i, const uint8_t *buf, size_t len, uint64_t now) {
  struct port *p = &ports[i];
  p->rx++;
  if (len < sizeof(struct virtio_net_hdr) + 14) return;
  learn(buf + sizeof(struct virtio_net_hdr) + 6, i);
  if (p->cut) {
    p->cut_drops++;
    return;
  }
  if (p->loss > 0 && uniform() < p->loss) {
    p->lost++;
    return;
  }
  if (p->queued_bytes + len > NETSIM_QUEUE_BYTES) {
    p->queue_drops++;
    return;
  }
  uint64_t leave = now;
  if (p->rate_bps > 0) {
    size_t wire = len - sizeof(struct virtio_net_hdr);
    uint64_t start = p->busy_until_ns > now ? p->busy_until_ns : now;
    leave = start + (uint64_t)((double)wire * 8.0 / p->rate_bps * 1e9);
    p->busy_until_ns = leave;
  }
  uint64_t at = leave + p->delay_ns;
  if (at < p->last_deliver_ns) at = p->last_deliver_ns; /* never reorder one host's frames */
  p->last_deliver_ns = at;
  struct frame *f = malloc(sizeof *f + len);
  if (!f) {
    p->queue_drops++;
    return;
  }
  f->next = NULL;
  f->deliver_ns = at;
  f->src = i;
  f->len = len;
  memcpy(f->data, buf, len);
  if (p->tail) p->tail->next = f;
  else p->head = f;
  p->tail = f;
  p->queued_bytes += len;
}

/* Delivers every frame due by `now`; returns the next due time (or 0). */
static uint64_t flush(uint64_t now) {
  uint64_t next = 0;
  for (int i = 0; i < nports; i++) {
    struct port *p = &ports[i];
    while (p->head && p->head->deliver_ns <= now) {
      struct frame *f = p->head;
      p->head = f->next;
      if (!p->head) p->tail = NULL;
      p->queued_bytes -= f->len;
      deliver(f);
      free(f);
    }
    if (p->head && (!next || p->head->deliver_ns < next)) next = p->head->deliver_ns;
  }
  return next;
}

static void write_file(const char *dir, const char *name, const char *text) {
  char path[512], tmp[520];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  fputs(text, f);
  fclose(f);
  rename(tmp, path);
}

static void write_stats(const char *dir) {
  char text[NETSIM_MAX_PORTS * 200 + 200];
  size_t n = (size_t)snprintf(text, sizeof text, "# port rx tx lost cut_drops queue_drops send_errors\n");
  for (int i = 0; i < nports && n < sizeof text; i++) {
    struct port *p = &ports[i];
    n += (size_t)snprintf(text + n, sizeof text - n, "%s %llu %llu %llu %llu %llu %llu\n", p->name,
                          (unsigned long long)p->rx, (unsigned long long)p->tx, (unsigned long long)p->lost,
                          (unsigned long long)p->cut_drops, (unsigned long long)p->queue_drops,
                          (unsigned long long)p->send_errors);
  }
  write_file(dir, "stats", text);
}

/* Applies one control line; returns false on "quit". */
static bool control(const char *dir, const char *line) {
  int port, cut;
  double delay_ms, loss_pct, rate_mbit;
  unsigned long long seq;
  if (strncmp(line, "quit", 4) == 0) return false;
  if (sscanf(line, "set %d %lf %lf %lf %d %llu", &port, &delay_ms, &loss_pct, &rate_mbit, &cut, &seq) == 6 &&
      port >= 1 && port <= nports && delay_ms >= 0 && loss_pct >= 0 && loss_pct <= 100 && rate_mbit >= 0) {
    struct port *p = &ports[port - 1];
    p->delay_ns = (uint64_t)(delay_ms * 1e6);
    p->loss = loss_pct / 100.0;
    p->rate_bps = rate_mbit * 1e6;
    p->cut = cut != 0;
    char s[32];
    snprintf(s, sizeof s, "%llu\n", seq);
    write_file(dir, "applied", s);
  } else {
    fprintf(stderr, "netsim: ignoring control line '%s'\n", line);
  }
  return true;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: netsim DIR NPORTS [SEED]\n");
    return 2;
  }
  const char *dir = argv[1];
  nports = atoi(argv[2]);
  if (nports < 1 || nports > NETSIM_MAX_PORTS) {
    fprintf(stderr, "netsim: 1 to %d ports\n", NETSIM_MAX_PORTS);
    return 2;
  }
  if (argc > 3) rng_state ^= strtoull(argv[3], NULL, 0) * 0x2545f4914f6cdd1dull;
  for (int i = 0; i < nports; i++) {
    snprintf(ports[i].name, sizeof ports[i].name, "vh%d", i + 1);
    ports[i].fd = open_port(ports[i].name);
  }
  char ctl[512];
  snprintf(ctl, sizeof ctl, "%s/ctl", dir);
  /* Read-write, so that the FIFO never reports end-of-file when a writer
   * closes it. */
  int cfd = open(ctl, O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (cfd < 0) die(ctl);
  write_file(dir, "applied", "0\n");
  write_file(dir, "ready", "1\n");

  static uint8_t buf[NETSIM_FRAME_MAX];
  char line[1024];
  size_t line_len = 0;
  uint64_t next_stats = now_ns();
  struct pollfd pfd[NETSIM_MAX_PORTS + 1];
  for (;;) {
    uint64_t now = now_ns();
    uint64_t due = flush(now);
    if (now >= next_stats) {
      write_stats(dir);
      next_stats = now + 500000000ull;
    }
    uint64_t wake = due && due < next_stats ? due : next_stats;
    int timeout = wake > now ? (int)((wake - now + 999999) / 1000000) : 0;
    for (int i = 0; i < nports; i++) pfd[i] = (struct pollfd){.fd = ports[i].fd, .events = POLLIN};
    pfd[nports] = (struct pollfd){.fd = cfd, .events = POLLIN};
    int r = poll(pfd, (nfds_t)nports + 1, timeout);
    if (r < 0) {
      if (errno == EINTR) continue;
      die("poll");
    }
    now = now_ns();
    for (int i = 0; i < nports; i++) {
      if (!(pfd[i].revents & POLLIN)) continue;
      /* A bounded batch per port per round keeps the ports fair. */
      for (int k = 0; k < 64; k++) {
        ssize_t got = recv(ports[i].fd, buf, sizeof buf, MSG_DONTWAIT | MSG_TRUNC);
        if (got < 0) break;
        if ((size_t)got > sizeof buf) continue; /* truncated: cannot forward it */
        on_frame(i, buf, (size_t)got, now);
      }
    }
    if (pfd[nports].revents & POLLIN) {
      ssize_t got;
      while ((got = read(cfd, line + line_len, sizeof line - 1 - line_len)) > 0) {
        line_len += (size_t)got;
        line[line_len] = '\0';
        char *nl;
        while ((nl = strchr(line, '\n'))) {
          *nl = '\0';
          if (!control(dir, line)) {
            write_stats(dir);
            return 0;
          }
          size_t rest = line_len - (size_t)(nl + 1 - line);
          memmove(line, nl + 1, rest);
          line_len = rest;
          line[line_len] = '\0';
        }
        if (line_len == sizeof line - 1) line_len = 0; /* an overlong line: drop it */
      }
    }
  }
}
