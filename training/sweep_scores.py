"""Point clouds scored against the sweep the sensor took, at its full resolution.

The project's rule for real data: a forecast (or a baseline) is compared with the truth sweep as measured,
every point where it was measured, never with a copy thinned or z-buffered onto a model's grid. Both
`training.evaluate` (its KITTI pairs) and `training.evaluate_real` (recorded drives) score here:
- squared Chamfer in the 4D-Occ region (`lidar.metrics.forecast_chamfer`) against the whole truth;
- per-ray L1 and AbsRel along the truth's rays (cells of `lidar.ray_grid`) on the rays every method returns
  on, and each method's coverage of the truth's rays;
- a method's points in the region over the truth's.

A method's points count within the truth's vertical field of view (`in_field_of_view`): above a KITTI
HDL-64E's +2 deg, or below its lowest beam from a moved pose, there is no truth to score against.
"""

from __future__ import annotations

import numpy as np

from lidar.metrics import forecast_chamfer, in_crop
from lidar.range_image import elevation_span
from lidar.ray_grid import field_of_view, in_field_of_view, nearest_per_ray, ray_errors

#: Report key -> table header of `sweep_scores` (which also gives "l1_mean").
COLUMNS = {"chamfer": "Chamfer (m², 4D-Occ region) ↓", "l1_median": "L1 median, common rays (m) ↓",
           "absrel": "AbsRel, common rays ↓", "coverage": "truth's rays returned ↑", "points": "points ÷ truth's"}


def sweep_scores(truth: np.ndarray, clouds: dict[str, np.ndarray]) -> tuple[dict[str, dict[str, float]], float]:
    """Every metric (`COLUMNS` and "l1_mean") of each method's cloud against the truth sweep, all in the
    truth's sensor frame, and the share of the truth's rays every method returns on."""
    span = field_of_view(elevation_span(truth))
    seen = {m: c[in_field_of_view(c, span)] for m, c in clouds.items()}
    truth_in_region = max(int(in_crop(truth).sum()), 1)
    out, common = ray_errors(nearest_per_ray(truth), {m: nearest_per_ray(c) for m, c in seen.items()})
    for method, cloud in seen.items():
        out[method]["chamfer"] = forecast_chamfer(cloud, truth)
        out[method]["points"] = float(in_crop(cloud).sum() / truth_in_region)
    return out, common
