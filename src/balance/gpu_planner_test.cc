// GPU planner vs host planner: bitwise-equal plans over many seeded load matrices; the device plan's
// consumers against host references (instance assignment, replica weight streaming, replica gradient
// reduction). Skips (with the reason) when the build has no CUDA or no device is present.
#include "rdep/balance/gpu_planner.h"

#include <gtest/gtest.h>

#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "balance/plan_test_util.h"
#include "rdep/balance/load_trace.h"
#include "rdep/core/capacity.h"
#include "rdep/core/random.h"
#include "rdep/core/routing.h"

namespace rdep {
namespace {

using test_util::ExpectSamePlan;

#if defined(RDEP_HAVE_CUDA)
// The planner resident on the device: one DevicePlanner solves several load matrices that live in
// device memory, with the capacity rule applied on the device; each plan equals the host's plan for
// the admitted load (rdep::AdmitBySourceOrder per expert, then SolveQuotaPlan), bit for bit.
TEST(DevicePlanner, SolvesDeviceLoadsWithCapacityLikeTheHost) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  struct Shape {
    int32_t E, R, S;
  };
  for (Shape sh : {Shape{64, 4, 2}, Shape{256, 64, 2}, Shape{10, 3, 1}, Shape{16, 8, 0}}) {
    auto own = OwnershipMap::Contiguous(sh.E, sh.R);
    ASSERT_TRUE(own.ok());
    QuotaConfig cfg;
    cfg.num_slots = sh.S;
    auto planner = DevicePlanner::Create(*own, cfg);
    ASSERT_TRUE(planner.ok()) << planner.status();
    int64_t* d_load = nullptr;
    const size_t n = static_cast<size_t>(sh.E) * static_cast<size_t>(sh.R);
    ASSERT_EQ(cudaMalloc(&d_load, n * sizeof(int64_t)), cudaSuccess);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      auto synthetic = test_util::SyntheticLoad(sh.E, sh.R, 1.2, seed, 512, std::min(4, sh.E));
      ASSERT_TRUE(synthetic.ok()) << synthetic.status();
      const auto& load = *synthetic;
      ASSERT_EQ(cudaMemcpy(d_load, load.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice), cudaSuccess);
      int64_t total = 0;
      for (int64_t v : load) total += v;
      for (int64_t capacity : {INT64_MAX, total / sh.E, total / (2 * sh.E) + 1}) {
        std::vector<int64_t> admitted(n), col(static_cast<size_t>(sh.R)), kept(col.size());
        for (int32_t e = 0; e < sh.E; ++e) {
          for (int32_t r = 0; r < sh.R; ++r) col[static_cast<size_t>(r)] = load[static_cast<size_t>(r) * sh.E + e];
          AdmitBySourceOrder(col.data(), sh.R, capacity, kept.data());
          for (int32_t r = 0; r < sh.R; ++r) admitted[static_cast<size_t>(r) * sh.E + e] = kept[static_cast<size_t>(r)];
        }
        auto host = SolveQuotaPlan(admitted, *own, cfg);
        ASSERT_TRUE(host.ok()) << host.status();
        ASSERT_TRUE((*planner)->Solve(d_load, capacity, stream).ok());
        auto gpu = (*planner)->Download(stream);
        ASSERT_TRUE(gpu.ok()) << gpu.status();
        const std::string what = "E=" + std::to_string(sh.E) + " R=" + std::to_string(sh.R) + " seed=" + std::to_string(seed) +
                                 " capacity=" + std::to_string(capacity);
        ExpectSamePlan(*gpu, *host, what);
        std::vector<int64_t> dev_admitted(n);
        ASSERT_EQ(cudaMemcpy(dev_admitted.data(), (*planner)->view().admitted_load, n * sizeof(int64_t), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(dev_admitted, admitted) << what;
      }
    }
    cudaStreamDestroy(stream);
    cudaFree(d_load);
  }
  EXPECT_FALSE((*DevicePlanner::Create(*OwnershipMap::Contiguous(8, 2), QuotaConfig{}))->Solve(nullptr, 0, nullptr).ok());
}

// The device reroute of every rank's rows equals the host layer's: accepted iff among the admitted
// rows of (rank, expert), and placed on the instance InstanceForRow gives (poisoned outputs first).
TEST(DevicePlanner, AssignsInstancesLikeTheHost) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  const LayerShape s{.tokens = 300, .hidden = 8, .ffn = 4, .experts = 20, .topk = 4, .ranks = 6};
  auto own = *OwnershipMap::Contiguous(s.experts, s.ranks);  // uneven: ranks 0, 1 own 4 experts, the others 3
  QuotaConfig cfg;
  cfg.num_slots = 2;
  auto planner = std::move(*DevicePlanner::Create(own, cfg));
  const int32_t slot_base = std::max(1, own.max_local());
  std::vector<int32_t> local(static_cast<size_t>(s.experts));
  for (int32_t e = 0; e < s.experts; ++e) local[static_cast<size_t>(e)] = own.local_index(e);
  const size_t rows = static_cast<size_t>(s.tokens * s.topk);
  int64_t *d_load = nullptr;
  int32_t *d_experts = nullptr, *d_rie = nullptr, *d_local = nullptr, *d_rank = nullptr, *d_dlocal = nullptr;
  uint8_t* d_acc = nullptr;
  ASSERT_EQ(cudaMalloc(&d_load, static_cast<size_t>(s.ranks * s.experts) * 8), cudaSuccess);
  for (int32_t** p : {&d_experts, &d_rie, &d_rank, &d_dlocal}) ASSERT_EQ(cudaMalloc(p, rows * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_local, local.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_acc, rows), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_local, local.data(), local.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (const char* family : {"zipf:2", "one-expert", "uniform"}) {
    const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse(family));
    const std::vector<int64_t> load = LoadMatrix(rt, s.experts);
    ASSERT_EQ(cudaMemcpy(d_load, load.data(), load.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
    for (double cf : {0.0, 0.9}) {
      const int64_t cap = CapacityPolicy{.capacity_factor = cf}.ExpertCapacity(s);
      std::vector<int64_t> admitted(load.size()), col(static_cast<size_t>(s.ranks)), kept(col.size());
      for (int64_t e = 0; e < s.experts; ++e) {
        for (int64_t r = 0; r < s.ranks; ++r) col[static_cast<size_t>(r)] = load[static_cast<size_t>(r * s.experts + e)];
        AdmitBySourceOrder(col.data(), s.ranks, cap, kept.data());
        for (int64_t r = 0; r < s.ranks; ++r) admitted[static_cast<size_t>(r * s.experts + e)] = kept[static_cast<size_t>(r)];
      }
      const BalancePlan host = *SolveQuotaPlan(admitted, own, cfg);
      ASSERT_TRUE(planner->Solve(d_load, cap, nullptr).ok());
      for (int32_t r = 0; r < s.ranks; ++r) {
        const auto& rr = rt[static_cast<size_t>(r)];
        std::vector<int32_t> rie(rows), taken(static_cast<size_t>(s.experts), 0);
        for (size_t i = 0; i < rows; ++i) rie[i] = taken[static_cast<size_t>(rr.experts[i])]++;
        ASSERT_EQ(cudaMemcpy(d_experts, rr.experts.data(), rows * 4, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_rie, rie.data(), rows * 4, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemset(d_acc, 0x7F, rows), cudaSuccess);
        ASSERT_EQ(cudaMemset(d_rank, 0x7F, rows * 4), cudaSuccess);
        ASSERT_EQ(cudaMemset(d_dlocal, 0x7F, rows * 4), cudaSuccess);
        ASSERT_TRUE(LaunchAssignInstances(planner->view(), r, static_cast<int32_t>(s.experts), d_experts, d_rie,
                                          static_cast<int64_t>(rows), d_local, slot_base, d_acc, d_rank, d_dlocal, nullptr)
                        .ok());
        std::vector<uint8_t> acc(rows);
        std::vector<int32_t> q(rows), lo(rows);
        ASSERT_EQ(cudaMemcpy(acc.data(), d_acc, rows, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(q.data(), d_rank, rows * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(lo.data(), d_dlocal, rows * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        int64_t wrong = 0;
        for (size_t i = 0; i < rows; ++i) {
          const int32_t e = rr.experts[i];
          const bool want_acc = rie[i] < admitted[static_cast<size_t>(r) * static_cast<size_t>(s.experts) + static_cast<size_t>(e)];
          int32_t want_q = -1, want_lo = -1;
          if (want_acc) {
            const int32_t inst = InstanceForRow(host, r, e, rie[i]);
            const int32_t slot = host.instance_slot[static_cast<size_t>(inst)];
            want_q = host.instance_rank[static_cast<size_t>(inst)];
            want_lo = slot < 0 ? own.local_index(e) : slot_base + slot;
          }
          if (acc[i] != (want_acc ? 1 : 0) || q[i] != want_q || lo[i] != want_lo) ++wrong;
        }
        EXPECT_EQ(wrong, 0) << family << " capacity " << cf << " rank " << r;
      }
    }
  }
  for (void* p : {static_cast<void*>(d_load), static_cast<void*>(d_experts), static_cast<void*>(d_rie), static_cast<void*>(d_local),
                  static_cast<void*>(d_rank), static_cast<void*>(d_dlocal), static_cast<void*>(d_acc)})
    cudaFree(p);
}

// Replica weights streamed from the device plan: every used slot of every rank holds its expert's
// [w1 | w2] bytes from the expert's owner; unused slots keep their poison. Part sizes that are and are
// not multiples of 16 bytes, tiles smaller and larger than a part.
TEST(DevicePlanner, StreamsReplicaWeightsIntoEverySlot) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  struct Dims {
    int64_t H, F, tile;
  };
  for (Dims d : {Dims{64, 40, 4096}, Dims{7, 5, 16}, Dims{64, 40, 1 << 20}}) {
    const LayerShape s{.tokens = 200, .hidden = d.H, .ffn = d.F, .experts = 14, .topk = 3, .ranks = 4};
    auto own = *OwnershipMap::Contiguous(s.experts, s.ranks);  // ranks 0, 1 own 4 experts, ranks 2, 3 own 3
    QuotaConfig cfg;
    cfg.num_slots = 3;
    auto planner = std::move(*DevicePlanner::Create(own, cfg));
    const int64_t b1 = d.H * 2 * d.F * 2, b2 = d.F * d.H * 2, slot_bytes = b1 + b2;  // bf16 weights
    std::vector<int32_t> owner(own.owners()), local(static_cast<size_t>(s.experts));
    for (int32_t e = 0; e < s.experts; ++e) local[static_cast<size_t>(e)] = own.local_index(e);
    int32_t *d_owner = nullptr, *d_local = nullptr;
    int64_t* d_load = nullptr;
    ASSERT_EQ(cudaMalloc(&d_owner, owner.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_local, local.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_owner, owner.data(), owner.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_local, local.data(), local.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    const Routing rt = *GenerateRouting(s, *RoutingSpec::Parse("zipf:2"));
    const std::vector<int64_t> load = LoadMatrix(rt, s.experts);
    ASSERT_EQ(cudaMalloc(&d_load, load.size() * 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_load, load.data(), load.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(planner->Solve(d_load, INT64_MAX, nullptr).ok());
    const BalancePlan plan = *planner->Download(nullptr);
    ASSERT_GT(plan.num_replicas(), 0);
    std::vector<std::vector<unsigned char>> w1(4), w2(4);
    std::vector<unsigned char*> d_w1(4), d_w2(4), d_slots(4);
    for (int32_t r = 0; r < 4; ++r) {
      const auto L = static_cast<size_t>(own.num_local(r));
      w1[r].resize(L * static_cast<size_t>(b1));
      w2[r].resize(L * static_cast<size_t>(b2));
      for (size_t i = 0; i < w1[r].size(); ++i) w1[r][i] = static_cast<unsigned char>(i * 131 + r * 17 + 1);
      for (size_t i = 0; i < w2[r].size(); ++i) w2[r][i] = static_cast<unsigned char>(i * 71 + r * 29 + 3);
      ASSERT_EQ(cudaMalloc(&d_w1[r], w1[r].size()), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_w2[r], w2[r].size()), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_slots[r], static_cast<size_t>(3 * slot_bytes)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_w1[r], w1[r].data(), w1[r].size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_w2[r], w2[r].data(), w2[r].size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_slots[r], 0xCD, static_cast<size_t>(3 * slot_bytes)), cudaSuccess);
    }
    unsigned char** d_slots_of = nullptr;
    ASSERT_EQ(cudaMalloc(&d_slots_of, 4 * sizeof(void*)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_slots_of, d_slots.data(), 4 * sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
    for (int32_t r = 0; r < 4; ++r)
      ASSERT_TRUE(LaunchStreamReplicaWeights(planner->view(), r, static_cast<int32_t>(s.experts), d_owner, d_local, d_w1[r], b1,
                                             d_w2[r], b2, d_slots_of, d.tile, r == 3 ? 1 : 0, nullptr)
                      .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    int used = 0;
    for (int32_t r = 0; r < 4; ++r) {
      std::vector<unsigned char> got(static_cast<size_t>(3 * slot_bytes));
      ASSERT_EQ(cudaMemcpy(got.data(), d_slots[r], got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      for (int32_t sl = 0; sl < 3; ++sl) {
        const int32_t e = plan.slot_expert[static_cast<size_t>(r * 3 + sl)];
        std::vector<unsigned char> want(static_cast<size_t>(slot_bytes), 0xCD);
        if (e >= 0) {
          ++used;
          const auto q = static_cast<size_t>(own.owner(e));
          const auto j = static_cast<size_t>(own.local_index(e));
          std::copy_n(w1[q].begin() + static_cast<int64_t>(j) * b1, b1, want.begin());
          std::copy_n(w2[q].begin() + static_cast<int64_t>(j) * b2, b2, want.begin() + b1);
        }
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin() + sl * slot_bytes))
            << "rank " << r << " slot " << sl << " expert " << e << " H=" << d.H << " tile " << d.tile;
      }
    }
    EXPECT_EQ(used, plan.num_replicas());
    for (int32_t r = 0; r < 4; ++r) {
      cudaFree(d_w1[r]);
      cudaFree(d_w2[r]);
      cudaFree(d_slots[r]);
    }
    for (void* p : {static_cast<void*>(d_slots_of), static_cast<void*>(d_owner), static_cast<void*>(d_local), static_cast<void*>(d_load)})
      cudaFree(p);
  }
}

// Copies v to a new device array, kept in *keep for cudaFree at the end of the test.
template <class T>
T* Upload(const std::vector<T>& v, std::vector<void*>* keep) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, v.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  keep->push_back(d);
  return static_cast<T*>(d);
}

// Replica gradients reduced on every rank from a hand-built device plan equal the host layer's
// ReduceReplicaGradients bit for bit: each owned expert gets its replicas' fp32 slot gradients added in
// instance order, skipping replicas with quota 0 (their slots, and empty ones, hold NaN); experts
// without such a replica, and those owned elsewhere, keep their random gradients.
TEST(DevicePlanner, ReducesReplicaGradientsLikeTheHost) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  constexpr int32_t E = 8, R = 4, S = 2;
  constexpr int64_t n1 = 2 * 7 * 45, n2 = n1 / 2, per = n1 + n2;  // 945 per slot: 4 blocks, a ragged tail
  const OwnershipMap own = *OwnershipMap::Contiguous(E, R);     // rank r owns experts 2r and 2r + 1
  // Expert 0: three replicas (not in rank order); 2: an idle replica (quota 0) before a busy one;
  // 5: one replica; the others none. Slot 1 of rank 0 and slot 0 of rank 2 stay empty.
  BalancePlan p;
  p.instance_offsets = {0, 4, 5, 8, 9, 10, 12, 13, 14};
  p.instance_expert = {0, 0, 0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7};
  p.instance_rank = {0, 3, 1, 2, 0, 1, 0, 3, 1, 2, 2, 1, 3, 3};
  p.instance_slot = {-1, 0, 0, 1, -1, -1, 0, 1, -1, -1, -1, 1, -1, -1};
  p.instance_quota = {4, 9, 5, 3, 8, 6, 0, 4, 2, 7, 1, 2, 5, 3};
  for (int32_t e = 0; e < E; ++e) ASSERT_EQ(p.instance_rank[static_cast<size_t>(p.instance_offsets[e])], own.owner(e));
  Rng rng(0x5EED0001);
  auto normals = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(rng.normal());
    return v;
  };
  std::vector<std::vector<float>> slot_g(R, std::vector<float>(S * per, std::nanf(""))), dw1(R), dw2(R);
  for (int32_t i = 0; i < p.num_instances(); ++i) {
    const auto u = static_cast<size_t>(i);
    if (p.instance_slot[u] < 0 || p.instance_quota[u] == 0) continue;
    const std::vector<float> g = normals(per);
    std::copy(g.begin(), g.end(), slot_g[static_cast<size_t>(p.instance_rank[u])].begin() + p.instance_slot[u] * per);
  }
  std::vector<void*> keep;
  DevicePlanView view;
  view.instance_offsets = Upload(p.instance_offsets, &keep);
  view.instance_rank = Upload(p.instance_rank, &keep);
  view.instance_slot = Upload(p.instance_slot, &keep);
  view.instance_quota = Upload(p.instance_quota, &keep);
  std::vector<int32_t> local(E);
  for (int32_t e = 0; e < E; ++e) local[static_cast<size_t>(e)] = own.local_index(e);
  const int32_t *d_owner = Upload(own.owners(), &keep), *d_local = Upload(local, &keep);
  std::vector<const float*> d_slot_g(R);
  std::vector<float*> d_dw1(R), d_dw2(R);
  for (int32_t r = 0; r < R; ++r) d_slot_g[static_cast<size_t>(r)] = Upload(slot_g[static_cast<size_t>(r)], &keep);
  const float* const* d_slot_g_of = Upload(d_slot_g, &keep);
  for (int32_t r = 0; r < R; ++r) {
    const auto u = static_cast<size_t>(r);
    dw1[u] = normals(own.num_local(r) * n1);
    dw2[u] = normals(own.num_local(r) * n2);
    d_dw1[u] = Upload(dw1[u], &keep);
    d_dw2[u] = Upload(dw2[u], &keep);
    ASSERT_TRUE(LaunchReduceReplicaGradients(view, r, E, d_owner, d_local, d_dw1[u], n1, d_dw2[u], n2, d_slot_g_of, nullptr).ok());
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int32_t r = 0; r < R; ++r) {
    const auto u = static_cast<size_t>(r);
    std::vector<float> want1 = dw1[u], want2 = dw2[u], got1(want1.size()), got2(want2.size());
    std::vector<int> added(E, 0);
    for (int32_t i = 0; i < p.num_instances(); ++i) {  // the host layer's ReduceReplicaGradients
      const int32_t e = p.instance_expert[static_cast<size_t>(i)], slot = p.instance_slot[static_cast<size_t>(i)];
      if (slot < 0 || own.owner(e) != r || p.instance_quota[static_cast<size_t>(i)] == 0) continue;
      const float* src = slot_g[static_cast<size_t>(p.instance_rank[static_cast<size_t>(i)])].data() + slot * per;
      const int64_t j = own.local_index(e);
      for (int64_t c = 0; c < n1; ++c) want1[static_cast<size_t>(j * n1 + c)] += src[c];
      for (int64_t c = 0; c < n2; ++c) want2[static_cast<size_t>(j * n2 + c)] += src[n1 + c];
      ++added[static_cast<size_t>(e)];
    }
    ASSERT_EQ(cudaMemcpy(got1.data(), d_dw1[u], got1.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got2.data(), d_dw2[u], got2.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int32_t j = 0; j < own.num_local(r); ++j) {
      const std::string what = "rank " + std::to_string(r) + " expert " + std::to_string(own.global_expert(r, j)) + ", " +
                               std::to_string(added[static_cast<size_t>(own.global_expert(r, j))]) + " replica(s) added";
      EXPECT_TRUE(std::equal(want1.begin() + j * n1, want1.begin() + (j + 1) * n1, got1.begin() + j * n1)) << what << " (dw1)";
      EXPECT_TRUE(std::equal(want2.begin() + j * n2, want2.begin() + (j + 1) * n2, got2.begin() + j * n2)) << what << " (dw2)";
    }
  }
  EXPECT_FALSE(LaunchReduceReplicaGradients(view, -1, E, d_owner, d_local, d_dw1[0], n1, d_dw2[0], n2, d_slot_g_of, nullptr).ok());
  for (void* d : keep) cudaFree(d);
}
#endif

TEST(GpuPlanner, MatchesHostOverSeededLoads) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  int cases = 0;
  struct Shape {
    int32_t E, R;
  };
  for (Shape sh : {Shape{256, 64}, Shape{128, 64}, Shape{64, 8}, Shape{160, 40}, Shape{128, 72}, Shape{16, 32},
                   Shape{256, 32}, Shape{8, 1}}) {
    for (int32_t S : {0, 1, 2, 4}) {
      if (S > sh.E) continue;
      for (double alpha : {0.6, 1.0, 1.4}) {
        for (uint64_t seed = 1; seed <= 4; ++seed) {
          auto synthetic = test_util::SyntheticLoad(sh.E, sh.R, alpha, seed * 7919 + static_cast<uint64_t>(S), 1024, std::min(8, sh.E));
          ASSERT_TRUE(synthetic.ok()) << synthetic.status();
          const auto& load = *synthetic;
          auto own = OwnershipMap::Contiguous(sh.E, sh.R);
          ASSERT_TRUE(own.ok());
          for (bool locality : {true, false}) {
            QuotaConfig cfg;
            cfg.num_slots = S;
            cfg.min_quota = seed == 4 ? 64 : 1;
            cfg.locality = locality;
            auto host = SolveQuotaPlan(load, *own, cfg);
            ASSERT_TRUE(host.ok()) << host.status();
            auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
            ASSERT_TRUE(gpu.ok()) << gpu.status();
            const std::string what = "E=" + std::to_string(sh.E) + " R=" + std::to_string(sh.R) +
                                     " S=" + std::to_string(S) + " alpha=" + std::to_string(alpha) +
                                     " seed=" + std::to_string(seed) + " locality=" + std::to_string(locality);
            ExpectSamePlan(*gpu, *host, what);
            EXPECT_TRUE(CheckPlan(*gpu, load, *own, cfg.min_quota).ok()) << what;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 300);
}

// The gain gate on the device: at the edge (min_gain = the host plan's gain per replica, kept) and one
// row past it (dropped), the GPU plan equals the host's, over shapes that take both search paths (the
// thread search up to R = 64, the warp search above).
TEST(GpuPlanner, MatchesHostAtTheGainGatesEdge) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  struct Shape {
    int32_t E, R;
  };
  int dropped = 0, kept = 0;
  for (Shape sh : {Shape{64, 2}, Shape{64, 4}, Shape{256, 64}, Shape{160, 40}, Shape{128, 72}}) {  // R = 72: the warp search
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      auto synthetic = test_util::SyntheticLoad(sh.E, sh.R, 1.2, seed, 4096, std::min(6, sh.E));
      ASSERT_TRUE(synthetic.ok()) << synthetic.status();
      const auto& load = *synthetic;
      auto own = OwnershipMap::Contiguous(sh.E, sh.R);
      ASSERT_TRUE(own.ok());
      auto none = NoBalancePlan(load, *own);
      ASSERT_TRUE(none.ok());
      QuotaConfig cfg;
      auto open = SolveQuotaPlan(load, *own, cfg);
      ASSERT_TRUE(open.ok()) << open.status();
      const int64_t n = open->num_replicas();
      if (n == 0) continue;
      const int64_t max0 = ComputeMetrics(*none).max_rank_load;
      const int64_t per = (max0 - open->threshold) / n;
      for (int64_t g : {per, per + 1}) {
        cfg.min_gain = g;
        auto host = SolveQuotaPlan(load, *own, cfg);
        ASSERT_TRUE(host.ok()) << host.status();
        auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
        ASSERT_TRUE(gpu.ok()) << gpu.status();
        const std::string what = "E=" + std::to_string(sh.E) + " R=" + std::to_string(sh.R) + " seed=" + std::to_string(seed) +
                                 " min_gain=" + std::to_string(g);
        ExpectSamePlan(*gpu, *host, what);
        (host->num_replicas() == 0 ? dropped : kept)++;
      }
    }
  }
  EXPECT_GT(dropped, 0);
  EXPECT_GT(kept, 0);
}

TEST(GpuPlanner, MatchesHostOnEdgeCases) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  auto own = OwnershipMap::Contiguous(32, 8);
  ASSERT_TRUE(own.ok());
  std::vector<std::vector<int64_t>> loads;
  loads.emplace_back(8 * 32, 0);    // no load
  loads.emplace_back(8 * 32, 100);  // uniform
  std::vector<int64_t> one(8 * 32, 0);
  for (int r = 0; r < 8; ++r) one[static_cast<size_t>(r * 32 + 3)] = 1000 + r;
  loads.push_back(one);  // one expert holds all load
  for (const auto& load : loads) {
    QuotaConfig cfg;
    cfg.num_slots = 2;
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    ExpectSamePlan(*gpu, *host, "edge");
  }
}

// A load matrix too large to stage in shared memory (64 x 1024 int32 = 256 KiB): the kernel reads the
// load from global memory and the reroute reads the residual demand from its global copy. One hot
// expert of 2^25 rows or more takes the int64 chain, another below 2^25 the 32-bit one. An entry above
// int32 is refused by name (the device plan counts rows in int32).
TEST(GpuPlanner, MatchesHostUnstagedAndRefusesEntriesAboveInt32) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  constexpr int32_t E = 1024, R = 64;
  auto cap = GpuPlannerCanImplement(E, R, 2);
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_FALSE(cap->staged_load);
  EXPECT_GT(cap->probe_threads, 0);
  auto own = OwnershipMap::Contiguous(E, R);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(static_cast<size_t>(R) * E);
  for (size_t i = 0; i < load.size(); ++i) load[i] = 60 + static_cast<int64_t>((i * 2654435761u) % 97);
  // Expert 5 at 2^19 + 1 rows per source (2^25 + 64 in all: the int64 reroute chain, rank loads below
  // 2^26: thread search) or 2^21 (a rank load of 2^27: the warp search).
  for (int64_t hot : {(int64_t{1} << 19) + 1, int64_t{1} << 21}) {
    for (int r = 0; r < R; ++r) {
      load[static_cast<size_t>(r) * E + 5] = hot;
      load[static_cast<size_t>(r) * E + 700] = 50000 + 17 * r;  // expert 700: ~3.2M rows
    }
    for (int32_t S : {1, 2}) {
      QuotaConfig cfg;
      cfg.num_slots = S;
      cfg.min_quota = 100;
      auto host = SolveQuotaPlan(load, *own, cfg);
      auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
      ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
      ASSERT_GT(host->instance_offsets[6] - host->instance_offsets[5], 1);
      ASSERT_GT(host->instance_offsets[701] - host->instance_offsets[700], 1);
      ExpectSamePlan(*gpu, *host, "unstaged, hot=" + std::to_string(hot) + " S=" + std::to_string(S));
    }
  }
  load[static_cast<size_t>(3) * E + 9] = (int64_t{1} << 31) + 5;
  QuotaConfig cfg;
  auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(gpu.status().message().find("load[3][9]"), std::string::npos) << gpu.status();
}

// One expert hot on every rank of 64 gets more than 32 instances: its instance threads span warps in
// the reroute, with the thread-probe search (R <= 64).
TEST(GpuPlanner, MatchesHostWithMoreThan32Instances) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  auto own = OwnershipMap::Contiguous(32, 64);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> load(64 * 32, 0);
  for (int r = 0; r < 64; ++r) {
    load[static_cast<size_t>(r * 32 + 3)] = 5000 + 7 * r;
    load[static_cast<size_t>(r * 32 + (r % 32))] += 10 + r;
  }
  for (int64_t umin : {int64_t{1}, int64_t{50}}) {
    QuotaConfig cfg;
    cfg.num_slots = 2;
    cfg.min_quota = umin;
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    EXPECT_GT(host->instance_offsets[4] - host->instance_offsets[3], 32);
    ExpectSamePlan(*gpu, *host, "hot expert, u_min=" + std::to_string(umin));
  }
}

// The speculation shape and the reroute table are measurement knobs read from the environment at
// each solve; none may change the plan. Covers: no chain and small rounds (many rounds, records from
// earlier rounds, re-runs), a wide first round with a long chain, a chain guessed far too low (the
// path leaves it early), and the reroute with no table or a table too small for every expert (the
// per-thread reciprocal chain for the rest).
TEST(GpuPlanner, MatchesHostUnderEverySpeculationKnob) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  struct Knobs {
    const char* threads;
    const char* chain;
    const char* table;
  };
  const Knobs knobs[] = {{"31", "0", nullptr}, {"255", "2", nullptr}, {"128", "16", nullptr},
                         {nullptr, nullptr, "0"}, {nullptr, nullptr, "3"}, {"7", "5", "1"}};
  auto set = [](const char* name, const char* v) {
    if (v != nullptr) setenv(name, v, 1);
    else unsetenv(name);
  };
  int cases = 0;
  for (const Knobs& k : knobs) {
    set("RDEP_GPU_PLANNER_PROBE_THREADS", k.threads);
    set("RDEP_GPU_PLANNER_CHAIN_SHIFT", k.chain);
    set("RDEP_GPU_PLANNER_REROUTE_TABLE", k.table);
    for (int32_t E : {256, 64}) {
      const int32_t R = E == 256 ? 64 : 8;
      auto own = OwnershipMap::Contiguous(E, R);
      ASSERT_TRUE(own.ok());
      for (int32_t S : {1, 2}) {
        for (double alpha : {1.0, 1.4}) {
          SyntheticLoadSpec spec;
          spec.experts = E;
          spec.ranks = R;
          spec.alpha = alpha;
          spec.tokens = 4096;
          spec.topk = 8;
          spec.seed = 11 + static_cast<uint64_t>(S);
          auto trace = GenerateSyntheticLoads(spec, 1);
          ASSERT_TRUE(trace.ok()) << trace.status();
          QuotaConfig cfg;
          cfg.num_slots = S;
          cfg.min_quota = 327;
          auto host = SolveQuotaPlan(trace->steps[0], *own, cfg);
          auto gpu = SolveQuotaPlanGpu(trace->steps[0], *own, cfg);
          ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
          ExpectSamePlan(*gpu, *host,
                         std::string("threads=") + (k.threads ? k.threads : "-") + " chain=" + (k.chain ? k.chain : "-") +
                             " table=" + (k.table ? k.table : "-") + " E=" + std::to_string(E) + " S=" +
                             std::to_string(S) + " alpha=" + std::to_string(alpha));
          ++cases;
        }
      }
    }
  }
  set("RDEP_GPU_PLANNER_PROBE_THREADS", nullptr);
  set("RDEP_GPU_PLANNER_CHAIN_SHIFT", nullptr);
  set("RDEP_GPU_PLANNER_REROUTE_TABLE", nullptr);
  EXPECT_EQ(cases, 48);
}

// The benchmark's shape (rdep plan bench defaults: E=256, R=64, N_slot=2, alpha=1, T=4096, K=8,
// u_min = 1% of the mean rank load): equal plans, and the per-phase cycle split of the kernel.
TEST(GpuPlanner, MatchesHostAtBenchShapeAndReportsPhases) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "GPU planner not testable here: " << why;
  SyntheticLoadSpec spec;
  spec.experts = 256;
  spec.ranks = 64;
  spec.alpha = 1.0;
  spec.tokens = 4096;
  spec.topk = 8;
  spec.seed = 1;
  auto trace = GenerateSyntheticLoads(spec, 4);
  ASSERT_TRUE(trace.ok()) << trace.status();
  auto own = OwnershipMap::Contiguous(256, 64);
  ASSERT_TRUE(own.ok());
  QuotaConfig cfg;
  cfg.num_slots = 2;
  cfg.min_quota = static_cast<int64_t>(std::floor(0.01 * 4096 * 8));
  for (size_t step = 0; step < trace->steps.size(); ++step) {
    const auto& load = trace->steps[step];
    auto host = SolveQuotaPlan(load, *own, cfg);
    auto gpu = SolveQuotaPlanGpu(load, *own, cfg);
    ASSERT_TRUE(host.ok() && gpu.ok()) << gpu.status();
    ExpectSamePlan(*gpu, *host, "bench shape, step " + std::to_string(step));
    auto t = BenchQuotaPlanGpu(load, *own, cfg, 5, 50);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->phase_cycles.size(), 7u);
    int multi = 0, max_inst = 0;
    for (int32_t e = 0; e < host->num_experts; ++e) {
      const int k = host->instance_offsets[static_cast<size_t>(e) + 1] - host->instance_offsets[static_cast<size_t>(e)];
      multi += k > 1 ? 1 : 0;
      max_inst = std::max(max_inst, k);
    }
    std::printf("step %zu: p50 %.1f us, %d probe threads (%d probe warps if the warp search runs); cycles setup %.0f, search %.0f, record %.0f, tables+reroute %.0f "
                "(prep %.0f, replicated %.0f, tables+single %.0f; %d replicated experts, <= %d instances) (clock %.0f MHz)\n",
                step, t->solve_us.p50, t->config.probe_threads, t->config.probe_warps, t->phase_cycles[0], t->phase_cycles[1], t->phase_cycles[2],
                t->phase_cycles[3], t->phase_cycles[4], t->phase_cycles[5], t->phase_cycles[6], multi, max_inst,
                t->clock_mhz);
  }
}

TEST(GpuPlanner, ReportsUnavailableOrRejectsBadInput) {
  auto own = OwnershipMap::Contiguous(8, 2);
  ASSERT_TRUE(own.ok());
  std::vector<int64_t> wrong(15, 1);
  auto r = SolveQuotaPlanGpu(wrong, *own, QuotaConfig{});
  EXPECT_FALSE(r.ok());
  std::string why;
  if (!GpuPlannerAvailable(&why)) {
    EXPECT_FALSE(why.empty());
    std::vector<int64_t> load(16, 1);
    auto u = SolveQuotaPlanGpu(load, *own, QuotaConfig{});
    EXPECT_EQ(u.status().code(), StatusCode::kUnavailable) << u.status();
  }
}

}  // namespace
}  // namespace rdep
