// codec_kernels.cuh -- CUDA kernels of the lossless codec (encode, index decode, peeling, output): the
// one entry header, which includes the stage headers in order:
//   codec_common.cuh      layout words, counters, shared device helpers, multilevel level shapes
//   codec_encode.cuh      encode (every index kind)
//   codec_index.cuh       decode: the bitmap and Bloom indexes, ordered compaction, the count peel
//   codec_multilevel.cuh  decode: the multilevel index's coarse level, verdicts and expansion
//   codec_ml_peel.cuh     decode: the multilevel index's fine-level peel, pairs and replay
//   codec_value_peel.cuh  decode: the value peel and the output
// The kernels' names are listed once in kernel_list.h (the launch tables of codec_cuda.cu and the
// host emulation expand it).
//
// Device code only: these headers compile under nvcc (included by codec_cuda.cu, which adds the host
// launcher of the compiled module lossless_hc._C_cuda) and under NVRTC (loaded at run time through
// CuPy by lossless_hc/backends/cuda_lhc.py), so they include nothing but csrc/lhc_layout.h, csrc/lhc_status.h
// and each other and use no host API.
// The launch sequence (which kernel, grid, scratch buffers) lives in one place, lossless_hc/backends/cuda_lhc.py,
// shared by both ways of loading these kernels.
//
// Calling convention: every kernel parameter is 8 bytes (a pointer, a uint64_t or a double), so a
// launcher can pass any kernel's arguments as an array of 64-bit words. The codec layout travels as
// a device array of uint64 words: the layout ABI of every backend (lhc_layout.h LayoutWord, built by
// lossless_hc/lhc/layout.py layout_words).
//
// Agreement with the CPU backend: cells, weights, groups and digit packing come from lhc_layout.h, so
// the index words (the multilevel index's fine tables included: exact signed integer sums converted
// once) and header fields are bitwise equal to csrc/cpu/'s; sketch cells are float sums of
// the same terms w * v (exact: w is +-1 or +-2), in atomicAdd order rather than the CPU's key order,
// so values agree within float rounding.
//
// Determinism of decode (the payload alone decides the output bits):
//  * Integer work (counts, degrees, XORs, index totals) uses atomics: integer sums commute.
//  * Candidate and support lists are built by ordered stream compaction (tile counts, a scan, and a
//    per-tile block scan), so a key's position in a list is its rank in increasing key order.
//  * Peeling runs in rounds inside one persistent kernel (a grid barrier between phases, no host
//    round trip): A) every pure cell proposes its key, which takes the smallest proposing cell
//    (atomicMin); B) each key proposed this round reads its value from that cell; C) every cell
//    touched this round subtracts the keys peeled this round in increasing key position, walking its
//    own adjacency list (built once, sorted by key position). Each cell is written by one thread in a
//    fixed order, so the double-precision arithmetic is the same on every run -- and the same as the
//    CPU backend's (csrc/cpu/peel.h peel_layers reads the same cells in the same layers and order;
//    bounds are rounded up to float after each update on both), so the two decoders give the same
//    output bits, status and inexact keys. With verify, the verification bound per key
//    (lhc_verify_values) walks the rounds back after the residual check.
//  * The multilevel index's fine tables are peeled in exact integers (every order gives the same
//    patterns when consistent ones exist), and its verdicts follow the CPU backend's, failures
//    included, replaying the CPU's own peeling order where that order decides (codec_multilevel.cuh).
#pragma once

#include "codec_common.cuh"
#include "codec_encode.cuh"
#include "codec_index.cuh"
#include "codec_multilevel.cuh"
#include "codec_ml_peel.cuh"
#include "codec_value_peel.cuh"
