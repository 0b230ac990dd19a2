// Runs generated Metal kernels on the CPU, for tests (tests/test_metal.py): the
// definitions behind metal_syntax.h, plus a launcher.
//
// The threads of a threadgroup are fibers (ucontext) on one OS thread, run one at a time
// until they reach a simdgroup function (simd_sum, simd_shuffle, simd_shuffle_xor,
// simd_any, simdgroup_multiply_accumulate). There a lane leaves its operand and waits;
// once all 32 lanes of its simdgroup have arrived at the same function, each lane takes
// its result from the 32 operands. So the lanes of a simdgroup run in lockstep wherever
// their results depend on one another, while plain code between those points runs one lane
// after another (a lane reading another lane's write with no simdgroup function between
// them would see stale data, and the tests would fail).
//
// A lane that reaches a different simdgroup function than the rest of its simdgroup, or
// returns while the others wait, is reported as an error: the kernels must keep these
// functions in uniform control flow, and this is where that is checked. The kernels use
// no threadgroup memory, hence no threadgroup barriers, so none are emulated.
//
// simdgroup_matrix follows the register layout of Apple GPUs (the one MLX's GEMMs rely
// on): lane l holds elements (row, col) and (row, col + 1), with row = 4*b4 + 2*b2 + b1
// and col = 4*b3 + 2*b0, b being the bits of l.
#pragma once
#include "metal_syntax.h"

#include <ucontext.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lik_cpu {

constexpr unsigned kSimdWidth = 32;
constexpr size_t kStackBytes = 64 * 1024;  // per thread; kernel frames take a few KiB
constexpr size_t kSlotBytes = 32;          // the largest operand: 3 x 2 floats of a product

enum class State { Runnable, Waiting, Done };

struct Lane {
  ucontext_t context;
  State state = State::Runnable;
  const char* waiting_at = "";
  unsigned long arrivals = 0;  // simdgroup functions entered so far
};

struct Group {
  unsigned threads = 0;
  std::vector<Lane> lanes;
  // Operands left at simdgroup functions, [simdgroup][arrival parity][lane]: two parities
  // let a lane leave its next operand while slower lanes still read the previous ones.
  std::vector<unsigned char> slots;
  ucontext_t scheduler;
  std::function<void(unsigned)> body;
  std::string error;
};

inline Group* active_group = nullptr;
inline unsigned active_thread = 0;

inline unsigned char* slot(unsigned tid, unsigned long arrival) {
  const unsigned simdgroup = tid / kSimdWidth, lane = tid % kSimdWidth;
  const size_t at = (simdgroup * 2 + arrival % 2) * kSimdWidth + lane;
  return &active_group->slots[at * kSlotBytes];
}

// Stops the running lane for good and makes the launch report `message`.
inline void fail(const std::string& message) {
  Lane& lane = active_group->lanes[active_thread];
  active_group->error = "thread " + std::to_string(active_thread) + ": " + message;
  lane.state = State::Waiting;
  lane.waiting_at = "(failed)";
  swapcontext(&lane.context, &active_group->scheduler);
}

// Leaves this lane's operand at simdgroup function `op`, waits for the whole simdgroup,
// and returns the 32 operands in lane order.
template <typename T>
std::array<T, kSimdWidth> exchange(const char* op, const T& mine) {
  static_assert(sizeof(T) <= kSlotBytes && std::is_trivially_copyable_v<T>);
  const unsigned tid = active_thread;
  Lane& lane = active_group->lanes[tid];
  const unsigned long arrival = lane.arrivals;
  std::memcpy(slot(tid, arrival), &mine, sizeof(T));
  lane.state = State::Waiting;
  lane.waiting_at = op;
  swapcontext(&lane.context, &active_group->scheduler);
  lane.arrivals++;
  std::array<T, kSimdWidth> all;
  const unsigned first = tid - tid % kSimdWidth;
  for (unsigned l = 0; l < kSimdWidth; ++l) {
    std::memcpy(&all[l], slot(first + l, arrival), sizeof(T));
  }
  return all;
}

inline unsigned lane_id() { return active_thread % kSimdWidth; }

inline void fragment_slot(unsigned lane, int& row, int& col) {
  row = 4 * ((lane >> 4) & 1) + 2 * ((lane >> 2) & 1) + ((lane >> 1) & 1);
  col = 4 * ((lane >> 3) & 1) + 2 * (lane & 1);
}

inline void run_lane() {
  Group& group = *active_group;
  group.body(active_thread);
  group.lanes[active_thread].state = State::Done;
}  // returns to the scheduler (uc_link)

// Lets every simdgroup whose lanes all wait at the same function go on. Returns an error
// message for a simdgroup whose lanes diverged.
inline std::string release_simdgroups(Group& group) {
  for (unsigned first = 0; first < group.threads; first += kSimdWidth) {
    const Lane* lanes = &group.lanes[first];
    unsigned waiting = 0;
    for (unsigned l = 0; l < kSimdWidth; ++l) {
      waiting += lanes[l].state == State::Waiting;
    }
    if (waiting == 0) {
      continue;
    }
    for (unsigned l = 0; l < kSimdWidth; ++l) {
      const bool same = lanes[l].state == State::Waiting &&
                        std::strcmp(lanes[l].waiting_at, lanes[0].waiting_at) == 0 &&
                        lanes[l].arrivals == lanes[0].arrivals;
      if (!same) {
        const char* at = lanes[l].state == State::Done ? "the kernel's end" : lanes[l].waiting_at;
        return "simdgroup " + std::to_string(first / kSimdWidth) + " diverged: lane 0 waits at " +
               lanes[0].waiting_at + ", lane " + std::to_string(l) + " reached " + at;
      }
    }
    for (unsigned l = 0; l < kSimdWidth; ++l) {
      group.lanes[first + l].state = State::Runnable;
    }
  }
  return "";
}

// Runs one threadgroup of `threads` threads (a multiple of 32) to completion.
inline std::string run_group(unsigned threads, std::function<void(unsigned)> body) {
  static std::vector<char> stacks;  // reused: a threadgroup's stacks need no zeroing
  if (stacks.size() < threads * kStackBytes) {
    stacks.resize(threads * kStackBytes);
  }
  Group group;
  group.threads = threads;
  group.lanes.resize(threads);
  group.slots.resize(threads * 2 * kSlotBytes);
  group.body = std::move(body);
  active_group = &group;
  for (unsigned t = 0; t < threads; ++t) {
    ucontext_t& context = group.lanes[t].context;
    getcontext(&context);
    context.uc_stack.ss_sp = &stacks[t * kStackBytes];
    context.uc_stack.ss_size = kStackBytes;
    context.uc_link = &group.scheduler;
    makecontext(&context, run_lane, 0);
  }
  for (;;) {
    for (unsigned t = 0; t < threads; ++t) {
      if (group.lanes[t].state == State::Runnable) {
        active_thread = t;
        swapcontext(&group.scheduler, &group.lanes[t].context);
        if (!group.error.empty()) {
          return group.error;
        }
      }
    }
    std::string error = release_simdgroups(group);
    if (!error.empty()) {
      return error;
    }
    bool all_done = true;
    for (const Lane& lane : group.lanes) {
      all_done = all_done && lane.state == State::Done;
    }
    if (all_done) {
      return "";
    }
  }
}

// A kernel argument from the untyped array the tests pass: a buffer pointer, or a pointer
// to a scalar for `constant T&` arguments.
template <typename T>
T argument(void* p) {
  if constexpr (std::is_pointer_v<T>) {
    return static_cast<T>(p);
  } else {
    return *static_cast<std::remove_reference_t<T>*>(p);
  }
}

template <typename... P, size_t... I>
void call(void (*entry)(P...), void* const* args, uint group, ushort simdgroup, ushort lane,
          std::index_sequence<I...>) {
  using Params = std::tuple<P...>;
  entry(argument<std::tuple_element_t<I, Params>>(args[I])..., group, simdgroup, lane);
}

// dispatchThreads(threads, group_size): threadgroups of group_size threads, the last one
// smaller when group_size does not divide threads (Metal's non-uniform threadgroups).
template <typename... P>
std::string launch(void (*entry)(P...), void* const* args, long threads, long group_size) {
  constexpr size_t buffers = sizeof...(P) - 3;  // then group, simdgroup, lane
  if (threads < 0 || threads % kSimdWidth || group_size <= 0 || group_size % kSimdWidth) {
    return "threads and group size must be multiples of 32, got " + std::to_string(threads) +
           " and " + std::to_string(group_size);
  }
  for (long first = 0; first < threads; first += group_size) {
    const uint group = uint(first / group_size);
    const unsigned size = unsigned(std::min(group_size, threads - first));
    std::string error = run_group(size, [&](unsigned tid) {
      call(entry, args, group, ushort(tid / kSimdWidth), ushort(tid % kSimdWidth),
           std::make_index_sequence<buffers>());
    });
    if (!error.empty()) {
      return "threadgroup " + std::to_string(group) + ", " + error;
    }
  }
  return "";
}

using Launcher = std::string (*)(void* const* args, long threads, long group_size);

template <auto Kernel>
std::string launch_kernel(void* const* args, long threads, long group_size) {
  return launch(Kernel, args, threads, group_size);
}

struct KernelEntry {
  const char* name;
  Launcher launch;
};

}  // namespace lik_cpu

namespace metal {

inline float max(float a, float b) { return std::fmax(a, b); }

template <typename To, typename From>
To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type reinterprets bits of equal size");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> matrix;
  matrix.elements[0] = matrix.elements[1] = value;
  return matrix;
}

inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                          const simdgroup_float8x8& b,
                                          const simdgroup_float8x8& c) {
  struct Operands {
    float a[2], b[2], c[2];
  };
  const Operands mine = {{a.elements[0], a.elements[1]},
                         {b.elements[0], b.elements[1]},
                         {c.elements[0], c.elements[1]}};
  const auto all = lik_cpu::exchange("simdgroup_multiply_accumulate", mine);
  float A[8][8], B[8][8], C[8][8];
  for (unsigned l = 0; l < lik_cpu::kSimdWidth; ++l) {
    int row, col;
    lik_cpu::fragment_slot(l, row, col);
    for (int e = 0; e < 2; ++e) {
      A[row][col + e] = all[l].a[e];
      B[row][col + e] = all[l].b[e];
      C[row][col + e] = all[l].c[e];
    }
  }
  int row, col;
  lik_cpu::fragment_slot(lik_cpu::lane_id(), row, col);
  for (int e = 0; e < 2; ++e) {
    float sum = C[row][col + e];
    for (int k = 0; k < 8; ++k) {
      sum += A[row][k] * B[k][col + e];
    }
    d.elements[e] = sum;
  }
}

inline float simd_sum(float x) {
  const auto all = lik_cpu::exchange("simd_sum", x);
  float sum = 0.0f;
  for (float value : all) {
    sum += value;
  }
  return sum;
}

template <typename T>
T shuffle_xor(const char* op, T x, ushort mask) {
  const auto all = lik_cpu::exchange(op, x);
  if (mask >= lik_cpu::kSimdWidth) {
    lik_cpu::fail(std::string(op) + " mask " + std::to_string(mask) + " leaves the simdgroup");
  }
  return all[lik_cpu::lane_id() ^ mask];
}

inline float simd_shuffle_xor(float x, ushort mask) {
  return shuffle_xor("simd_shuffle_xor(float)", x, mask);
}

inline int simd_shuffle_xor(int x, ushort mask) {
  return shuffle_xor("simd_shuffle_xor(int)", x, mask);
}

inline uint simd_shuffle(uint x, ushort lane) {
  const auto all = lik_cpu::exchange("simd_shuffle", x);
  if (lane >= lik_cpu::kSimdWidth) {
    lik_cpu::fail("simd_shuffle from lane " + std::to_string(lane));
  }
  return all[lane];
}

inline bool simd_any(bool x) {
  const auto all = lik_cpu::exchange("simd_any", x);
  for (bool value : all) {
    if (value) {
      return true;
    }
  }
  return false;
}

}  // namespace metal
