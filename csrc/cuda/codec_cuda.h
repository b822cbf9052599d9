// Host-side launcher of the CUDA kernels (csrc/cuda/codec_kernels.cuh and thc_kernels.cuh), compiled
// by nvcc into lossless_hc._C_cuda. A plain C++ interface (no CUDA headers, no framework types) so the pybind11
// bindings compile with the host compiler. Kernels are named by their extern "C" name; each takes
// only 8-byte parameters, passed here as an array of 64-bit words.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lhc {
namespace cuda {

// Names of every kernel the module holds, in table order.
std::vector<std::string> kernel_names();

// Number of parameters of kernel `name` (-1 if there is no such kernel).
int kernel_arity(const std::string& name);

// Launch kernel `name` on `stream` (a cudaStream_t as an integer; 0 is the legacy default stream).
// `cooperative` uses cudaLaunchCooperativeKernel (every block resident: required by kernels with a
// grid barrier). Returns "" on success, else the CUDA error text. Never synchronises.
std::string launch(const std::string& name, uint64_t grid, uint32_t block, const std::vector<uint64_t>& args,
                   uintptr_t stream, bool cooperative);

// Blocks of `block` threads of kernel `name` that fit on one multiprocessor at once (0 on error).
int max_active_blocks(const std::string& name, uint32_t block);

// Multiprocessors of the current device (0 on error).
int multiprocessors();

}  // namespace cuda
}  // namespace lhc
