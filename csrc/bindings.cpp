// pybind11 bindings of the CPU kernels: tensors cross as raw addresses (uintptr_t) and sizes, so the
// module does not depend on the torch C++ ABI it runs beside. Python (lossless_hc/backends/cpu.py)
// checks dtype, device, contiguity and sizes before calling in.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "cpu/codec_cpu.h"
#include "lhc_layout.h"
#include "lhc_status.h"

namespace py = pybind11;
using namespace lhc;

void bind_thc(py::module_& m);   // thc_bindings.cpp
void bind_topk(py::module_& m);  // topk_bindings.cpp

namespace {
template <typename T>
T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "lossless_hc CPU kernels (OpenMP). Internal: use lossless_hc.LosslessCodec.";

  // The decode statuses of lhc_status.h as (name, code, message): lossless_hc.lhc.status.DecodeStatus.
  py::list statuses;
#define LHC_STATUS_ROW(cpp, code, py_name, msg) statuses.append(py::make_tuple(py_name, code, msg));
  LHC_DECODE_STATUSES(LHC_STATUS_ROW)
#undef LHC_STATUS_ROW
  m.attr("DECODE_STATUSES") = statuses;

  py::class_<SegmentedTable>(m, "SegmentedTable")
      .def(py::init<>())
      .def_readwrite("seg_len", &SegmentedTable::seg_len)
      .def_readwrite("seg_count", &SegmentedTable::seg_count)
      .def_readwrite("stream", &SegmentedTable::stream)
      .def_readwrite("weighted", &SegmentedTable::weighted);

  py::class_<DigitPacking>(m, "DigitPacking")
      .def(py::init<>())
      .def_readwrite("base", &DigitPacking::base)
      .def_readwrite("per_word", &DigitPacking::per_word)
      .def_readwrite("digits", &DigitPacking::digits);

  py::class_<CodecLayout>(m, "CodecLayout")
      .def(py::init<>())
      .def_readwrite("numel", &CodecLayout::numel)
      .def_readwrite("num_keys", &CodecLayout::num_keys)
      .def_readwrite("block", &CodecLayout::block)
      .def_readwrite("index_kind", &CodecLayout::index_kind)
      .def_readwrite("sketch", &CodecLayout::sketch)
      .def_readwrite("bloom", &CodecLayout::bloom)
      .def_readwrite("index", &CodecLayout::index)
      .def_readwrite("digit_cap", &CodecLayout::digit_cap)
      .def_readwrite("capacity", &CodecLayout::capacity)
      .def_readwrite("fingerprint", &CodecLayout::fingerprint)
      .def_readwrite("index_offset", &CodecLayout::index_offset)
      .def_readwrite("sketch_offset", &CodecLayout::sketch_offset)
      .def_readwrite("payload_numel", &CodecLayout::payload_numel)
      .def_readwrite("fine_levels", &CodecLayout::fine_levels)
      .def(
          "set_fine_level",
          [](CodecLayout& L, uint32_t l, const SegmentedTable& table, uint64_t span, uint32_t digits, uint32_t words,
             uint64_t offset) {
            if (l >= kMaxFineLevels) throw std::out_of_range("fine level index");
            L.fine[l] = table;
            L.span[l] = span;
            L.fine_digits[l] = digits;
            L.fine_words[l] = words;
            L.fine_offset[l] = offset;
          },
          py::arg("level"), py::arg("table"), py::arg("span"), py::arg("digits"), py::arg("words"), py::arg("offset"));

  py::class_<cpu::EncodeStats>(m, "EncodeStats")
      .def_readonly("keys", &cpu::EncodeStats::keys)
      .def_readonly("non_finite", &cpu::EncodeStats::non_finite)
      .def_readonly("saturated", &cpu::EncodeStats::saturated);

  py::class_<cpu::DecodeStats>(m, "DecodeStats")
      .def_readonly("status", &cpu::DecodeStats::status)
      .def_readonly("candidates", &cpu::DecodeStats::candidates)
      .def_readonly("false_positives", &cpu::DecodeStats::false_positives)
      .def_readonly("support_keys", &cpu::DecodeStats::support_keys)
      .def_readonly("peeled", &cpu::DecodeStats::peeled)
      .def_readonly("index_total", &cpu::DecodeStats::index_total);

  m.def(
      "encode",
      [](const CodecLayout& layout, uintptr_t x, uintptr_t payload, int num_threads) {
        py::gil_scoped_release release;
        return cpu::encode(layout, ptr<const float>(x), ptr<float>(payload), num_threads);
      },
      py::arg("layout"), py::arg("x"), py::arg("payload"), py::arg("num_threads") = 0,
      "Encode layout.numel float32 values at address x into layout.payload_numel floats at payload.");

  m.def(
      "decode",
      [](const CodecLayout& layout, double scale, uint64_t total_keys, uint64_t world_size, uintptr_t payload,
         uintptr_t out, uintptr_t trace_key, uintptr_t trace_cell, int num_threads) {
        py::gil_scoped_release release;
        cpu::DecodeInputs in{scale, total_keys, world_size};
        return cpu::decode(layout, in, ptr<const float>(payload), ptr<float>(out), ptr<int64_t>(trace_key),
                           ptr<int64_t>(trace_cell), num_threads);
      },
      py::arg("layout"), py::arg("scale"), py::arg("total_keys"), py::arg("world_size"), py::arg("payload"),
      py::arg("out"), py::arg("trace_key") = 0, py::arg("trace_cell") = 0, py::arg("num_threads") = 0,
      "Decode an aggregated payload into layout.numel float32 values at out.");

  m.def(
      "advise_huge_pages", [](uintptr_t address, uint64_t bytes) { cpu::advise_huge_pages(ptr<void>(address), bytes); },
      py::arg("address"), py::arg("bytes"),
      "Advise that the whole 2 MiB pages of a buffer not written yet be backed by transparent huge pages.");

  m.attr("HEADER_FIELDS") = (int)kHeaderFields;
  m.attr("INT_FIELD_BITS") = (int)kIntFieldBits;

  bind_thc(m);
  bind_topk(m);
}
