"""Property tests of the lossless codec at scale: ``python -m lossless_hc.fuzz --cases 1000000``.

Random configurations, inputs, aggregation orders and payload corruptions
(:mod:`lossless_hc.fuzz.cases`) decoded and judged against the one exactness contract
(:mod:`lossless_hc.lhc.contract`, which the codec benchmark and the tests use too); :func:`run`
spreads the groups over processes and tallies the verdicts. Everything is a function of the seed:
a group's number replays it exactly (``--group``). The package uses the core only (the codec), like
``lossless_hc.bench``; a fast slice runs in the test suite (tests/test_fuzz.py).
"""
from lossless_hc.lhc.contract import allowed_error, outside_bounds, outside_contract, truth
from lossless_hc.fuzz.runner import Tally, run

__all__ = ["run", "Tally", "allowed_error", "outside_bounds", "outside_contract", "truth"]
