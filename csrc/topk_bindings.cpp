// pybind11 bindings of the top-k selection (registered into lossless_hc._C by bindings.cpp).
// Tensors cross as raw addresses; lossless_hc/backends/cpu.py checks dtype, device, contiguity and sizes.
#include <pybind11/pybind11.h>

#include "cpu/topk_cpu.h"

namespace py = pybind11;
using namespace lhc;

void bind_topk(py::module_& m) {
  py::class_<cpu::TopkStats>(m, "TopkStats")
      .def_readonly("count", &cpu::TopkStats::count)
      .def_readonly("candidates", &cpu::TopkStats::candidates)
      .def_readonly("threshold", &cpu::TopkStats::threshold)
      .def_readonly("fallback", &cpu::TopkStats::fallback);

  m.def(
      "topk_select",
      [](uintptr_t x, uint64_t n, uint64_t k, uintptr_t out, int num_threads) {
        py::gil_scoped_release release;
        return cpu::topk_select(reinterpret_cast<const float*>(x), n, k, reinterpret_cast<int64_t*>(out),
                                num_threads);
      },
      py::arg("x"), py::arg("n"), py::arg("k"), py::arg("out"), py::arg("num_threads") = 0,
      "Indices (ascending, int64, into out) of the min(k, n) largest |x| (float32), ties to the lower index.");

  m.def(
      "topk_feedback",
      [](uintptr_t x, uintptr_t e, uint64_t n, uint64_t k, uintptr_t out, uintptr_t values, int num_threads) {
        py::gil_scoped_release release;
        return cpu::topk_feedback(reinterpret_cast<const float*>(x), reinterpret_cast<float*>(e), n, k,
                                  reinterpret_cast<int64_t*>(out), reinterpret_cast<float*>(values), num_threads);
      },
      py::arg("x"), py::arg("e"), py::arg("n"), py::arg("k"), py::arg("out"), py::arg("values"),
      py::arg("num_threads") = 0,
      "Top-k of a = x + e with error feedback: indices into out, a at them into values, e <- a with them zeroed.");
}
