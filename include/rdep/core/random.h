// A small seeded generator (SplitMix64) whose streams are identical on every platform, so routings,
// weights and inputs generated from a seed are reproducible bit for bit (std distributions are not).
#pragma once

#include <cmath>
#include <cstdint>

namespace rdep {

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : state_(seed ^ (0x9E3779B97F4A7C15ull * (stream + 1))) { next(); }

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Advances the stream by n draws of next() in O(1) (SplitMix64's state is a counter): a generator
  // skipped by n then drawn gives what the (n+1)-th draw of the original would, so a stream can be
  // filled in parallel chunks with the same values. normal() takes two draws.
  void skip(uint64_t n) { state_ += n * 0x9E3779B97F4A7C15ull; }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in (0, 1): safe under log().
  double uniform_open() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  // Standard normal (Box-Muller, one value per call).
  double normal() {
    const double u1 = uniform_open(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Standard Gumbel: -log(-log(U)).
  double gumbel() { return -std::log(-std::log(uniform_open())); }

 private:
  uint64_t state_;
};

}  // namespace rdep
