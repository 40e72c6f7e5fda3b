import numpy as np
import pytest

from sgl_fair.workloads.lengths import (
    Empirical,
    Fixed,
    LogNormal,
    Normal,
    Uniform,
    as_length_dist,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_fixed():
    x = Fixed(7).sample(5, rng())
    assert x.dtype == np.int64 and x.tolist() == [7] * 5


def test_uniform_is_inclusive():
    x = Uniform(3, 5).sample(10_000, rng(1))
    assert set(x.tolist()) == {3, 4, 5}
    assert abs(x.mean() - 4.0) < 0.05


def test_normal_is_clipped_and_rounded():
    x = Normal(10.0, 20.0, lo=2, hi=30).sample(10_000, rng(2))
    assert x.dtype == np.int64
    assert x.min() == 2 and x.max() == 30
    assert abs(Normal(500.0, 50.0).sample(10_000, rng(3)).mean() - 500.0) < 2.0


def test_lognormal_mean_and_tail():
    x = LogNormal(200.0, 1.0).sample(100_000, rng(4))
    assert x.min() >= 1
    assert abs(x.mean() - 200.0) < 6.0
    assert np.median(x) < 0.7 * x.mean()  # right-skewed


def test_empirical_draws_only_given_values():
    x = Empirical((5, 50, 500)).sample(3_000, rng(5))
    assert set(x.tolist()) == {5, 50, 500}
    assert all(abs(np.mean(x == v) - 1 / 3) < 0.05 for v in (5, 50, 500))


def test_as_length_dist():
    assert as_length_dist(12) == Fixed(12)
    assert as_length_dist(Uniform(1, 2)) == Uniform(1, 2)
    with pytest.raises(TypeError):
        as_length_dist("12")


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Fixed(0), "'n'"),
        (lambda: Fixed(True), "'n'"),
        (lambda: Uniform(0, 5), "'lo'"),
        (lambda: Uniform(5, 4), "'hi'"),
        (lambda: Normal(10.0, -1.0), "'std'"),
        (lambda: Normal(10.0, 1.0, lo=0), "'lo'"),
        (lambda: LogNormal(0.0, 1.0), "'mean'"),
        (lambda: Empirical(()), "'values'"),
        (lambda: Empirical((3, 0)), r"'values\[1\]'"),
    ],
)
def test_invalid_parameters_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
