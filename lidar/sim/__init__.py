"""Procedural driving worlds with HD maps, ego drives, and a physically based LiDAR simulator.

world = make_world(seed=0, style="urban")
poses = plan_drive(world, "turn_left", frames=40, seed=0)
seq = simulate_sequence(world, poses, get_sensor("hdl32"), seed=0)
"""

from lidar.sim.drive import plan_drive
from lidar.sim.hdmap import HDMap
from lidar.sim.sensor_model import LidarSimulator, SensorModelConfig, SimScan
from lidar.sim.sequence import SimSequence, simulate_sequence
from lidar.sim.styles import STYLES
from lidar.sim.world import World, make_world

# The class names and actions are the model's vocabulary as much as the simulator's; re-exported here so
# `from lidar.sim import ACTIONS` keeps working.
from lidar.vocabulary import ACTIONS, MAP_CLASSES, OBJECT_CLASSES, POINT_CLASSES

__all__ = [
    "ACTIONS",
    "MAP_CLASSES",
    "OBJECT_CLASSES",
    "POINT_CLASSES",
    "STYLES",
    "HDMap",
    "LidarSimulator",
    "SensorModelConfig",
    "SimScan",
    "SimSequence",
    "World",
    "make_world",
    "plan_drive",
    "simulate_sequence",
]
