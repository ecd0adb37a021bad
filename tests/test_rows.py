"""Row gathers and scatters (`lidar.rows`): the rows fancy indexing gives, however they are picked."""

import numpy as np
import pytest

from lidar.rows import finite_rows, put_rows, take_rows


@pytest.fixture
def points() -> np.ndarray:
    return np.random.default_rng(0).random((1000, 4), dtype=np.float32)


def test_take_rows_gives_the_rows_of_an_index_or_a_mask(points):
    rng = np.random.default_rng(1)
    index = rng.integers(-1000, 1000, 300)  # repeats, any order, negatives count from the end
    mask = rng.random(1000) < 0.3
    for pick in (index, mask, np.zeros(0, dtype=np.int64), np.zeros(1000, dtype=bool)):
        out = take_rows(points, pick)
        assert out.dtype == points.dtype and np.array_equal(out, points[pick])
    table = np.random.default_rng(2).random((4, 8, 3))
    assert np.array_equal(take_rows(table, np.array([3, 0])), table[[3, 0]])  # whole sub-arrays per row


def test_take_rows_refuses_a_mask_of_another_length_and_an_index_out_of_bounds(points):
    with pytest.raises(IndexError, match="one flag per row"):
        take_rows(points, np.ones(999, dtype=bool))
    with pytest.raises(IndexError):
        take_rows(points, np.array([1000]))


def test_put_rows_writes_what_fancy_assignment_writes(points):
    rng = np.random.default_rng(3)
    index = rng.integers(0, 1000, 500)  # repeats: the last one wins
    values = rng.random((500, 4))  # float64, cast to the array's float32
    expected, out = points.copy(), points.copy()
    expected[index] = values
    put_rows(out, index, values)
    assert np.array_equal(out, expected)
    mask = rng.random(1000) < 0.4
    more = rng.random((int(mask.sum()), 4))
    expected[mask] = more
    put_rows(out, mask, more)
    assert np.array_equal(out, expected)


def test_put_rows_refuses_a_strided_array_and_rows_of_another_width(points):
    with pytest.raises(ValueError, match="C-contiguous"):
        put_rows(points[:, :3], np.array([0]), np.zeros((1, 3)))  # a view: the write would be lost in a copy
    with pytest.raises(ValueError, match=r"expected \(M, 4\)"):
        put_rows(points, np.array([0]), np.zeros((1, 3)))


def test_finite_rows_flags_every_row_without_a_nan_or_an_infinity():
    points = np.array([[0, 1, 2, 3], [np.nan, 0, 0, 0], [0, 0, 0, np.inf], [-1e30, 1e30, 0, 0], [0, 0, -np.inf, 0]],
                      np.float32)
    np.testing.assert_array_equal(finite_rows(points), [True, False, False, True, False])
    np.testing.assert_array_equal(finite_rows(points[:, :2]), [True, False, True, True, True])
