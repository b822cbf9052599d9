// pybind11 bindings of the THC CPU kernels (registered into lossless_hc._C by bindings.cpp).
// Tensors cross as raw addresses; lossless_hc/thc.py checks dtype, device, contiguity and sizes.
#include <pybind11/pybind11.h>

#include "cpu/thc_cpu.h"
#include "lhc_layout.h"

namespace py = pybind11;
using namespace lhc;

namespace {
template <typename T>
T* at(uintptr_t address) { return reinterpret_cast<T*>(address); }
}  // namespace

void bind_thc(py::module_& m) {
  py::class_<ThcLayout>(m, "ThcLayout")
      .def(py::init<>())
      .def_readwrite("numel", &ThcLayout::numel)
      .def_readwrite("padded", &ThcLayout::padded)
      .def_readwrite("block", &ThcLayout::block)
      .def_readwrite("granularity", &ThcLayout::granularity)
      .def_readwrite("base", &ThcLayout::base)
      .def_readwrite("per_word", &ThcLayout::per_word)
      .def_readwrite("words", &ThcLayout::words);

  py::class_<cpu::ThcForwardStats>(m, "ThcForwardStats")
      .def_readonly("sum_squares", &cpu::ThcForwardStats::sum_squares)
      .def_readonly("non_finite", &cpu::ThcForwardStats::non_finite);

  m.def("thc_sign_stream", &thc_sign_stream, py::arg("seed"), py::arg("step"));
  m.def("thc_round_stream", &thc_round_stream, py::arg("seed"), py::arg("rank"), py::arg("step"));
  m.def("thc_sign_bits", &thc_sign_bits, py::arg("sign_stream"), py::arg("k"),
        "Sign bits of coordinates [64 k, 64 k + 64): bit j set = coordinate 64 k + j negated.");

  m.def(
      "thc_rht_forward",
      [](const ThcLayout& L, uint64_t sign_stream, uintptr_t x, uintptr_t e, uintptr_t y, int num_threads) {
        py::gil_scoped_release release;
        return cpu::thc_rht_forward(L, sign_stream, at<const float>(x), at<const float>(e), at<float>(y),
                                    num_threads);
      },
      py::arg("layout"), py::arg("sign_stream"), py::arg("x"), py::arg("e"), py::arg("y"), py::arg("num_threads") = 0,
      "y (padded floats) = RHT(x + e); e may be 0 (null). Returns the squared norm and a non-finite flag.");

  m.def(
      "thc_rht_inverse",
      [](const ThcLayout& L, uint64_t sign_stream, uintptr_t y, uintptr_t out, uintptr_t plus_a, uintptr_t plus_b,
         int num_threads) {
        py::gil_scoped_release release;
        cpu::thc_rht_inverse(L, sign_stream, at<float>(y), at<float>(out), at<const float>(plus_a),
                             at<const float>(plus_b), num_threads);
      },
      py::arg("layout"), py::arg("sign_stream"), py::arg("y"), py::arg("out"), py::arg("plus_a") = 0,
      py::arg("plus_b") = 0, py::arg("num_threads") = 0,
      "out (numel floats) = RHT^-1(y), or (plus_a + plus_b) - RHT^-1(y); y is destroyed.");

  m.def(
      "thc_quantize_pack",
      [](const ThcLayout& L, uintptr_t lo, uintptr_t width, uintptr_t inv_width, float scale, float threshold,
         float dequant_a, float dequant_b, uint64_t round_stream, uintptr_t y, bool write_back, int32_t word_kind,
         uintptr_t words, int num_threads) {
        py::gil_scoped_release release;
        cpu::ThcQuantizer q{at<const float>(lo), at<const float>(width), at<const float>(inv_width), scale, threshold,
                            dequant_a, dequant_b};
        cpu::thc_quantize_pack(L, q, round_stream, at<float>(y), write_back, word_kind, at<void>(words), num_threads);
      },
      py::arg("layout"), py::arg("lo"), py::arg("width"), py::arg("inv_width"), py::arg("scale"),
      py::arg("threshold"), py::arg("dequant_a"), py::arg("dequant_b"), py::arg("round_stream"), py::arg("y"),
      py::arg("write_back"), py::arg("word_kind"), py::arg("words"), py::arg("num_threads") = 0,
      "Stochastically round y onto the table and pack the levels into layout.words words.");

  m.def(
      "thc_unpack",
      [](const ThcLayout& L, int32_t word_kind, uintptr_t words, double multiplier, double a, double b, uintptr_t y,
         int num_threads) {
        py::gil_scoped_release release;
        return cpu::thc_unpack(L, word_kind, at<const void>(words), multiplier, a, b, at<float>(y), num_threads);
      },
      py::arg("layout"), py::arg("word_kind"), py::arg("words"), py::arg("multiplier"), py::arg("a"), py::arg("b"),
      py::arg("y"), py::arg("num_threads") = 0,
      "y[i] = digit_i * a + b for the digits of the aggregated words; returns the number of invalid words.");
}
