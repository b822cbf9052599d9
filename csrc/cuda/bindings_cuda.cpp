// pybind11 bindings of lossless_hc._C_cuda: launch the CUDA kernels by name with 64-bit argument
// words on a stream given as an integer. Tensors cross as raw device addresses (data_ptr()) and the
// stream as torch.cuda.current_stream().cuda_stream, so the module does not depend on the torch
// build it runs beside. The launch sequence lives in lossless_hc/backends/cuda_lhc.py (shared with the CuPy path).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "codec_cuda.h"

namespace py = pybind11;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "lossless_hc CUDA kernels (compiled). Internal: use lossless_hc.LosslessCodec(device='cuda').";

  m.def("kernel_names", &lhc::cuda::kernel_names, "Names of the kernels this module holds.");
  m.def("kernel_arity", &lhc::cuda::kernel_arity, py::arg("name"), "Parameters of a kernel (-1: unknown).");
  m.def(
      "launch",
      [](const std::string& name, uint64_t grid, uint32_t block, const std::vector<uint64_t>& args, uintptr_t stream,
         bool cooperative) {
        const std::string err = lhc::cuda::launch(name, grid, block, args, stream, cooperative);
        if (!err.empty()) throw std::runtime_error("lossless_hc CUDA launch failed: " + err);
      },
      py::arg("name"), py::arg("grid"), py::arg("block"), py::arg("args"), py::arg("stream"),
      py::arg("cooperative") = false,
      "Launch a kernel asynchronously on `stream`; args are 64-bit words (addresses, integers, double bits).");
  m.def("max_active_blocks", &lhc::cuda::max_active_blocks, py::arg("name"), py::arg("block"),
        "Resident blocks per multiprocessor of a kernel at this block size (0 on error).");
  m.def("multiprocessors", &lhc::cuda::multiprocessors, "Multiprocessors of the current device (0 on error).");
}
