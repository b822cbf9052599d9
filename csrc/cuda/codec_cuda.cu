// The kernel table and launcher of lossless_hc._C_cuda (see codec_cuda.h). The kernels themselves
// live in codec_kernels.cuh (and thc_kernels.cuh for THC), which the CuPy run-time path compiles unchanged through NVRTC.
#include "codec_cuda.h"

#include <cuda_runtime.h>

#include <cstring>

#include "codec_kernels.cuh"
#include "thc_kernels.cuh"
#include "topk_kernels.cuh"

namespace lhc {
namespace cuda {
namespace {

template <typename... Args>
constexpr int arity(void (*)(Args...)) {
  static_assert(((sizeof(Args) == 8) && ...), "every kernel parameter must be 8 bytes (see codec_kernels.cuh)");
  return (int)sizeof...(Args);
}

struct KernelEntry {
  const char* name;
  const void* func;
  int arity;
};

#define LHC_KERNEL(k) KernelEntry{#k, reinterpret_cast<const void*>(&gpu::k), arity(&gpu::k)},

const KernelEntry kKernels[] = {
#include "kernel_list.h"
};
#undef LHC_KERNEL

const KernelEntry* find(const std::string& name) {
  for (const auto& k : kKernels)
    if (name == k.name) return &k;
  return nullptr;
}

}  // namespace

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (const auto& k : kKernels) out.emplace_back(k.name);
  return out;
}

int kernel_arity(const std::string& name) {
  const KernelEntry* k = find(name);
  return k ? k->arity : -1;
}

std::string launch(const std::string& name, uint64_t grid, uint32_t block, const std::vector<uint64_t>& args,
                   uintptr_t stream, bool cooperative) {
  const KernelEntry* k = find(name);
  if (!k) return "no kernel named " + name;
  if ((int)args.size() != k->arity)
    return name + " takes " + std::to_string(k->arity) + " arguments, got " + std::to_string(args.size());
  if (grid == 0) return "";
  if (grid > 0x7fffffffULL) return name + ": grid of " + std::to_string(grid) + " blocks is too large";
  // The kernel reads each parameter from the address given: the words themselves (pointers,
  // integers and doubles are all 8 bytes, copied bit for bit).
  std::vector<uint64_t> words(args);
  std::vector<void*> params(words.size());
  for (size_t i = 0; i < words.size(); ++i) params[i] = &words[i];
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const cudaError_t err =
      cooperative ? cudaLaunchCooperativeKernel(k->func, dim3((unsigned)grid), dim3(block), params.data(), 0, s)
                  : cudaLaunchKernel(k->func, dim3((unsigned)grid), dim3(block), params.data(), 0, s);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free launch error so later calls are not blamed
    return name + ": " + cudaGetErrorString(err);
  }
  return "";
}

int max_active_blocks(const std::string& name, uint32_t block) {
  const KernelEntry* k = find(name);
  if (!k) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k->func, (int)block, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return blocks;
}

int multiprocessors() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sms;
}

}  // namespace cuda
}  // namespace lhc
