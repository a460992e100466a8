#include "rdep/core/ownership.h"

#include <algorithm>
#include <limits>
#include <string>

namespace rdep {

StatusOr<OwnershipMap> OwnershipMap::Contiguous(int64_t num_experts, int64_t num_ranks) {
  if (num_experts < 1) return InvalidArgument("ownership: experts E must be >= 1, got " + std::to_string(num_experts));
  if (num_ranks < 1) return InvalidArgument("ownership: ranks W must be >= 1, got " + std::to_string(num_ranks));
  if (num_experts > std::numeric_limits<int32_t>::max() || num_ranks > std::numeric_limits<int32_t>::max())
    return InvalidArgument("ownership: E and W must fit in int32");
  const int64_t base = num_experts / num_ranks, extra = num_experts % num_ranks;
  std::vector<int32_t> owners(static_cast<size_t>(num_experts));
  int64_t e = 0;
  for (int64_t q = 0; q < num_ranks; ++q) {
    const int64_t n = base + (q < extra ? 1 : 0);
    for (int64_t j = 0; j < n; ++j) owners[static_cast<size_t>(e++)] = static_cast<int32_t>(q);
  }
  return FromOwners(std::move(owners), num_ranks);
}

StatusOr<OwnershipMap> OwnershipMap::FromOwners(std::vector<int32_t> owner_of_expert, int64_t num_ranks) {
  if (owner_of_expert.empty()) return InvalidArgument("ownership: the map has no experts");
  if (num_ranks < 1) return InvalidArgument("ownership: ranks W must be >= 1");
  OwnershipMap m;
  const auto W = static_cast<size_t>(num_ranks);
  std::vector<int32_t> count(W, 0);
  for (size_t e = 0; e < owner_of_expert.size(); ++e) {
    const int32_t q = owner_of_expert[e];
    if (q < 0 || static_cast<size_t>(q) >= W)
      return InvalidArgument("ownership: expert " + std::to_string(e) + " has owner " + std::to_string(q) +
                             " outside [0, " + std::to_string(num_ranks) + ")");
    ++count[static_cast<size_t>(q)];
  }
  m.first_.assign(W + 1, 0);
  for (size_t q = 0; q < W; ++q) m.first_[q + 1] = m.first_[q] + count[q];
  m.by_owner_.resize(owner_of_expert.size());
  m.local_.resize(owner_of_expert.size());
  std::vector<int32_t> fill(W, 0);
  for (size_t e = 0; e < owner_of_expert.size(); ++e) {
    const auto q = static_cast<size_t>(owner_of_expert[e]);
    m.local_[e] = fill[q];
    m.by_owner_[static_cast<size_t>(m.first_[q] + fill[q]++)] = static_cast<int32_t>(e);
  }
  m.max_local_ = *std::max_element(count.begin(), count.end());
  const int32_t min_local = *std::min_element(count.begin(), count.end());
  m.owner_ = std::move(owner_of_expert);
  m.balanced_ = (min_local == m.max_local_);
  return m;
}

std::ostream& operator<<(std::ostream& os, const OwnershipMap& m) {
  os << "ownership(E=" << m.num_experts() << ", W=" << m.num_ranks()
     << (m.balanced() ? ", balanced" : ", non-uniform") << ", max E_loc=" << m.max_local() << ")";
  return os;
}

}  // namespace rdep
