"""World styles: one table of everything that makes an urban, a suburban or a highway world what it is.

Each stage of `make_world` reads its numbers from the style's `StyleProfile` (the road network, the
frontage, the scenery, the traffic, the ego's speed, how often a dataset draws the style), so a new style
is one new row here. Ranges are (low, high) and sampled uniformly. Worlds are pure functions of (seed,
style): changing a number changes every world of that style, so bump `lidar.sim.dataset.SIMULATOR_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StyleProfile:
    """The parameters of one world style; each group is read by one stage of `make_world`."""

    # --- the road network (`roads.generate_road_graph`)
    #: "grid": a rectilinear street grid; "trunk": a highway with side roads at its junctions.
    network: Literal["grid", "trunk"]
    #: Intersections per grid side (grid) or along the trunk road.
    nodes: tuple[int, int]
    #: Distance (m) between neighbouring intersections.
    spacing: tuple[float, float]
    #: Lanes each way.
    lanes: tuple[int, int]
    lane_width: float
    #: Sidewalk width (m); 0 for none.
    sidewalk: tuple[float, float]
    #: Probability that a street has parking strips.
    parking: float
    #: Probability that a road bends, and the bend's amplitude (m).
    curve_p: float
    curve_amp: tuple[float, float]
    #: Probability that an interior grid road is dropped (a 4-way crossing becomes a T junction).
    remove_p: float
    #: Standard deviation (m) of the terrain's height noise.
    terrain_std: float

    # --- buildings and green areas (`layout.build_layout`)
    #: A frontage building's distance (m) behind the sidewalk, length along the road, depth, and the gap
    #: (m) to the next one.
    setback: tuple[float, float]
    frontage: tuple[float, float]
    depth: tuple[float, float]
    gaps: tuple[float, float]
    #: Building heights (m); back-lot buildings reach 1.3 times the high end.
    heights: tuple[float, float]
    #: Buildings placed on free land away from the streets (the skyline), and green areas.
    back_lot_buildings: int
    green_areas: int

    # --- things in the world (`actors.populate`)
    #: Scales the number of parked and moving vehicles, cyclists and pedestrians.
    density: float
    #: Shares of car, van and truck in traffic.
    vehicle_mix: tuple[float, float, float]
    #: Whether sidewalks are lined with trees and, with probability `hedge_p` per side, hedges.
    street_trees: bool
    hedge_p: float
    #: Whether junction approaches get traffic-light masts.
    traffic_lights: bool
    #: Probability that a building gets a garden fence (0: no fences, and no random draw for them).
    garden_fence_p: float

    # --- the ego (`drive.plan_drive`)
    #: Straight-ahead speed (m/s) that replaces the town speed of 7-12 m/s (drawn after it); None keeps it.
    straight_speed: tuple[float, float] | None

    # --- datasets (`dataset.sequence_spec`)
    #: Probability that a dataset sequence is of this style (the weights sum to 1).
    dataset_weight: float


#: Every style, in the order that seeds worlds (`make_world` spawns its streams from the style's index):
#: append new styles, never reorder.
STYLE_PROFILES: dict[str, StyleProfile] = {
    "urban": StyleProfile(
        network="grid",
        nodes=(4, 5),
        spacing=(60.0, 100.0),
        lanes=(1, 2),
        lane_width=3.3,
        sidewalk=(2.5, 4.0),
        parking=0.6,
        curve_p=0.25,
        curve_amp=(3.0, 8.0),
        remove_p=0.2,
        terrain_std=0.4,
        setback=(0.5, 3.0),
        frontage=(10.0, 30.0),
        depth=(10.0, 22.0),
        gaps=(0.0, 4.0),
        heights=(7.0, 30.0),
        back_lot_buildings=40,
        green_areas=16,
        density=1.0,
        vehicle_mix=(0.78, 0.15, 0.07),
        street_trees=True,
        hedge_p=0.25,
        traffic_lights=True,
        garden_fence_p=0.0,
        straight_speed=None,
        dataset_weight=0.5,
    ),
    "suburban": StyleProfile(
        network="grid",
        nodes=(3, 4),
        spacing=(90.0, 140.0),
        lanes=(1, 1),
        lane_width=3.2,
        sidewalk=(1.5, 2.5),
        parking=0.3,
        curve_p=0.5,
        curve_amp=(5.0, 14.0),
        remove_p=0.3,
        terrain_std=1.2,
        setback=(5.0, 10.0),
        frontage=(9.0, 15.0),
        depth=(8.0, 13.0),
        gaps=(6.0, 16.0),
        heights=(5.0, 9.0),
        back_lot_buildings=12,
        green_areas=45,
        density=0.5,
        vehicle_mix=(0.78, 0.15, 0.07),
        street_trees=True,
        hedge_p=0.6,
        traffic_lights=False,
        garden_fence_p=0.5,
        straight_speed=None,
        dataset_weight=0.3,
    ),
    "highway": StyleProfile(
        network="trunk",
        nodes=(4, 5),
        spacing=(180.0, 260.0),
        lanes=(3, 3),
        lane_width=3.6,
        sidewalk=(0.0, 0.0),
        parking=0.0,
        curve_p=0.6,
        curve_amp=(8.0, 18.0),
        remove_p=0.0,
        terrain_std=2.0,
        setback=(25.0, 45.0),
        frontage=(15.0, 40.0),
        depth=(12.0, 30.0),
        gaps=(30.0, 120.0),
        heights=(5.0, 14.0),
        back_lot_buildings=8,
        green_areas=40,
        density=0.6,
        vehicle_mix=(0.6, 0.15, 0.25),
        street_trees=False,
        hedge_p=0.0,
        traffic_lights=False,
        garden_fence_p=0.0,
        straight_speed=(18.0, 28.0),
        dataset_weight=0.2,
    ),
}

#: The style names, for argument choices and user interfaces.
STYLES: tuple[str, ...] = tuple(STYLE_PROFILES)


def style_profile(style: str) -> StyleProfile:
    """The profile of `style`, or a ValueError naming the styles there are."""
    if style not in STYLE_PROFILES:
        raise ValueError(f"unknown world style {style!r}; expected one of {STYLES}")
    return STYLE_PROFILES[style]
