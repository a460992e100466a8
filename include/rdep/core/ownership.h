// Expert ownership: which rank owns each expert, and its owner-local index. The map is data, kept in
// one place, never arithmetic sprinkled through kernels.
//   Balanced (W divides E):  pi(e) = e / E_loc, lambda(e) = e mod E_loc.
//   Non-uniform (otherwise): contiguous blocks, the first E mod W ranks own one expert more
//                            (E=128, W=72: 56 ranks own 2 experts and 16 own 1; E<W: some own none).
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "rdep/status.h"

namespace rdep {

class OwnershipMap {
 public:
  // Contiguous ownership: balanced when W divides E, non-uniform otherwise.
  static StatusOr<OwnershipMap> Contiguous(int64_t num_experts, int64_t num_ranks);
  // Any map: owner_of_expert[e] in [0, W). Local indices follow ascending expert id per owner.
  static StatusOr<OwnershipMap> FromOwners(std::vector<int32_t> owner_of_expert, int64_t num_ranks);

  int32_t num_experts() const { return static_cast<int32_t>(owner_.size()); }
  int32_t num_ranks() const { return static_cast<int32_t>(first_.size()) - 1; }
  int32_t owner(int32_t e) const { return owner_[e]; }
  int32_t local_index(int32_t e) const { return local_[e]; }
  int32_t num_local(int32_t q) const { return first_[q + 1] - first_[q]; }
  // The j-th expert owned by rank q.
  int32_t global_expert(int32_t q, int32_t j) const { return by_owner_[first_[q] + j]; }
  int32_t max_local() const { return max_local_; }
  bool balanced() const { return balanced_; }
  const std::vector<int32_t>& owners() const { return owner_; }

 private:
  std::vector<int32_t> owner_;     // [E]
  std::vector<int32_t> local_;     // [E]
  std::vector<int32_t> first_;     // [W+1] prefix of experts per owner into by_owner_
  std::vector<int32_t> by_owner_;  // [E] expert ids grouped by owner, ascending
  int32_t max_local_ = 0;
  bool balanced_ = false;
};

std::ostream& operator<<(std::ostream& os, const OwnershipMap& m);

}  // namespace rdep
