// cuda_emulation.h -- just enough of the CUDA device builtins, in plain C++20 on the host, to run
// csrc/cuda/codec_kernels.cuh on a machine without a GPU (tests/test_cuda_emulated.py).
//
// Each CUDA thread of a launch is a fiber (its own stack, a ucontext) on the launching host thread. A
// fiber runs until it waits at a barrier (__syncthreads, a full-mask warp intrinsic) or gives way (at
// __nanosleep; with probability 1/2 before an atomic or __ldcg); the scheduler (emulated_kernels.cpp)
// then resumes a runnable fiber picked at random, from a seed drawn per launch
// (LHC_CUDA_EMULATION_SEED fixes the sequence): the order of the threads' atomics and of their passes
// through barriers varies from launch to launch, as on a GPU, without the cost of an OS thread per
// CUDA thread. A barrier that some threads never reach is reported as an error instead of a hang.
// Blocks of an ordinary launch run one after another (their threads interleaved), so `__shared__` can
// be a function-level static; a cooperative launch runs all blocks at once (its kernels use no shared
// memory). Warp intrinsics with a full mask exchange values through a per-warp barrier;
// __activemask() reports only the calling lane, which is a legal answer on real hardware too (threads
// may diverge), so warp-aggregated atomics degrade to one atomic per thread. Atomics are GCC __atomic
// builtins on the raw memory.
//
// This checks the kernels' logic and the launch sequence (sizes, arguments, ordering, determinism
// under varied orders of the threads' synchronizing operations); it says nothing about performance,
// and neither data races between two synchronization points (a fiber is never interrupted between
// them) nor the memory-model subtleties of real GPUs are within its reach (compute-sanitizer's
// racecheck on a GPU is: scripts/gpu_session.sh).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct EmuDim {
  unsigned int x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned int x, y, z, w;
};

// The scheduler's side (emulated_kernels.cpp): the running fiber gives way to another runnable one
// (emu_yield), or with probability 1/2 (emu_maybe_yield, before each atomic and __ldcg).
void emu_yield();
void emu_maybe_yield();

// A barrier of `expected` fibers: the last to arrive makes the others runnable again.
struct EmuBarrier {
  explicit EmuBarrier(unsigned expected_) : expected(expected_) {}
  void arrive_and_wait();  // emulated_kernels.cpp
  unsigned expected, arrived = 0;
  std::vector<void*> waiting;  // the fibers blocked in this phase
};

// Per-warp exchange for full-mask intrinsics.
struct EmuWarp {
  EmuBarrier sync{32};
  uint64_t slot[32];
};

struct EmuThread {
  EmuDim thread_index, block_index, block_dim, grid_dim;
  EmuBarrier* block_sync = nullptr;
  EmuWarp* warp = nullptr;
};
extern thread_local EmuThread* emu_thread;  // the running fiber's

#define threadIdx (emu_thread->thread_index)
#define blockIdx (emu_thread->block_index)
#define blockDim (emu_thread->block_dim)
#define gridDim (emu_thread->grid_dim)

inline void __syncthreads() { emu_thread->block_sync->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { emu_yield(); }

template <typename To, typename From>
inline To emu_bits(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
inline unsigned int __float_as_uint(float f) { return emu_bits<unsigned int>(f); }
inline float __uint_as_float(unsigned int u) { return emu_bits<float>(u); }
inline float __int_as_float(int i) { return emu_bits<float>(i); }
inline int __ffs(unsigned int v) { return __builtin_ffs((int)v); }
inline int __popc(unsigned int v) { return __builtin_popcount(v); }

template <typename T>
inline T __ldcg(const T* p) {  // data other blocks write: a point where another thread may run first
  emu_maybe_yield();
  T v;
  __atomic_load(p, &v, __ATOMIC_ACQUIRE);
  return v;
}
template <typename T>
inline T __ldcs(const T* p) { return *p; }

inline unsigned int __activemask() { return 1u << (threadIdx.x & 31); }

// Full-mask exchange: every lane publishes `v`, then reads lane `from`'s value.
inline uint64_t emu_exchange(uint64_t v, int from) {
  EmuWarp* w = emu_thread->warp;
  const int lane = threadIdx.x & 31;
  w->slot[lane] = v;
  w->sync.arrive_and_wait();
  const uint64_t got = w->slot[from];
  w->sync.arrive_and_wait();
  return got;
}
inline bool emu_alone(unsigned int mask) { return mask == (1u << (threadIdx.x & 31)); }

inline unsigned int __reduce_add_sync(unsigned int mask, unsigned int v) {
  if (emu_alone(mask)) return v;
  EmuWarp* w = emu_thread->warp;
  const int lane = threadIdx.x & 31;
  w->slot[lane] = v;
  w->sync.arrive_and_wait();
  unsigned int sum = 0;
  for (int i = 0; i < 32; ++i) sum += (unsigned int)w->slot[i];
  w->sync.arrive_and_wait();
  return sum;
}
template <typename T>
inline uint64_t emu_widen(T v) {
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(T));
  return w;
}
template <typename T>
inline T emu_narrow(uint64_t w) {
  T v;
  std::memcpy(&v, &w, sizeof(T));
  return v;
}
template <typename T>
inline T __shfl_up_sync(unsigned int mask, T v, int d) {
  if (emu_alone(mask)) return v;
  const int lane = threadIdx.x & 31;
  return emu_narrow<T>(emu_exchange(emu_widen(v), lane >= d ? lane - d : lane));
}
template <typename T>
inline T __shfl_sync(unsigned int mask, T v, int from) {
  if (emu_alone(mask)) return v;
  return emu_narrow<T>(emu_exchange(emu_widen(v), from));
}

// Atomics: return the old value, as CUDA's do. Each may first give way to another thread, so that the
// threads' atomics on one address interleave in varied orders.
template <typename T>
inline T emu_cas_update(T* p, T (*op)(T, T), T v) {
  emu_maybe_yield();
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(p, &old, op(old, v), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline float atomicAdd(float* p, float v) {
  emu_maybe_yield();
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(u, &old, __float_as_uint(__uint_as_float(old) + v), false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  return __uint_as_float(old);
}
template <typename T>
inline T emu_fetch_add(T* p, T v) {
  emu_maybe_yield();
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return emu_fetch_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return emu_fetch_add(p, v); }
template <typename T>
inline T emu_fetch_sub(T* p, T v) {
  emu_maybe_yield();
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicSub(int* p, int v) { return emu_fetch_sub(p, v); }
inline unsigned int atomicSub(unsigned int* p, unsigned int v) { return emu_fetch_sub(p, v); }
inline unsigned int atomicXor(unsigned int* p, unsigned int v) {
  emu_maybe_yield();
  return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
  emu_maybe_yield();
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicExch(unsigned int* p, unsigned int v) {
  emu_maybe_yield();
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicMin(unsigned int* p, unsigned int v) {
  return emu_cas_update<unsigned int>(p, [](unsigned int a, unsigned int b) { return a < b ? a : b; }, v);
}
