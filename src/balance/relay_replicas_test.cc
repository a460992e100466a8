// The device chunk relays of the replica weight streaming on a hand-built plan (one GPU; each rank's
// slots a plain device array): LaunchPlanRelays gives PlanRelays' relays (the rule of relay_rule.h in
// one device thread); stage 1 (LaunchStreamReplicaWeights with the relays), a device sync standing
// for the relay barrier, then stage 2 (LaunchRelayReplicaChunks) on every rank leave every active
// replica's slot bitwise its owner's weights, as direct streaming does, and idle replicas' and empty
// slots untouched. Skips without a GPU.
//   exercise: build-*/src/balance/balance_test --gtest_filter='DeviceRelays*'
#if defined(RDEP_HAVE_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "rdep/balance/gpu_planner.h"
#include "rdep/balance/layer_balance.h"

namespace rdep {
namespace {

template <class T>
T* ToDevice(const std::vector<T>& v, std::vector<void*>* keep) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)), cudaSuccess);
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  keep->push_back(d);
  return static_cast<T*>(d);
}

// Expert 0 (owner 0) with 8 replicas on ranks 1..8, expert 1 (owner 1) with 3 on ranks 2, 5, 6 and an
// idle one on rank 7, expert 2 (owner 2) with one replica on rank 3: 9 ranks, 2 slots each.
BalancePlan HandPlan() {
  BalancePlan p;
  p.num_experts = 3;
  p.num_ranks = 9;
  p.num_slots = 2;
  p.instance_offsets = {0, 9, 14, 16};
  p.instance_expert = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2};
  p.instance_rank = {0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 5, 6, 7, 2, 3};
  p.instance_slot = {-1, 0, 0, 0, 0, 0, 0, 0, 0, -1, 1, 1, 1, 1, -1, 1};
  p.instance_quota = {5, 1, 1, 1, 1, 1, 1, 1, 1, 5, 1, 1, 1, 0, 4, 2};
  p.slot_expert.assign(18, -1);
  for (size_t i = 0; i < p.instance_rank.size(); ++i)
    if (p.instance_slot[i] >= 0) p.slot_expert[static_cast<size_t>(p.instance_rank[i] * 2 + p.instance_slot[i])] = p.instance_expert[i];
  return p;
}

TEST(DeviceRelays, StagesOneAndTwoEqualDirectStreamingOnAHandPlan) {
  std::string why;
  if (!GpuPlannerAvailable(&why)) GTEST_SKIP() << "device relays not testable here: " << why;
  const BalancePlan p = HandPlan();
  const int32_t E = p.num_experts, R = p.num_ranks, I = p.num_instances();
  std::vector<void*> keep;
  DevicePlanView view;
  view.instance_offsets = ToDevice(p.instance_offsets, &keep);
  view.instance_expert = ToDevice(p.instance_expert, &keep);
  view.instance_rank = ToDevice(p.instance_rank, &keep);
  view.instance_slot = ToDevice(p.instance_slot, &keep);
  view.instance_quota = ToDevice(p.instance_quota, &keep);
  view.slot_expert = ToDevice(p.slot_expert, &keep);
  const std::vector<int32_t> owner = {0, 1, 2}, local = {0, 0, 0};
  const int32_t* d_owner = ToDevice(owner, &keep);
  const int32_t* d_local = ToDevice(local, &keep);
  // One expert per owner: w1 of 1008 bytes (16-byte vectors) or 1000 (the byte path), w2 of 2048;
  // tiles of 256 bytes cross the relays' chunk boundaries.
  for (const int64_t b1 : {int64_t{1008}, int64_t{1000}}) {
    for (int32_t relay_above : {2, 0}) {
      const int64_t b2 = 2048, slot_bytes = b1 + b2, tile = 256;
      auto* load = ToDevice(std::vector<double>(static_cast<size_t>(R)), &keep);
      auto* wide = ToDevice(std::vector<int32_t>(static_cast<size_t>(E)), &keep);
      auto* chunks = ToDevice(std::vector<int32_t>(static_cast<size_t>(E)), &keep);
      auto* chunk_of = ToDevice(std::vector<int32_t>(static_cast<size_t>(I)), &keep);
      auto* range = ToDevice(std::vector<int64_t>(static_cast<size_t>(2 * I)), &keep);
      auto* count = ToDevice(std::vector<int32_t>(1), &keep);
      ASSERT_TRUE(LaunchPlanRelays(view, E, R, relay_above, slot_bytes, load, wide, chunks, chunk_of, range, count, nullptr).ok());
      std::vector<int32_t> got_chunks(static_cast<size_t>(E)), got_of(static_cast<size_t>(I));
      int32_t got_count = -1;
      ASSERT_EQ(cudaMemcpy(got_chunks.data(), chunks, got_chunks.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got_of.data(), chunk_of, got_of.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&got_count, count, 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const RelayPlan want = PlanRelays(p, relay_above);
      ASSERT_EQ(got_count, static_cast<int32_t>(want.experts.size())) << "relay_above " << relay_above;
      for (const ExpertRelays& er : want.experts) {
        EXPECT_EQ(got_chunks[static_cast<size_t>(er.expert)], static_cast<int32_t>(er.relays.size())) << "expert " << er.expert;
        for (size_t c = 0; c < er.relays.size(); ++c) EXPECT_EQ(got_of[static_cast<size_t>(er.relays[c])], static_cast<int32_t>(c));
      }
      if (relay_above == 2) {
        ASSERT_EQ(want.experts.size(), 2u);  // experts 0 (8 replicas) and 1 (3 active)
      }

      std::vector<std::vector<unsigned char>> w1(3), w2(3);
      std::vector<unsigned char*> d_slots(static_cast<size_t>(R));
      std::vector<const unsigned char*> d_w1(3), d_w2(3);
      for (int32_t q = 0; q < 3; ++q) {
        w1[q].resize(b1);
        w2[q].resize(b2);
        for (int64_t i = 0; i < b1; ++i) w1[q][i] = static_cast<unsigned char>(i * 131 + q * 17 + 1);
        for (int64_t i = 0; i < b2; ++i) w2[q][i] = static_cast<unsigned char>(i * 71 + q * 29 + 3);
        d_w1[q] = ToDevice(w1[q], &keep);
        d_w2[q] = ToDevice(w2[q], &keep);
      }
      for (int32_t r = 0; r < R; ++r) {
        d_slots[r] = ToDevice(std::vector<unsigned char>(static_cast<size_t>(2 * slot_bytes), 0xCD), &keep);
      }
      auto* slots_of = ToDevice(d_slots, &keep);
      const DeviceRelayView relays{chunks, chunk_of, range};
      for (int32_t q = 0; q < 3; ++q)  // stage 1 (owners), one block for rank 2 (persistent loop)
        ASSERT_TRUE(LaunchStreamReplicaWeights(view, q, E, d_owner, d_local, d_w1[q], b1, d_w2[q], b2, slots_of, tile, q == 2 ? 1 : 0,
                                               nullptr, relays)
                        .ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the relay barrier
      for (int32_t r = 0; r < R; ++r)  // stage 2 (every rank)
        ASSERT_TRUE(LaunchRelayReplicaChunks(view, relays, r, E, slot_bytes, slots_of, tile, r == 5 ? 1 : 0, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (int32_t r = 0; r < R; ++r) {
        std::vector<unsigned char> got(static_cast<size_t>(2 * slot_bytes));
        ASSERT_EQ(cudaMemcpy(got.data(), d_slots[r], got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        for (int32_t sl = 0; sl < 2; ++sl) {
          std::vector<unsigned char> want_slot(static_cast<size_t>(slot_bytes), 0xCD);
          for (int32_t i = 0; i < I; ++i) {
            const auto u = static_cast<size_t>(i);
            if (p.instance_rank[u] != r || p.instance_slot[u] != sl || p.instance_quota[u] == 0) continue;  // idle: untouched
            const auto q = static_cast<size_t>(owner[static_cast<size_t>(p.instance_expert[u])]);
            std::copy(w1[q].begin(), w1[q].end(), want_slot.begin());
            std::copy(w2[q].begin(), w2[q].end(), want_slot.begin() + b1);
          }
          EXPECT_TRUE(std::equal(want_slot.begin(), want_slot.end(), got.begin() + sl * slot_bytes))
              << "w1 " << b1 << " bytes, relay_above " << relay_above << ": rank " << r << " slot " << sl;
        }
      }
    }
  }
  for (void* d : keep) cudaFree(d);
}

}  // namespace
}  // namespace rdep
#endif
