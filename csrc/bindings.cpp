// pybind11 bindings of the CPU kernels: tensors cross as raw addresses (uintptr_t) and sizes, so the
// module does not depend on the torch C++ ABI it runs beside. Python (lossless_hc/backends/cpu.py)
// checks dtype, device, contiguity and sizes before calling in.
#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>

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

// The CodecLayout of the layout words at `words` (lhc_layout.h LayoutWord; the CPU backend keeps them
// in a CPU int64 tensor), read with the GIL held so that a bad one raises.
CodecLayout layout_at(uintptr_t words) {
  const CodecLayout L = layout_from_words(ptr<const uint64_t>(words));
  if (L.fine_levels > kMaxFineLevels) throw std::out_of_range("layout words: more fine levels than kMaxFineLevels");
  return L;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "lossless_hc CPU kernels (OpenMP). Internal: use lossless_hc.LosslessCodec.";

  // The decode statuses of lhc_status.h as (name, code, message): lossless_hc.lhc.status.DecodeStatus.
  py::list statuses;
#define LHC_STATUS_ROW(cpp, code, py_name, msg) statuses.append(py::make_tuple(py_name, code, msg));
  LHC_DECODE_STATUSES(LHC_STATUS_ROW)
#undef LHC_STATUS_ROW
  m.attr("DECODE_STATUSES") = statuses;

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
      .def_readonly("index_total", &cpu::DecodeStats::index_total)
      // The sorted keys failing rtol, as the bytes of little-endian int64s (torch.frombuffer reads them).
      .def_property_readonly("inexact_keys_bytes", [](const cpu::DecodeStats& st) {
        return py::bytes(reinterpret_cast<const char*>(st.inexact_keys.data()), 8 * st.inexact_keys.size());
      });

  m.def(
      "lhc_peel_batch",
      [](const std::string& request) {
        if (!request.empty() && !cpu::value_peel_batch_set(request.c_str()))
          throw py::value_error("the value peel's eight-key step is 'on', 'off' or 'default', not '" + request + "'");
        return cpu::value_peel_batch_on();
      },
      py::arg("request") = "",
      "Whether the LHC value peel's eight-key AVX-512 step is on (it runs only under THC's x86-64-v4 copy; the same "
      "bits as key by key). With request ('on', 'off', 'default': LHC_PEEL_BATCH, else on unless the CPU is AMD's), "
      "set it first.");
  m.def("release_decoder_memory", &cpu::release_decoder_memory,
        "Free the working memory the CPU decoder kept for the next decode: the calling thread's and its "
        "OpenMP pool's.");
  m.def(
      "encode",
      [](uintptr_t words, uintptr_t x, uintptr_t payload, int num_threads) {
        const CodecLayout layout = layout_at(words);
        py::gil_scoped_release release;
        return cpu::encode(layout, ptr<const float>(x), ptr<float>(payload), num_threads);
      },
      py::arg("words"), py::arg("x"), py::arg("payload"), py::arg("num_threads") = 0,
      "Encode numel float32 values at address x into payload_numel floats at payload (the layout: the\n"
      "layout words at address `words`).");

  m.def(
      "decode",
      [](uintptr_t words, double scale, uint64_t total_keys, uint64_t world_size, uintptr_t payload, uintptr_t out,
         uintptr_t trace_key, uintptr_t trace_cell, int num_threads, double rtol,
         bool verify, uintptr_t bound_keys, uintptr_t bounds, uint64_t bound_capacity) {
        const CodecLayout layout = layout_at(words);
        py::gil_scoped_release release;
        cpu::DecodeInputs in{scale, total_keys, world_size, rtol, verify};
        const cpu::KeyBounds key_bounds{ptr<int64_t>(bound_keys), ptr<double>(bounds), bound_capacity};
        return cpu::decode(layout, in, ptr<const float>(payload), ptr<float>(out), ptr<int64_t>(trace_key),
                           ptr<int64_t>(trace_cell), bounds ? &key_bounds : nullptr, num_threads);
      },
      py::arg("words"), py::arg("scale"), py::arg("total_keys"), py::arg("world_size"), py::arg("payload"),
      py::arg("out"), py::arg("trace_key") = 0, py::arg("trace_cell") = 0, py::arg("num_threads") = 0,
      py::arg("rtol") = 0.0, py::arg("verify") = false, py::arg("bound_keys") = 0, py::arg("bounds") = 0,
      py::arg("bound_capacity") = 0,
      "Decode an aggregated payload into numel float32 values at out (the layout: the layout words at `words`);\n"
      "with `bounds`, each support key's error bound goes to bounds[i] and its key to bound_keys[i]\n"
      "(int64 and float64 arrays of bound_capacity entries; see lhc::cpu::KeyBounds).");

  m.def(
      "advise_huge_pages", [](uintptr_t address, uint64_t bytes) { cpu::advise_huge_pages(ptr<void>(address), bytes); },
      py::arg("address"), py::arg("bytes"),
      "Advise that the whole 2 MiB pages of a buffer not written yet be backed by transparent huge pages.");

  m.def(
      "nonzero_rows",
      [](uintptr_t x, uint64_t rows, uint64_t row, int element_bytes, uintptr_t present, int num_threads) {
        if (element_bytes != 2 && element_bytes != 4 && element_bytes != 8)
          throw std::invalid_argument("nonzero_rows: element_bytes must be 2, 4 or 8");
        py::gil_scoped_release release;
        return cpu::nonzero_rows(ptr<const void>(x), rows, row, element_bytes, ptr<uint8_t>(present), num_threads);
      },
      py::arg("x"), py::arg("rows"), py::arg("row"), py::arg("element_bytes"), py::arg("present"),
      py::arg("num_threads") = 0,
      "present[r] (uint8/bool at address present) = whether row r of the rows x row matrix at x (elements of\n"
      "element_bytes bytes, contiguous) holds an element that is not +-0.0 (NaN and infinities count);\n"
      "returns how many rows do.");

  m.def(
      "present_row_index",
      [](uintptr_t present, uint64_t rows, uintptr_t index) {
        py::gil_scoped_release release;
        cpu::present_row_index(ptr<const uint8_t>(present), rows, ptr<int64_t>(index));
      },
      py::arg("present"), py::arg("rows"), py::arg("index"),
      "index (int64, as many entries as present has non-zero flags) = the rows r < rows whose flag\n"
      "present[r] (uint8/bool, 0 or 1) is set, increasing.");

  m.def(
      "dense_copy_count",
      [](uintptr_t src, uintptr_t dst, uint64_t n, uint64_t block, uintptr_t counts, int num_threads) {
        if (block == 0) throw py::value_error("dense_copy_count: block must be >= 1");
        py::gil_scoped_release release;
        uint64_t c[2];
        cpu::dense_copy_count(ptr<const float>(src), dst ? ptr<float>(dst) : nullptr, n, block, c, num_threads);
        std::memcpy(ptr<int64_t>(counts), c, sizeof c);
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("block"), py::arg("counts"), py::arg("num_threads") = 0,
      "dst[i] = src[i] for i < n (float32; dst 0: count only); counts[0] (int64 at address counts) = the\n"
      "blocks of `block` elements (the last one partial) holding one that is not +-0.0, counts[1] = the\n"
      "elements that are not finite.");

  m.def(
      "pack_row_slots",
      [](uintptr_t src, uint64_t src_rows, bool gather, uintptr_t index, uint64_t m, uint64_t row, uint64_t k,
         uintptr_t slots) {
        bool ok;
        {
          py::gil_scoped_release release;
          ok = cpu::pack_row_slots(ptr<const float>(src), src_rows, gather, ptr<const int64_t>(index), m, row, k,
                                   ptr<float>(slots));
        }
        if (!ok) throw std::invalid_argument("pack_row_slots: more rows than slots, or a row outside [0, rows)");
      },
      py::arg("src"), py::arg("src_rows"), py::arg("gather"), py::arg("index"), py::arg("m"), py::arg("row"),
      py::arg("k"), py::arg("slots"),
      "A rank's k allgather slots (float32, 1 + row words each) at slots: the m rows index (int64) labels,\n"
      "each slot's values row index[s] (gather) or row s of the float32 rows at src; then unused slots\n"
      "(label -1, zeros).");

  m.def(
      "sum_row_slots",
      [](uintptr_t slots, uint64_t n, uint64_t per_rank, uint64_t row, uintptr_t out, uint64_t keys, uintptr_t stale,
         uint64_t stale_count, uint32_t divisor, bool count) {
        int64_t rows;
        {
          py::gil_scoped_release release;
          rows = cpu::sum_row_slots(ptr<const float>(slots), n, per_rank, row, ptr<float>(out), keys,
                                    ptr<const int64_t>(stale), stale_count, divisor, count);
        }
        if (rows < 0) throw std::invalid_argument("sum_row_slots: a gathered or stale row outside [0, keys)");
        return rows;
      },
      py::arg("slots"), py::arg("n"), py::arg("per_rank"), py::arg("row"), py::arg("out"), py::arg("keys"),
      py::arg("stale"), py::arg("stale_count"), py::arg("divisor"), py::arg("count"),
      "The n ranks' gathered row slots (float32, 1 + row words each, per_rank a rank) added in rank order into\n"
      "the keys x row float32 table at out, its rows stale[0, stale_count) (int64) cleared first; with count,\n"
      "returns the rows some rank sent and divides them by divisor (> 1).");

  // The two-phase counting bitmap (cpu/codec_cpu.h): base and per_word as lhc.layout.digit_packing gives them.
  auto packing = [](uint64_t keys, uint32_t base, uint32_t per_word) {
    if (base < 2 || per_word < 1 || per_word > kIntFieldBits)
      throw std::invalid_argument("bitmap: base >= 2 and 1 <= per_word <= INT_FIELD_BITS");
    return DigitPacking{base, per_word, keys};
  };
  m.def(
      "bitmap_pack",
      [packing](uint64_t keys, uint32_t base, uint32_t per_word, uintptr_t present, uintptr_t index, uint64_t count,
                uintptr_t words, int num_threads) {
        const DigitPacking P = packing(keys, base, per_word);
        bool ok = true;
        {
          py::gil_scoped_release release;
          if (present)
            cpu::bitmap_pack_present(ptr<const uint8_t>(present), P, ptr<float>(words), num_threads);
          else
            ok = cpu::bitmap_pack_index(ptr<const int64_t>(index), count, P, ptr<float>(words));
        }
        if (!ok) throw std::out_of_range("bitmap_pack: a row index outside [0, keys)");
      },
      py::arg("keys"), py::arg("base"), py::arg("per_word"), py::arg("present"), py::arg("index"), py::arg("count"),
      py::arg("words"), py::arg("num_threads") = 0,
      "A rank's counting bitmap into P.words() float32 words at `words`: from present (uint8/bool per row) or,\n"
      "where present is 0, from `count` int64 row indices at index.");
  m.def(
      "bitmap_masks",
      [packing](uint64_t keys, uint32_t base, uint32_t per_word, uintptr_t words, double scale, uintptr_t masks,
                int num_threads) {
        const DigitPacking P = packing(keys, base, per_word);
        py::gil_scoped_release release;
        return cpu::bitmap_masks(ptr<const float>(words), P, scale, ptr<uint32_t>(masks), num_threads);
      },
      py::arg("keys"), py::arg("base"), py::arg("per_word"), py::arg("words"), py::arg("scale"), py::arg("masks"),
      py::arg("num_threads") = 0,
      "The non-zero digits of a summed bitmap as a uint32 mask per word; returns the rows they list, or -1\n"
      "for a word that is not a packed integer of this packing.");
  m.def(
      "bitmap_mask_rows",
      [packing](uint64_t keys, uint32_t base, uint32_t per_word, uintptr_t masks, uintptr_t rows, int num_threads) {
        const DigitPacking P = packing(keys, base, per_word);
        py::gil_scoped_release release;
        cpu::bitmap_mask_rows(ptr<const uint32_t>(masks), P, ptr<int64_t>(rows), num_threads);
      },
      py::arg("keys"), py::arg("base"), py::arg("per_word"), py::arg("masks"), py::arg("rows"),
      py::arg("num_threads") = 0, "The rows bitmap_masks counted, increasing, as int64 at rows.");

  m.attr("HEADER_FIELDS") = (int)kHeaderFields;
  m.attr("INT_FIELD_BITS") = (int)kIntFieldBits;

  bind_thc(m);
  bind_topk(m);
}
