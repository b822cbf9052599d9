"""The THC table optimizer: exact optimum (vs brute force), the published table, the shipped file."""
import importlib.util
import itertools
import math
import os

import numpy as np
import pytest

from lossless_hc import thc
from lossless_hc.thc.table import TABLES_FILE, _normal_pdf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def brute_force(bits, g, p, symmetric=False):
    best = None
    for inner in itertools.combinations(range(1, g), (1 << bits) - 2):
        levels = (0,) + inner + (g,)
        if symmetric and set(levels) != {g - v for v in levels}:
            continue
        v = thc.table_variance(levels, g, p)
        if best is None or v < best[0] - 1e-12:
            best = (v, levels)
    return best


@pytest.mark.parametrize("bits,g,p", [(2, 10, 32), (2, 13, 1024), (3, 12, 32), (3, 14, 64), (2, 30, 32)])
def test_dynamic_program_finds_the_brute_force_optimum(bits, g, p):
    v, _ = brute_force(bits, g, p)
    table = thc.build_table(bits, g, p)
    assert table.variance == pytest.approx(v, rel=1e-12)
    assert thc.table_variance(table.levels, g, p) == pytest.approx(v, rel=1e-12)
    vs, _ = brute_force(bits, g, p, symmetric=True)
    assert thc.build_table(bits, g, p, symmetric=True).variance == pytest.approx(vs, rel=1e-12)


def test_published_table_is_the_symmetric_optimum_and_ours_is_lower():
    published = thc.PUBLISHED_TABLE_4BIT_G30_P32
    sym = thc.build_table(4, 30, 32, symmetric=True)
    assert sym.levels == published
    best = thc.build_table(4, 30, 32)
    assert best.levels == (0, 3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27, 30)
    v_pub = thc.table_variance(published, 30, 32)
    assert best.variance < v_pub
    assert best.variance == pytest.approx(0.633533, abs=1e-6) and v_pub == pytest.approx(0.634118, abs=1e-6)


def test_variance_matches_numerical_integration():
    # Midpoint rule over the clipped normal, independent of the closed-form moments.
    levels, g, p = (0, 4, 9, 15, 20, 26, 30), 30, 128
    T = thc.clip_threshold(p)
    z = np.linspace(-T, T, 400001)
    zm, dz = (z[1:] + z[:-1]) / 2, z[1] - z[0]
    u = (zm + T) * g / (2 * T)
    lv = np.array(levels)
    idx = np.clip(np.searchsorted(lv, u, side="right"), 1, len(lv) - 1)
    integrand = (u - lv[idx - 1]) * (lv[idx] - u) * np.exp(-zm ** 2 / 2) / math.sqrt(2 * math.pi)
    assert thc.table_variance(levels, g, p) == pytest.approx(float(integrand.sum() * dz), rel=1e-6)


def test_clip_threshold():
    assert thc.clip_threshold(32) == pytest.approx(2.1538746940614546, rel=1e-12)
    assert thc.clip_threshold(1024) == pytest.approx(3.2971933456919633, rel=1e-12)
    assert _normal_pdf(0.0) == pytest.approx(1 / math.sqrt(2 * math.pi))


def test_full_grid_when_bits_cover_every_integer():
    assert thc.build_table(5, 30, 32).levels == tuple(range(31))


def test_shipped_tables_equal_a_fresh_build():
    spec = importlib.util.spec_from_file_location("build_thc_tables", os.path.join(ROOT, "scripts",
                                                                                   "build_thc_tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(TABLES_FILE) as f:
        assert f.read() == mod.render(mod.build_all())
    assert thc.table_for(4, 30, 32, symmetric=True).levels == thc.PUBLISHED_TABLE_4BIT_G30_P32


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        thc.build_table(0, 30)
    with pytest.raises(ValueError, match="granularity"):
        thc.build_table(4, 0)
    with pytest.raises(ValueError, match="overflow_freq"):
        thc.build_table(4, 30, 0.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        thc.table_variance((0, 5, 5, 30), 30, 32)


def test_bits_and_granularity_limits():
    """bits is an integer in [1, 16] and granularity in [1, MAX_GRANULARITY = 2^16]: both ends accepted,
    one past each refused by name (bools too)."""
    from lossless_hc.thc.table import check_bits, check_table_args
    for bits in (1, 16):
        check_bits(bits)
    for bad in (0, 17, True, 4.0):
        with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 16\]"):
            check_bits(bad)
    check_table_args(16, 1 << 16)
    check_table_args(1, 1)
    for bad in (0, (1 << 16) + 1, True):
        with pytest.raises(ValueError, match=r"granularity must be an integer in \[1, 65536\]"):
            check_table_args(4, bad)
    assert thc.build_table(16, 30).levels == tuple(range(31))     # 2^16 levels cover every integer of [0, 30]
    assert thc.build_table(1, 30).levels == (0, 30)


def test_table_variance_refuses_levels_not_from_zero_to_granularity():
    """table_variance's levels start at 0 and end at the granularity: a table missing either end (or past
    it) is refused, not priced as if its end were there."""
    assert thc.table_variance((0, 15, 30), 30, 32) > 0
    for bad in ((1, 15, 30), (0, 15, 29), (0, 15, 31), (-1, 15, 30)):
        with pytest.raises(ValueError, match="from 0 to granularity=30"):
            thc.table_variance(bad, 30, 32)


def test_clip_threshold_refuses_overflow_freq_of_one_or_less():
    """overflow_freq is 1/p for a probability p < 1: 1 (T = 0), less, NaN and infinity are refused."""
    assert thc.clip_threshold(1.0001) > 0
    for bad in (1, 1.0, 0.5, float("inf"), float("nan"), "32"):
        with pytest.raises(ValueError, match="overflow_freq must be a finite number > 1"):
            thc.clip_threshold(bad)


def test_defaults_and_the_shipped_lookup():
    """build_table and table_for default to overflow_freq 32 and the unrestricted (not the symmetric) table;
    shipped_tables holds both kinds, the published table among the symmetric ones, and table_for of a
    configuration tables.json lacks builds it."""
    from lossless_hc.thc.table import shipped_tables
    best = (0, 3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27, 30)
    for table in (thc.build_table(4, 30), thc.table_for(4, 30)):
        assert (table.levels, table.overflow_freq) == (best, 32.0)
        assert table.threshold == thc.clip_threshold(32)
    shipped = shipped_tables()
    assert shipped[(True, "4/30/32")] == thc.PUBLISHED_TABLE_4BIT_G30_P32 and shipped[(False, "4/30/32")] == best
    assert (False, "3/17/50") not in shipped and (True, "3/17/50") not in shipped
    for symmetric in (False, True):
        built = thc.build_table(3, 17, 50, symmetric=symmetric)
        assert thc.table_for(3, 17, 50, symmetric=symmetric) == built


def test_variance_in_units_of_z():
    """variance_z is the level-unit variance divided by (g / (2T))^2 (a level step is 2T/g in z)."""
    table = thc.table_for(4, 30, 32)
    assert table.variance_z == pytest.approx(table.variance / (30 / (2 * table.threshold)) ** 2, rel=1e-15)
    assert 0 < table.variance_z < table.variance


def test_a_search_past_max_table_search_is_refused():
    """(2^bits - 1)(g + 1)^2 <= 2^32: 8 bits reach g = 4103 (255 * 4104^2 <= 2^32); 4104 is refused before
    any matrix is built, naming the sizes; g = 300 is built."""
    assert 255 * 4104 ** 2 <= 1 << 32 < 255 * 4105 ** 2
    with pytest.raises(ValueError, match="searched over a 4105 x 4105 cost matrix in 255 steps"):
        thc.build_table(8, 4104)
    table = thc.build_table(8, 300)     # 255 * 301^2 steps: well within (the bound is quadratic in g + 1)
    assert len(table.levels) == 256 and table.levels[0] == 0 and table.levels[-1] == 300


def test_a_table_is_an_immutable_value():
    """A THCTable is a value (frozen): its levels cannot be swapped under a codec using it."""
    import dataclasses
    table = thc.build_table(2, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.levels = (0, 10)
    assert table == thc.build_table(2, 10) and hash(table) == hash(thc.build_table(2, 10))


@pytest.mark.parametrize("bad,same", [(True, 1), (4.0, 4)])
def test_table_for_refuses_bits_that_are_not_an_int_whatever_it_built_before(bad, same):
    """table_for's cache: a bool or float ``bits`` equal to an int whose table is cached (True == 1, 4.0 == 4,
    with equal hashes) was served that table, though refused in a fresh process; now refused either way."""
    thc.table_for(same, 30)
    with pytest.raises(ValueError, match="bits must be an integer"):
        thc.table_for(bad, 30)


def test_clip_thresholds_below_one_are_the_known_answers():
    """Below T = 1 (overflow_freq under ~3.2) the bisection stops once hi - lo <= 1e-15 (absolute there, relative
    above), so T is within 1e-15 of PhiInv; its exact bits set every payload's scale, so they are known answers:
    overflow_freq 1.5 and 3 (T = 0.43 and 0.97)."""
    from statistics import NormalDist
    for overflow_freq, want in ((1.5, 0.4307272992954578), (3, 0.9674215661017014)):
        assert thc.clip_threshold(overflow_freq) == want
        assert abs(want - NormalDist().inv_cdf(1 - 0.5 / overflow_freq)) <= 1e-15
