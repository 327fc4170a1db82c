/*
 * bootstrap — the bootstrap node: a long-lived cluster member without a
 * model that newcomers dial first. It takes part in membership (probes,
 * suspicion, LEAVE) and answers JOIN with the member table, but never
 * exchanges parameters or donates a state. Any running peer's address also
 * works as a bootstrap address; this node just never goes away.
 */
#ifndef RUMOR_BOOTSTRAP_H
#define RUMOR_BOOTSTRAP_H

#include "gossip/gossip.h"

/* Runs a bootstrap node until *stop becomes non-zero, then leaves the
 * cluster gracefully (LEAVE, waiting up to `linger_ms`). `cfg` is a gossip
 * configuration whose role is forced to GOSSIP_ROLE_BOOTSTRAP. `on_ready`
 * (may be NULL) is called once listening, with the advertised address.
 * Returns 0, or a negative code with a message when it cannot start. */
int bootstrap_run(const struct gossip_config *cfg, const atomic_int *stop, uint32_t linger_ms,
                  void (*on_ready)(gossip_t *g, void *arg), void *arg, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_BOOTSTRAP_H */
