"""LHC, the lossless homomorphic sparse-sum codec.

    layout      what a payload holds and where (PayloadLayout; header fields; the hash streams)
    sizing      how big each table is for a failure-probability target; build_layout
    cost_model  which index kind per tensor (plan_layout, choose): the cheapest payload
    codec       LosslessCodec: encode, decode, DecodeReport
    status      DecodeStatus: the one vocabulary of decode outcomes (C++, CUDA and Python)
    reference   the pure-torch oracle the tests compare both backends with
    contract    the exactness contract of a decode and of its reported bounds, as checks (the fuzzer,
                the codec benchmark and the tests judge decodes with it)

layout, sizing and cost_model are pure functions of the configuration, below the backends; codec
and status sit above them (lossless_hc.backends). This package therefore imports nothing itself:
import the modules (or the public names from ``lossless_hc``).
"""
