// A Python module (built by tests/test_cuda_emulated.py) that runs the CUDA kernels of
// csrc/cuda/codec_kernels.cuh, thc_kernels.cuh and topk_kernels.cuh on the host through cuda_emulation.h
// (each CUDA thread a fiber; the scheduler below), with the launch interface of lossless_hc._C_cuda:
// launch(name, grid, block, args, stream, cooperative).
#include "cuda_emulation.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/codec_kernels.cuh"
#include "cuda/thc_kernels.cuh"
#include "cuda/topk_kernels.cuh"

thread_local EmuThread* emu_thread = nullptr;

namespace {

// -- Fibers and their scheduler ----------------------------------------------------------------------
//
// One launch's threads run as fibers on the launching host thread. The scheduler resumes a runnable
// fiber picked at random; the fiber runs until it gives way (emu_yield: it stays runnable), blocks at
// a barrier (runnable again when the last one arrives), or returns. Picks come from a SplitMix64
// stream seeded per launch.

constexpr size_t kStackBytes = 256 << 10;  // kernels keep a few scalars and small arrays per thread

struct Fiber {
  ucontext_t context;
  EmuThread thread;
  char* stack = nullptr;  // kStackBytes, the lowest page a guard (PROT_NONE): an overflow faults
};

struct Scheduler {
  ucontext_t main;
  std::vector<Fiber*> runnable;
  Fiber* current = nullptr;
  uint64_t state;  // SplitMix64
  const std::function<void(const uint64_t*)>* call;
  const uint64_t* args;
  size_t finished = 0;

  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Back to the scheduler; the fiber resumes here when picked again.
  void leave() { swapcontext(&current->context, &main); }
};
thread_local Scheduler* scheduler = nullptr;

// The stacks, kept across launches (mapping and faulting in fresh ones would cost more than a launch).
std::vector<char*>& stack_pool() {
  static thread_local std::vector<char*> pool;
  return pool;
}
char* take_stack() {
  auto& pool = stack_pool();
  if (!pool.empty()) {
    char* s = pool.back();
    pool.pop_back();
    return s;
  }
  void* m = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::runtime_error("cuda emulation: no memory for a fiber's stack");
  mprotect(m, 4096, PROT_NONE);
  return static_cast<char*>(m);
}

void fiber_main() {
  Scheduler* s = scheduler;
  (*s->call)(s->args);
  ++s->finished;
}  // returns to the scheduler through uc_link

// A launch's schedule seed: SplitMix64 of (base + the launch's number in this process), base from
// LHC_CUDA_EMULATION_SEED when set (to replay a run's schedules), otherwise drawn at random.
struct LaunchSeeds {
  uint64_t base = 0, launches = 0;
  std::mutex mutex;
  LaunchSeeds() {
    const char* fixed = std::getenv("LHC_CUDA_EMULATION_SEED");
    base = fixed ? std::strtoull(fixed, nullptr, 0) : ((uint64_t)std::random_device{}() << 32 | std::random_device{}());
  }
};
LaunchSeeds& launch_seeds() {
  static LaunchSeeds seeds;
  return seeds;
}

}  // namespace

void emu_yield() {
  Scheduler* s = scheduler;
  s->runnable.push_back(s->current);
  s->leave();
}

void emu_maybe_yield() {
  if (scheduler->next() >> 63) emu_yield();
}

void EmuBarrier::arrive_and_wait() {
  Scheduler* s = scheduler;
  if (++arrived < expected) {
    waiting.push_back(s->current);
    s->leave();
    return;
  }
  // The last arrival opens the next phase; who runs first after the barrier is the scheduler's pick.
  arrived = 0;
  for (void* f : waiting) s->runnable.push_back(static_cast<Fiber*>(f));
  waiting.clear();
  emu_yield();
}

namespace {

template <typename... A>
constexpr int arity_of(void (*)(A...)) { return (int)sizeof...(A); }

template <typename... A, size_t... I>
void invoke(void (*f)(A...), const uint64_t* w, std::index_sequence<I...>) {
  f(emu_narrow<A>(w[I])...);
}

struct Entry {
  const char* name;
  std::function<void(const uint64_t*)> call;
  int arity;
};

#define LHC_KERNEL(k)                                                                                   \
  Entry {                                                                                               \
    #k, [](const uint64_t* w) { invoke(&lhc::gpu::k, w, std::make_index_sequence<arity_of(&lhc::gpu::k)>{}); }, \
        arity_of(&lhc::gpu::k)                                                                          \
  },

}  // namespace

// Two kernels that test the emulation itself (tests/test_cuda_emulated.py), beside csrc's list.
namespace lhc {
namespace gpu {
// Each thread takes the next slot with an atomic and writes its global index there: out is the order
// of the threads' atomics.
__global__ void emu_selftest_atomic_order(unsigned int* counter, unsigned int* out) {
  out[atomicAdd(counter, 1u)] = blockIdx.x * blockDim.x + threadIdx.x;
}
// The odd threads return before the barrier the even ones wait at: a hang on a GPU.
__global__ void emu_selftest_barrier_skipped(unsigned int* out) {
  if (threadIdx.x & 1) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
}  // namespace gpu
}  // namespace lhc

namespace {

const std::vector<Entry>& table() {
  static const std::vector<Entry> t = {
#include "cuda/kernel_list.h"
      LHC_KERNEL(emu_selftest_atomic_order) LHC_KERNEL(emu_selftest_barrier_skipped)
  };
  return t;
}
#undef LHC_KERNEL

// Run blocks [first, first + count) of a grid of `grid` blocks together, each on `block` threads (fibers).
void run_blocks(const Entry& e, unsigned first, unsigned count, unsigned grid, unsigned block,
                const std::vector<uint64_t>& args) {
  std::vector<EmuBarrier> syncs(count, EmuBarrier(block));  // sized once: the fibers keep pointers
  std::vector<std::vector<EmuWarp>> warps(count, std::vector<EmuWarp>(block / 32));
  std::vector<Fiber> fibers((size_t)count * block);
  uint64_t base, number;
  {
    LaunchSeeds& seeds = launch_seeds();
    std::lock_guard<std::mutex> lock(seeds.mutex);
    base = seeds.base;
    number = seeds.launches++;
  }
  Scheduler s{};
  s.state = base + number;
  s.next();  // mixes base and number into the first pick
  s.call = &e.call;
  s.args = args.data();
  for (unsigned b = 0; b < count; ++b)
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[(size_t)b * block + t];
      f.thread.thread_index.x = t;
      f.thread.block_index.x = first + b;
      f.thread.block_dim.x = block;
      f.thread.grid_dim.x = grid;
      f.thread.block_sync = &syncs[b];
      f.thread.warp = &warps[b][t / 32];
      f.stack = take_stack();
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &s.main;
      makecontext(&f.context, fiber_main, 0);
      s.runnable.push_back(&f);
    }
  scheduler = &s;
  while (!s.runnable.empty()) {
    const size_t pick = s.next() % s.runnable.size();
    s.current = s.runnable[pick];
    s.runnable[pick] = s.runnable.back();
    s.runnable.pop_back();
    emu_thread = &s.current->thread;
    swapcontext(&s.main, &s.current->context);
  }
  scheduler = nullptr;
  emu_thread = nullptr;
  const size_t stuck = fibers.size() - s.finished;
  // A stuck fiber's stack holds no object that needs destroying (kernels keep scalars): it is reused.
  for (Fiber& f : fibers) stack_pool().push_back(f.stack);
  if (stuck)
    throw std::runtime_error(e.name + std::string(": ") + std::to_string(stuck) + " of " +
                             std::to_string(fibers.size()) +
                             " threads wait at a barrier the others never reach (deadlock; schedule: launch " +
                             std::to_string(number) + " of LHC_CUDA_EMULATION_SEED=" + std::to_string(base) + ")");
}

void launch(const std::string& name, uint64_t grid, uint32_t block, const std::vector<uint64_t>& args, uintptr_t,
            bool cooperative) {
  for (const auto& e : table()) {
    if (name != e.name) continue;
    if ((int)args.size() != e.arity)
      throw std::runtime_error(name + " takes " + std::to_string(e.arity) + " arguments, got " +
                               std::to_string(args.size()));
    if (block % 32 != 0) throw std::runtime_error(name + ": block size must be a multiple of 32");
    if (cooperative) {
      run_blocks(e, 0, (unsigned)grid, (unsigned)grid, block, args);
    } else {
      for (unsigned b = 0; b < grid; ++b) run_blocks(e, b, 1, (unsigned)grid, block, args);
    }
    return;
  }
  throw std::runtime_error("no kernel named " + name);
}

}  // namespace

PYBIND11_MODULE(_lhc_cuda_emulated, m) {
  m.def("launch", &launch, pybind11::arg("name"), pybind11::arg("grid"), pybind11::arg("block"),
        pybind11::arg("args"), pybind11::arg("stream"), pybind11::arg("cooperative") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("kernel_names", [] {
    std::vector<std::string> out;
    for (const auto& e : table()) out.emplace_back(e.name);
    return out;
  });
}
