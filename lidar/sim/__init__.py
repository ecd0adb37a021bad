"""Procedural driving worlds with HD maps, ego drives, and a physically based LiDAR simulator.

world = make_world(seed=0, style="urban")
poses = plan_drive(world, "turn_left", frames=40, seed=0)
seq = simulate_sequence(world, poses, get_sensor("hdl32"), seed=0)
"""

from lidar.sim.actors import OBJECT_CLASSES
from lidar.sim.drive import ACTIONS, plan_drive
from lidar.sim.hdmap import MAP_CLASSES, HDMap
from lidar.sim.roads import STYLES
from lidar.sim.sensor_model import POINT_CLASSES, LidarSimulator, SensorModelConfig, SimScan
from lidar.sim.sequence import SimSequence, simulate_sequence
from lidar.sim.world import World, make_world

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
