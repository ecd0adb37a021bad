"""The learned fill: a small range-image network that corrects the edge-aware fill of the rays to fill.

The edge-aware fill (`inference.upsample`) is planar between the known rays above and below a filled ray, which
is right on the road and on walls and wrong where the two known rays see different surfaces: two thirds of
its metres of error on a real KITTI sweep come from the 5 % of filled rays that land on a depth edge. What the
column cannot say, the neighbourhood can: an edge runs on across columns, a car's roof is flat, a pole is
thin. The network sees the known rays, the edge-aware fill and, per filled ray, its known neighbours above and
below with their elevation gaps and its own elevation (angles, not row indices, so any beam table is the same
problem), and it returns a log-range correction to the fill. Its last layer starts at zero, so an untrained
network is the edge-aware fill exactly; the return of each filled ray stays the edge-aware rule's.

It is trained self-supervised on sweeps with rings dropped, real ones and, where a training config names them,
simulated ones (`training.train_fill`), and ships beside the world model in a release as `FILL_WEIGHTS_NAME`,
its architecture and the families of the sensors whose sweeps it learnt from (where it is the default fill)
in the file's metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lidar.formats.detect import closest_preset
from lidar.range_image import RangeImage, column_neighbours
from lidar.sensors import PRESETS, Sensor

#: The fill network's file in a release folder or a Hub repo, beside the world model's.
FILL_WEIGHTS_NAME = "fill.safetensors"
#: Largest fill network file a Hub repo may hand over (the default is about 1 MB).
MAX_FILL_BYTES = 64 * 1024 * 1024
#: The network's input planes, in order (`fill_features`).
FEATURES = ("known", "known log-range", "known intensity", "to fill", "fill returns", "fill log-range",
            "log-range above", "gap above", "log-range below", "gap below", "elevation")
#: Log-range normalisation: (log r - LOG_CENTRE) / LOG_SCALE puts 1-100 m within about [-2, 2].
LOG_CENTRE, LOG_SCALE = 2.3, 1.2
#: Elevation gaps and elevations are given in units of these degrees.
GAP_UNIT_DEG, ELEVATION_UNIT_DEG = 2.0, 30.0
#: Downsamplings of the U-net: the grid is padded to a multiple of 2 ** LEVELS.
LEVELS = 2
METADATA_KEY = "fill_network"
#: The metadata naming the families of the sensors whose sweeps the network learnt from (`sensor_family`).
SENSORS_KEY = "trained_sensors"
#: Widest network a fill file may name.
MAX_CHANNELS = 128


@dataclass(frozen=True)
class FillNetworkConfig:
    """The fill network's architecture: its width at full resolution (1x, 2x and 3x that below)."""

    channels: int = 32

    def __post_init__(self) -> None:
        # bounded, as a file from a Hub repo names it: 128 channels cost 16x the default 32's compute per sweep
        if not isinstance(self.channels, int) or not 8 <= self.channels <= MAX_CHANNELS or self.channels % 8:
            raise ValueError(f"channels must be a multiple of 8 in [8, {MAX_CHANNELS}], got {self.channels!r}")


class _Conv(nn.Module):
    """3x3 convolution, GroupNorm, SiLU; padded around in azimuth (a sweep is a ring) and with zeros in
    elevation."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        # the convolution pads the rows with zeros itself, so each input is copied once, around the ring
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=(1, 0))
        self.norm = nn.GroupNorm(8, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(F.pad(x, (1, 1, 0, 0), mode="circular"))))


class FillNetwork(nn.Module):
    """A three-level U-net from `FEATURES` to one log-range correction per ray."""

    def __init__(self, config: FillNetworkConfig | None = None, sensors: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.config = config or FillNetworkConfig()
        #: The families of the sensors whose sweeps it learnt from (`learnt_from`); None: not said.
        self.sensors = sensors
        c = self.config.channels
        self.enc0 = nn.Sequential(_Conv(len(FEATURES), c), _Conv(c, c))
        self.enc1 = nn.Sequential(_Conv(c, 2 * c, stride=2), _Conv(2 * c, 2 * c))
        self.enc2 = nn.Sequential(_Conv(2 * c, 3 * c, stride=2), _Conv(3 * c, 3 * c), _Conv(3 * c, 3 * c))
        self.dec1 = _Conv(5 * c, 2 * c)
        self.dec0 = nn.Sequential(_Conv(3 * c, c), _Conv(c, c))
        self.head = nn.Conv2d(c, 1, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(B, len(FEATURES), H, W) -> (B, H, W) log-range correction."""
        height, width = features.shape[-2:]
        step = 2**LEVELS
        x = F.pad(features, (0, 0, 0, (-height) % step))
        if width % step:
            x = torch.cat([x, x[..., : (-width) % step]], dim=-1)  # the ring goes on past its last column
        a = self.enc0(x)
        b = self.enc1(a)
        c = self.enc2(b)
        b = self.dec1(torch.cat([F.interpolate(c, size=b.shape[-2:]), b], dim=1))
        a = self.dec0(torch.cat([F.interpolate(b, size=a.shape[-2:]), a], dim=1))
        return self.head(a)[:, 0, :height, :width]


def _log_range(r: np.ndarray) -> np.ndarray:
    return np.where(r > 0, (np.log(np.maximum(r, 1e-3)) - LOG_CENTRE) / LOG_SCALE, 0.0)


def fill_features(given: RangeImage, base: RangeImage, todo: np.ndarray, sensor: Sensor) -> np.ndarray:
    """(len(FEATURES), H, W) float32 input of the network: `given` the known rays (silent on the rays `todo`),
    `base` the edge-aware fill of `todo`, on `sensor`'s grid."""
    height, width = given.shape
    known = ~todo
    above, below = column_neighbours(known)
    has_above, has_below = above >= 0, below < height
    above, below = np.clip(above, 0, height - 1), np.clip(below, 0, height - 1)
    cols = np.broadcast_to(np.arange(width)[None, :], (height, width))
    degrees = np.degrees(sensor.elevations)
    elevation = degrees[:, None]
    known_range = np.where(known, given.range, 0.0)
    range_above = np.where(has_above, known_range[above, cols], 0.0)
    range_below = np.where(has_below, known_range[below, cols], 0.0)
    gap_above = np.where(has_above, degrees[above] - elevation, 0.0) / GAP_UNIT_DEG
    gap_below = np.where(has_below, elevation - degrees[below], 0.0) / GAP_UNIT_DEG
    fills = todo & (base.range > 0)
    planes = (known & (known_range > 0), _log_range(known_range), np.where(known, given.intensity, 0.0), todo, fills,
              _log_range(np.where(fills, base.range, 0.0)), _log_range(range_above), gap_above,
              _log_range(range_below), gap_below, np.broadcast_to(elevation / ELEVATION_UNIT_DEG, (height, width)))
    return np.stack(planes).astype(np.float32)


def corrected_range(features: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """(B, H, W) metres: the fill's range (from its plane of `features`) times exp(correction), the one place the
    network's output becomes a range. Meaningful on the filled rays that return only."""
    fill_log_range = features[:, FEATURES.index("fill log-range")]
    return torch.exp(fill_log_range * LOG_SCALE + LOG_CENTRE + correction)


@torch.no_grad()
def refine(network: FillNetwork, given: RangeImage, base: RangeImage, todo: np.ndarray, sensor: Sensor) -> RangeImage:
    """`base` (the edge-aware fill of the rays `todo` of `given`) with the network's correction on the filled rays
    that return; every other ray as in `base`."""
    weight = next(network.parameters())
    features = torch.from_numpy(fill_features(given, base, todo, sensor))[None].to(weight.device)
    # the fill's range stays float32 (bfloat16 would move a range 50 m away by 0.2 m); only the network's
    # correction is in its own dtype
    correction = network(features.to(weight.dtype)).float()
    refined = corrected_range(features, correction)[0].cpu().numpy()
    fills = todo & (base.range > 0)
    return RangeImage(np.where(fills, refined, base.range).astype(np.float32), base.intensity)


def sensor_family(sensor: Sensor) -> str:
    """The preset a sweep's measured beam table is closest to (beam count, vertical fan): what the file's
    `trained_sensors` names. A camera-view cut of a KITTI sweep (46 of its rings) is still an HDL-64E's."""
    return closest_preset(np.asarray(sensor.elevations_deg)).name


def learnt_from(network: FillNetwork, sensor: Sensor) -> bool:
    """Whether the network learnt from sweeps of `sensor`'s family (the sensor a sweep to upsample was measured
    on), or its file does not say. The release's network, trained on KITTI HDL-64E sweeps, corrects the
    edge-aware fill there and worsens it on the other sensors' real scans (docs/evaluation.md), so it is the
    default fill only for such sweeps. The input's sensor decides, not the target grid's: a factor's grid
    (127 or 253 beams for an HDL-64E) lies between the presets, and its nearest flips with a beam's 0.4 deg."""
    return network.sensors is None or sensor_family(sensor) in network.sensors


def fill_network_bytes(network: FillNetwork, extra: dict[str, str] | None = None) -> bytes:
    """The network's weights as a safetensors file, its config, the sensors it learnt from (and `extra`: what
    it was trained on) in the metadata; the bytes, for a caller that writes them atomically."""
    from safetensors.torch import save

    state = {k: v.detach().contiguous().cpu() for k, v in network.state_dict().items()}
    sensors = {} if network.sensors is None else {SENSORS_KEY: json.dumps(sorted(network.sensors))}
    return save(state, metadata={METADATA_KEY: json.dumps(asdict(network.config)), **sensors, **(extra or {})})


def fill_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a fill network file; no tensor is read."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_fill_network(path: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> FillNetwork:
    """The fill network of a `fill_network_bytes` file, in `dtype` (its fill's ranges stay float32: `refine`);
    ValueError for a file that is not one."""
    from safetensors.torch import load_file

    try:
        meta = fill_metadata(path)
        config = FillNetworkConfig(**json.loads(meta[METADATA_KEY]))
        network = FillNetwork(config, _sensors(meta.get(SENSORS_KEY)))
        network.load_state_dict(load_file(str(path)), strict=True)
    except Exception as exc:  # a torn file, a foreign safetensors file or a wrong architecture: one refusal
        raise ValueError(f"{path} is not a LidarVerse fill network ({type(exc).__name__}: {exc})") from None
    return network.to(device=device, dtype=dtype).eval()


def _sensors(text: str | None) -> tuple[str, ...] | None:
    """A file's `trained_sensors`: preset names, as a Hub repo's file may say anything."""
    if text is None:
        return None
    sensors = json.loads(text)
    if not isinstance(sensors, list) or not all(isinstance(s, str) and s in PRESETS for s in sensors):
        raise ValueError(f"{SENSORS_KEY} must be a list of preset names ({', '.join(PRESETS)}), got {text[:200]!r}")
    return tuple(sensors)
