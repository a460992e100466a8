// The commit the rdep build names in its receipts: RDEP_GIT_COMMIT, set by tools/rdep/CMakeLists.txt at
// configure time (RDEP_COMMIT from the environment, else git).
#pragma once

#ifndef RDEP_GIT_COMMIT
#define RDEP_GIT_COMMIT "unknown"
#endif

namespace rdep::cli {
inline constexpr const char* kBuildCommit = RDEP_GIT_COMMIT;
}  // namespace rdep::cli
