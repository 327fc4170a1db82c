/*
 * drift — the consensus distance between replicas,
 *
 *   Ξ = sqrt((1/n) Σᵢ ‖θᵢ − θ̄‖²),  θ̄ = (1/n) Σᵢ θᵢ,
 *
 * computed exactly from full parameter vectors, or estimated from their
 * count-sketches (tensor_count_sketch with one cluster-wide seed and k
 * buckets). A count-sketch S is linear and preserves squared norms in
 * expectation (E‖S(v)‖² = ‖v‖², relative standard error about sqrt(2/k)
 * for one vector), so Ξ̂² = (1/n) Σᵢ ‖S(θᵢ) − mean S‖² estimates Ξ² from
 * k numbers per replica instead of P.
 *
 * The relative drift Ξ/‖θ̄‖ uses ‖θ̄‖² = (1/n) Σᵢ ‖θᵢ‖² − Ξ², with the
 * replicas' exact norms (each peer reports its own).
 *
 * Pure functions on host memory; any thread.
 */
#ifndef RUMOR_GOSSIP_DRIFT_H
#define RUMOR_GOSSIP_DRIFT_H

#include <stddef.h>
#include <stdint.h>

/* Ξ estimated from n sketches of k doubles each (sketches[i] points at
 * replica i's). NaN when n < 1. */
double drift_from_sketches(const double *const *sketches, size_t n, int k);

/* Ξ exactly from n parameter vectors of p floats each (O(n·p), in double).
 * NaN when n < 1. */
double drift_exact(const float *const *params, size_t n, uint64_t p);

/* ‖θ̄‖ from the replicas' norms and Ξ (clamped at 0). */
double drift_mean_norm(const double *norms, size_t n, double xi);

#endif /* RUMOR_GOSSIP_DRIFT_H */
