// lhc_status.h -- the one vocabulary of decode outcomes, shared by the CPU kernels, the CUDA kernels
// and Python (lossless_hc.lhc.status builds its DecodeStatus enum from this list through the _C
// module, so the three can never drift apart).
//
// Codes 0..7 are what the decode kernels return; codes from 16 on are found by the codec from the
// payload header before the kernels' verdict is read (lossless_hc/lhc/codec.py). Each entry is
// X(CppName, code, PythonName, message); the message is the whole reason a report gives for that
// status (the codec may prefix the overload it found, or append counts).
#pragma once

#define LHC_DECODE_STATUSES(X)                                                                        \
  X(Ok, 0, "OK", "")                                                                                  \
  X(IndexCorrupt, 1, "INDEX_CORRUPT",                                                                 \
    "index corrupt: an index word is not a valid packed count, or the counts disagree with the header") \
  X(IndexPeelFailed, 2, "INDEX_PEEL_FAILED",                                                          \
    "index peeling failed: the Bloom counters (or the multilevel fine table) could not be resolved "   \
    "into per-key counts")                                                                            \
  X(SketchPeelFailed, 3, "SKETCH_PEEL_FAILED",                                                        \
    "sketch peeling failed: more distinct non-zero keys than the sketch can separate")                \
  X(SketchNonFinite, 4, "SKETCH_OVERFLOW",                                                            \
    "sketch overflow: a float32 sketch cell is NaN/Inf although every rank's input was finite "       \
    "(values near the float32 limit summed in one cell, or a corrupted payload)")                     \
  X(IndexOverflow, 5, "INDEX_OVERFLOW",                                                               \
    "index overflow: a multilevel fine-table cell summed to 2**22 or more (more non-zero groups in "  \
    "one cell than the layout was sized for, or a corrupted payload)")                                \
  X(Inexact, 6, "INEXACT",                                                                            \
    "inexact: the error bound of some keys exceeds rtol (DecodeReport.inexact_keys lists them; every " \
    "other key is within the contract)")                                                              \
  X(SketchCorrupt, 7, "SKETCH_CORRUPT",                                                               \
    "sketch corrupt: after peeling, a value or mass cell is not what the recovered keys account for " \
    "within its rounding bound (a corrupted payload, or one that is not a plain sum/average)")        \
  X(HeaderCorrupt, 16, "HEADER_CORRUPT",                                                              \
    "header fields are not the integers world_size ranks write: the payload is corrupted, or not a "  \
    "plain sum/average of this codec's payloads")                                                     \
  X(WrongContributors, 17, "WRONG_CONTRIBUTORS",                                                      \
    "the payload aggregates a number of contributions other than world_size")                         \
  X(ConfigurationMismatch, 18, "CONFIGURATION_MISMATCH",                                              \
    "configuration mismatch: ranks built the codec with different numel/world_size/max_nnz/"          \
    "block_size/seed/index (fingerprints disagree)")                                                  \
  X(NonFiniteInput, 19, "NON_FINITE_INPUT", "non-finite input (NaN/Inf) on a rank")                   \
  X(IndexSaturated, 20, "INDEX_SATURATED", "index counter saturated on a rank")                       \
  X(KeyCountCorrupt, 21, "KEY_COUNT_CORRUPT",                                                         \
    "index corrupt: the header's key count exceeds world_size * num_keys")                            \
  X(Overloaded, 22, "OVERLOADED", "overloaded: a rank had more non-zero keys than the codec's capacity")

namespace lhc {

enum DecodeStatus : int {
#define LHC_STATUS_ENUM(cpp, code, py, msg) kDecode##cpp = code,
  LHC_DECODE_STATUSES(LHC_STATUS_ENUM)
#undef LHC_STATUS_ENUM
};

}  // namespace lhc
