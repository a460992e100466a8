// The chunk-relay rule of the replica weight streaming (seeds 001 section 6), one definition for host
// and device code: the host layer's PlanRelays (rdep/balance/layer_balance.h) wraps it, and the CUDA
// layer runs it in one device thread on the plan in device memory (LaunchPlanRelays,
// rdep/balance/gpu_planner.h), so both layers relay the same experts through the same replicas.
//
// The rule: an expert with more than `relay_above` active replicas (slot >= 0 and quota > 0: idle
// ones receive nothing) is split into m = round(sqrt(replicas)) chunks; its owner sends chunk c only to
// relay c, and each relay then sends its chunk to the expert's other active replicas. Relays are
// chosen greedily by the ranks' sending load, counted in expert copies (owners start with one copy per
// relayed expert and one per active replica of every other expert): widest experts first (ties: lower
// expert id), among an expert's active replicas the lowest load, then the lowest rank, then the lowest
// instance index; a relay's rank then takes (replicas - 1) / m more. Relays are numbered by instance
// index: relay c is the c-th chosen instance in instance order. relay_above <= 0: no relays.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RDEP_RELAY_HD __host__ __device__
#else
#define RDEP_RELAY_HD
#endif

namespace rdep {

// round(sqrt(n)) for n >= 0, exact in integers (sqrt of an integer is never x.5).
RDEP_RELAY_HD inline int32_t NearestSqrt(int32_t n) {
  int32_t m = 0;
  while (static_cast<int64_t>(m + 1) * (m + 1) <= n) ++m;
  return n - m * m > m ? m + 1 : m;
}

// The plan's arrays as BalancePlan / DevicePlanView hold them (I = offsets[E] instances).
struct RelayRuleInputs {
  int32_t num_experts = 0, num_ranks = 0;
  const int32_t* instance_offsets = nullptr;  // [E+1]
  const int32_t* instance_rank = nullptr;     // [I]
  const int32_t* instance_slot = nullptr;     // [I]
  const int64_t* instance_quota = nullptr;    // [I]
};

RDEP_RELAY_HD inline bool RelayActive(const RelayRuleInputs& p, int32_t i) {
  return p.instance_slot[i] >= 0 && p.instance_quota[i] > 0;
}

RDEP_RELAY_HD inline int32_t ActiveReplicas(const RelayRuleInputs& p, int32_t e) {
  int32_t n = 0;
  for (int32_t i = p.instance_offsets[e]; i < p.instance_offsets[e + 1]; ++i) n += RelayActive(p, i) ? 1 : 0;
  return n;
}

// Writes chunks[e] = m for a relayed expert (0: streamed directly from its owner) and chunk_of[i] = c
// for relay c of its expert (-1 for every other instance). Scratch: load [R], wide [E]. Returns the
// number of relayed experts.
RDEP_RELAY_HD inline int32_t ComputeRelays(const RelayRuleInputs& p, int32_t relay_above, double* load, int32_t* wide,
                                           int32_t* chunks, int32_t* chunk_of) {
  const int32_t E = p.num_experts;
  for (int32_t i = 0; i < p.instance_offsets[E]; ++i) chunk_of[i] = -1;
  for (int32_t e = 0; e < E; ++e) chunks[e] = 0;
  if (relay_above <= 0) return 0;
  for (int32_t r = 0; r < p.num_ranks; ++r) load[r] = 0.0;
  int32_t num_wide = 0;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t owner = p.instance_rank[p.instance_offsets[e]], replicas = ActiveReplicas(p, e);
    if (replicas > relay_above) {
      wide[num_wide++] = e;
      load[owner] += 1.0;  // stage 1: one copy, in chunks
    } else {
      load[owner] += static_cast<double>(replicas);
    }
  }
  for (int32_t a = 1; a < num_wide; ++a) {  // widest first, stable (insertion sort: few wide experts)
    const int32_t v = wide[a], rv = ActiveReplicas(p, v);
    int32_t b = a;
    for (; b > 0 && ActiveReplicas(p, wide[b - 1]) < rv; --b) wide[b] = wide[b - 1];
    wide[b] = v;
  }
  for (int32_t w = 0; w < num_wide; ++w) {
    const int32_t e = wide[w], replicas = ActiveReplicas(p, e), m = NearestSqrt(replicas) > 0 ? NearestSqrt(replicas) : 1;
    const int32_t first = p.instance_offsets[e] + 1, last = p.instance_offsets[e + 1];
    for (int32_t c = 0; c < m; ++c) {  // the c-th pick: lowest (load, rank, instance) not yet picked
      int32_t best = -1;
      for (int32_t i = first; i < last; ++i) {
        if (!RelayActive(p, i) || chunk_of[i] != -1) continue;
        if (best < 0) {
          best = i;
          continue;
        }
        const double li = load[p.instance_rank[i]], lb = load[p.instance_rank[best]];
        if (li < lb || (li == lb && p.instance_rank[i] < p.instance_rank[best])) best = i;
      }
      chunk_of[best] = -2;  // picked; numbered below
    }
    int32_t c = 0;
    for (int32_t i = first; i < last; ++i)
      if (chunk_of[i] == -2) chunk_of[i] = c++;
    for (int32_t i = first; i < last; ++i)
      if (chunk_of[i] >= 0) load[p.instance_rank[i]] += static_cast<double>(replicas - 1) / m;
    chunks[e] = m;
  }
  return num_wide;
}

// Chunk c of m covers bytes [RelayChunkBegin(c), RelayChunkBegin(c + 1)) of an expert's weights, cut on
// 16-byte boundaries; the last chunk ends at the expert's end (RelayPlan::ChunkBegin below c = m).
RDEP_RELAY_HD inline int64_t RelayChunkBegin(int64_t bytes, int64_t chunks, int64_t c) {
  return c >= chunks ? bytes : (bytes * c / chunks) / 16 * 16;
}

}  // namespace rdep
