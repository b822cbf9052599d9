// A Python module (built by tests/test_cuda_emulated.py) that runs the CUDA kernels of
// csrc/cuda/codec_kernels.cuh, thc_kernels.cuh and topk_kernels.cuh on host threads through cuda_emulation.h, with the launch interface of
// lossless_hc._C_cuda: launch(name, grid, block, args, stream, cooperative).
#include "cuda_emulation.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/codec_kernels.cuh"
#include "cuda/thc_kernels.cuh"
#include "cuda/topk_kernels.cuh"

thread_local EmuThread emu_thread;

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

const std::vector<Entry>& table() {
  static const std::vector<Entry> t = {
#include "cuda/kernel_list.h"
  };
  return t;
}
#undef LHC_KERNEL

// Run blocks [first, first + count) of a grid of `grid` blocks concurrently, each on `block` threads.
void run_blocks(const Entry& e, unsigned first, unsigned count, unsigned grid, unsigned block,
                const std::vector<uint64_t>& args) {
  std::vector<std::unique_ptr<std::barrier<>>> syncs;
  std::vector<std::unique_ptr<EmuWarp[]>> warps;
  for (unsigned b = 0; b < count; ++b) {
    syncs.emplace_back(new std::barrier<>(block));
    warps.emplace_back(new EmuWarp[block / 32]);
  }
  std::vector<std::thread> threads;
  threads.reserve((size_t)count * block);
  for (unsigned b = 0; b < count; ++b)
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([&, b, t] {
        emu_thread.thread_index.x = t;
        emu_thread.block_index.x = first + b;
        emu_thread.block_dim.x = block;
        emu_thread.grid_dim.x = grid;
        emu_thread.block_sync = syncs[b].get();
        emu_thread.warp = &warps[b][t / 32];
        e.call(args.data());
      });
  for (auto& th : threads) th.join();
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
