// What one forward of the CUDA layer's two-phase exchange (LayerConfig::nodes > 1) keeps for its
// backward on one rank, in both roles: as a source, its bundles (one per (token, node) with an
// accepted row there) and how many went to each node; as a relay, the records it received (their meta
// is what backward scatters by) and the expert rows of its node (dgate's dot products). Internal to the
// layer library; cuda_two_phase.cc fills it, record layouts in rdep/dispatch/two_phase_kernels.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "layer/cuda_layer_state.h"

namespace rdep::cuda_layer {

struct TwoPhaseSaved {
  int device = 0;
  // Source: bundle_index [N][T] (LaunchBundleIndex); words [N + 2] on the device: bundles per
  // destination node, then the first token over the node cap (~0: none), then the (record, owner)
  // pairs this rank scattered as a relay; host_words: their pinned host copy.
  DeviceBuffer<int32_t> bundle_index;
  DeviceBuffer<int64_t> words;
  int64_t* host_words = nullptr;
  std::vector<int64_t> sent;     // [N] bundles this rank sent to node b (host)
  std::vector<int64_t> relayed;  // [N] records this rank received from node a as a relay (host)
  // Relay: the forward records (meta + x rows) and the node's expert rows [records][K][H] (kept for
  // backward); transient per call: records to send, dy records received, reduced records sent back
  // and received.
  DeviceBuffer<char> relay_in, send, relay_dy, reduced, returned;
  DeviceBuffer<__nv_bfloat16> keep;
  // Forward profile: before the pack, after the inter-node hop, after the node's protocol, after the
  // return hop.
  std::array<cudaEvent_t, 4> events{};

  int64_t words_count(int32_t nodes) const { return nodes + 2; }
  size_t bytes() const {
    return bundle_index.count * 4 + words.count * 8 + relay_in.count + send.count + relay_dy.count + reduced.count +
           returned.count + keep.count * 2;
  }
  ~TwoPhaseSaved() {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
    if (host_words) cudaFreeHost(host_words);
    bundle_index.Free();
    words.Free();
    for (auto* b : {&relay_in, &send, &relay_dy, &reduced, &returned}) b->Free();
    keep.Free();
    cudaSetDevice(current);
  }
};

}  // namespace rdep::cuda_layer
