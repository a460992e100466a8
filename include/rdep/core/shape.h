// LayerShape: what one MoE layer on one domain is asked to do (the problem, not how it runs).
#pragma once

#include <cstdint>
#include <ostream>

#include "rdep/status.h"

namespace rdep {

struct LayerShape {
  int64_t tokens = 0;   // T: tokens per rank (the row-identity space of each rank; a rank may hold fewer)
  int64_t hidden = 0;   // H: activation width
  int64_t ffn = 0;      // D_ff: expert intermediate width (SwiGLU: W1 is H x 2*D_ff, W2 is D_ff x H)
  int64_t experts = 0;  // E: experts in the layer, across the domain
  int64_t topk = 0;     // K: experts chosen per token
  int64_t ranks = 0;    // W: ranks in the domain (DP = EP = W)

  // Rejects non-positive sizes, K > E, and shapes whose row identities overflow 63 bits.
  Status Validate() const;

  int64_t rows_per_rank() const { return tokens * topk; }  // T*K
  int64_t total_rows() const { return ranks * tokens * topk; }  // W*T*K (dropless row count)
  // Mean rows per expert under the pooling law mu = W*T*K/E.
  double pooled_rows_per_expert() const { return static_cast<double>(total_rows()) / static_cast<double>(experts); }
};

std::ostream& operator<<(std::ostream& os, const LayerShape& s);

}  // namespace rdep
