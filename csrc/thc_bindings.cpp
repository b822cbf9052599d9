// pybind11 bindings of the THC CPU kernels (registered into lossless_hc._C by bindings.cpp).
// Tensors cross as raw addresses; lossless_hc/thc/codec.py checks dtype, device, contiguity and sizes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

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
      .def_readwrite("group_blocks", &ThcLayout::group_blocks)
      .def_readwrite("words", &ThcLayout::words);
  // The layout ABI (lhc_layout.h ThcLayoutWord): the CPU kernels' ThcLayout from the words the CUDA kernels read.
  m.def("thc_layout_from_words", [](uintptr_t words) { return thc_layout_from_words(at<const uint64_t>(words)); });
  m.attr("THC_LAYOUT_WORDS") = (int)kThcLayoutWords;

  py::class_<cpu::ThcEncodeStats>(m, "ThcEncodeStats")
      .def_readonly("sum_squares", &cpu::ThcEncodeStats::sum_squares)
      .def_readonly("checksum", &cpu::ThcEncodeStats::checksum)
      .def_readonly("non_finite", &cpu::ThcEncodeStats::non_finite);

  py::class_<cpu::ThcDecodeStats>(m, "ThcDecodeStats")
      .def_readonly("bad_words", &cpu::ThcDecodeStats::bad_words)
      .def_readonly("checksum", &cpu::ThcDecodeStats::checksum);

  m.def(
      "thc_check_term",
      [](uint64_t prime, uint64_t c0, uint64_t k, uint64_t w, uint64_t S) {
        return thc_check_term(ThcCheck{prime, c0, k}, w, S);
      },
      py::arg("prime"), py::arg("c0"), py::arg("k"), py::arg("w"), py::arg("S"),
      "c_w * (S mod P) mod P: word w's term of the THC payload checksum (thc_math.h).");

  py::class_<cpu::ThcForwardStats>(m, "ThcForwardStats")
      .def_readonly("sum_squares", &cpu::ThcForwardStats::sum_squares)
      .def_readonly("non_finite", &cpu::ThcForwardStats::non_finite);

  m.def(
      "thc_cpu_isa",
      [](const std::string& request) {
        if (!request.empty() && !cpu::thc_set_cpu_isa(request == "default" ? "" : request.c_str())) {
          std::string runnable;
          for (const std::string& name : cpu::thc_cpu_isas()) runnable += "'" + name + "', ";
          throw py::value_error("this CPU cannot run the THC kernels for '" + request + "': request one of " +
                                runnable + "or 'default'");
        }
        return std::string(cpu::thc_cpu_isa());
      },
      py::arg("request") = "",
      "The copy of the THC CPU kernels in use: 'x86-64-v4', 'x86-64-v3' or 'portable' (the same bits). With "
      "request, switch to that copy first ('default': the best one, or LHC_CPU_ISA).");
  m.def("thc_cpu_isas", &cpu::thc_cpu_isas, "The copies of the THC CPU kernels this CPU runs, best first.");

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
      "thc_encode",
      [](const ThcLayout& L, bool quantize, uintptr_t lo, uintptr_t width, uintptr_t inv_width, float scale,
         float threshold, float dequant_a, float dequant_b, uint64_t sign_stream, uint64_t round_stream, uintptr_t x,
         uintptr_t e, int32_t word_kind, uintptr_t words, uint64_t check_prime, uint64_t check_c0, uint64_t check_k,
         int num_threads, uint64_t x_numel, uint64_t nb) {
        py::gil_scoped_release release;
        cpu::ThcQuantizer q{at<const float>(lo), at<const float>(width), at<const float>(inv_width), scale, threshold,
                            dequant_a, dequant_b};
        return cpu::thc_encode(L, quantize ? &q : nullptr, ThcCheck{check_prime, check_c0, check_k}, sign_stream,
                               round_stream, at<const float>(x), at<float>(e), word_kind, at<void>(words), num_threads,
                               x_numel, nb);
      },
      py::arg("layout"), py::arg("quantize"), py::arg("lo"), py::arg("width"), py::arg("inv_width"), py::arg("scale"),
      py::arg("threshold"), py::arg("dequant_a"), py::arg("dequant_b"), py::arg("sign_stream"),
      py::arg("round_stream"), py::arg("x"), py::arg("e"), py::arg("word_kind"), py::arg("words"),
      py::arg("check_prime"), py::arg("check_c0"), py::arg("check_k"), py::arg("num_threads") = 0,
      py::arg("x_numel") = 0, py::arg("nb") = 0,
      "RHT, stochastic rounding and packing of x + e into layout.words words; error feedback into e (may be 0); "
      "returns the squared norm, the words' checksum and the non-finite flag. nb > 0: x (x_numel floats) is "
      "encoded as its interleave into nb blocks (thc_interleave), read in place.");

  m.def(
      "thc_decode",
      [](const ThcLayout& L, uint64_t sign_stream, int32_t word_kind, uintptr_t words, double multiplier, double a,
         double b, uintptr_t out, uint64_t check_prime, uint64_t check_c0, uint64_t check_k, int num_threads,
         uint64_t out_numel, uint64_t nb) {
        py::gil_scoped_release release;
        return cpu::thc_decode(L, ThcCheck{check_prime, check_c0, check_k}, sign_stream, word_kind,
                               at<const void>(words), multiplier, a, b, at<float>(out), num_threads, out_numel, nb);
      },
      py::arg("layout"), py::arg("sign_stream"), py::arg("word_kind"), py::arg("words"), py::arg("multiplier"),
      py::arg("a"), py::arg("b"), py::arg("out"), py::arg("check_prime"), py::arg("check_c0"), py::arg("check_k"),
      py::arg("num_threads") = 0, py::arg("out_numel") = 0, py::arg("nb") = 0,
      "out = RHT^-1(digit * a + b) of aggregated words; returns the number of invalid words and their checksum. "
      "nb > 0: out (out_numel floats) receives its deinterleave (thc_deinterleave), written in place.");

  // The training interleave and its inverse take the same arguments.
  using Permute = void (*)(const float*, uint64_t, uint64_t, uint64_t, float*, int);
  const auto bind_permute = [&m](const char* name, Permute permute, const char* doc) {
    m.def(
        name,
        [permute](uintptr_t src, uint64_t numel, uint64_t nb, uint64_t block, uintptr_t dst, int num_threads) {
          py::gil_scoped_release release;
          permute(at<const float>(src), numel, nb, block, at<float>(dst), num_threads);
        },
        py::arg("src"), py::arg("numel"), py::arg("nb"), py::arg("block"), py::arg("dst"), py::arg("num_threads") = 0,
        doc);
  };
  bind_permute("thc_interleave", &cpu::thc_interleave,
               "dst[j * block + r] = src[r * nb + j] (zero past numel): the training interleave into nb blocks.");
  bind_permute("thc_deinterleave", &cpu::thc_deinterleave,
               "dst[i] = src[(i % nb) * block + i / nb] for i < numel: the inverse of thc_interleave.");

  m.def(
      "thc_pack_levels",
      [](const ThcLayout& L, uintptr_t levels, int32_t word_kind, uintptr_t words) {
        py::gil_scoped_release release;
        cpu::thc_pack_levels(L, at<const uint32_t>(levels), word_kind, at<void>(words));
      },
      py::arg("layout"), py::arg("levels"), py::arg("word_kind"), py::arg("words"));

  m.def(
      "thc_unpack_levels",
      [](const ThcLayout& L, int32_t word_kind, uintptr_t words, double multiplier, uintptr_t sums) {
        py::gil_scoped_release release;
        return cpu::thc_unpack_levels(L, word_kind, at<const void>(words), multiplier, at<float>(sums));
      },
      py::arg("layout"), py::arg("word_kind"), py::arg("words"), py::arg("multiplier"), py::arg("sums"));
}
