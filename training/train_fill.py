"""Train the learned fill (`inference.fill_network`) without labels: `python -m training.train_fill --job-dir DIR`.

A sweep with rings dropped is its own label: the dropped rings are what the network must give back.
1. Items: each sweep of the real folders, read on its own geometry (`training.evaluate_upsample.load_sweep`),
   and the chosen frames of the simulated datasets, each with rings dropped (every `every`-th ring kept, at
   each offset; the real sweeps also with each share of `drops` of their rays dropped at random), filled
   edge-aware by `inference.upsample.upsample` exactly as the evaluation and the learned method fill them. The
   default data are both shared real KITTI drives, one of which (`real_seq/kitti00`) the evaluation scores:
   the card names the scored sweeps the network learnt from, and the three camera-view KITTI scans it scores
   besides are from drives it never saw.
2. Steps: a batch is `batch` azimuth crops of one pool's sweeps of one height (real or simulated, drawn with
   `sim_share`), mirrored in azimuth at random; the loss is the L1 in metres on the filled rays that both the
   fill and the truth return on, the metric the evaluation reports.
3. Checkpoints: `checkpoint.pt` in the job dir (network, optimiser, schedule, generator, step), replaced
   atomically every `save_every` steps; the same command resumes from it.
4. The result: `fill.safetensors` in the job dir, naming its data, steps and the families of the sensors its
   sweeps were measured on (`sensor_family`: where it is the default fill) in its metadata; `--into RELEASE`
   then puts it beside a release's world model, where `load_pipeline` picks it up.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from checkpointing.atomic import atomic_torch_save, atomic_write_bytes, atomic_write_text
from inference.fill_network import (
    FEATURES,
    FILL_WEIGHTS_NAME,
    LOG_SCALE,
    FillNetwork,
    FillNetworkConfig,
    corrected_range,
    fill_features,
    fill_network_bytes,
    load_fill_network,
    sensor_family,
)
from inference.upsample import EDGE_AWARE, upsample
from lidar.errors import InputError
from lidar.formats import Scan
from lidar.range_image import RangeImage, unproject
from lidar.sim.dataset import SimDataset
from training.evaluate_upsample import SHARED, Setting, Sweep, load_sweep, sweep_files, sweep_of
from training.export import shown_path

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
CONFIG_NAME = "fill_config.json"
LOG_NAME = "train_fill.log"
#: Columns at each crop's sides the loss skips: the network sees no further there than the crop.
CROP_MARGIN = 4
#: The camera view that KITTI's object-detection sweeps are cut to (their `velodyne_reduced` clouds): ahead
#: within the left camera's 1242 x 375 image at a focal length of 721 px, so |y| < 0.861 x (40.7 deg either
#: side) and, the camera 0.076 m below the LiDAR, z >= -0.28 x - 0.076 (about -15 deg far out).
CAMERA_HALF_WIDTH, CAMERA_DOWN, CAMERA_DROP_M = 0.861, 0.28, 0.076


#: The release's training sweeps: both shared real KITTI drives (40 raw sweeps in slow traffic, 16 of sequence
#: 00); a network trained on one drive fills the other less well than its own (docs/evaluation.md).
DEFAULT_REAL = (str(SHARED / "real_seq" / "kitti_raw_ttc" / "velodyne_points" / "data"),
                str(SHARED / "real_seq" / "kitti00" / "velodyne"))


@dataclass
class FillTrainConfig:
    """One training of the fill network; the defaults are the release's."""

    real: tuple[str, ...] = DEFAULT_REAL
    #: Simulated datasets (`python -m lidar.sim --out DIR`); none in the release's (docs/upsampling.md).
    sim: tuple[str, ...] = ()
    #: Simulated sequences per dataset, and the frames of each taken.
    sim_sequences: int = 40
    sim_frames: tuple[int, ...] = (0, 10)
    #: Share of batches from the simulated pool (the rest from the real one).
    sim_share: float = 0.0
    #: Ring drops: every `every`-th ring kept, at every offset.
    every: tuple[int, ...] = (4, 2)
    #: Ray drops: each share of a sweep's rays dropped at random (one draw per sweep and share), as completion
    #: fills them; none in the release's.
    drops: tuple[float, ...] = ()
    #: Each real sweep also cut to a camera's view (`camera_view`), as object-detection datasets ship sweeps.
    camera_view: bool = True
    #: The headings of those camera views (deg, 0 ahead, counter-clockwise): each a copy of every real sweep.
    camera_headings: tuple[float, ...] = (0.0,)
    #: Each crop's scene scaled by a factor drawn log-uniformly in this range (1, 1: none): the network then
    #: sees a street's objects at ranges the few training drives do not hold them at.
    range_scale: tuple[float, float] = (1.0, 1.0)
    steps: int = 2000
    batch: int = 6
    crop: int = 256
    lr: float = 2e-3
    weight_decay: float = 1e-4
    channels: int = 32
    seed: int = 0
    save_every: int = 250
    threads: int = 2

    def __post_init__(self) -> None:
        self.real, self.sim = tuple(self.real), tuple(self.sim)
        self.sim_frames, self.every, self.drops = tuple(self.sim_frames), tuple(self.every), tuple(self.drops)
        self.camera_headings, self.range_scale = tuple(self.camera_headings), tuple(self.range_scale)
        if not self.real and not self.sim:
            raise InputError("no training data: give real sweep folders or files, or simulated datasets")
        if not 0.0 <= self.sim_share <= 1.0:
            raise InputError(f"sim_share must be in [0, 1], got {self.sim_share}")
        if (self.sim_share > 0 and not self.sim) or (self.sim_share < 1 and not self.real):
            raise InputError(f"sim_share {self.sim_share} draws from a pool with no data; give both, or 0 / 1")
        if any(e < 2 for e in self.every) or not self.every:
            raise InputError(f"every must be ring spacings >= 2, got {self.every}")
        if len(self.range_scale) != 2 or not 0.25 <= self.range_scale[0] <= self.range_scale[1] <= 4.0:
            raise InputError(f"range_scale must be (low, high) with 0.25 <= low <= high <= 4, got {self.range_scale}")
        if any(not -360.0 <= h <= 360.0 for h in self.camera_headings):
            raise InputError(f"camera_headings must be degrees in [-360, 360], got {self.camera_headings}")
        if any(not 0.0 < d < 1.0 for d in self.drops):
            raise InputError(f"drops must be shares of rays in (0, 1), got {self.drops}")
        for name in ("steps", "batch", "crop", "save_every", "threads"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        FillNetworkConfig(self.channels)

    @classmethod
    def from_json(cls, path: Path) -> FillTrainConfig:
        data = json.loads(path.read_text())
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InputError(f"{path}: unknown fields {sorted(unknown)}; expected some of {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


@dataclass
class Item:
    """One sweep with rings dropped: the network's input, the truth's range and the rays the loss counts."""

    features: np.ndarray
    truth: np.ndarray
    scored: np.ndarray
    #: The columns holding scored rays: where a crop is centred.
    columns: np.ndarray
    #: The family of the sensor its sweep was measured on (`sensor_family`): the network's file names them.
    sensor: str


def ring_drops(sweep: Sweep, every: tuple[int, ...]) -> list[Item]:
    """`sweep` with every `e`-th ring kept, for each e of `every` and each offset, filled edge-aware."""
    height = sweep.truth.shape[0]
    returning = sweep.truth.mask.any(axis=0)[None, :]
    fills = [np.broadcast_to(((np.arange(height) - offset) % e != 0)[:, None], sweep.truth.shape) & returning
             for e in every for offset in range(e)]
    return filled_items(sweep, fills)


def ray_drops(sweep: Sweep, drops: tuple[float, ...], rng: np.random.Generator) -> list[Item]:
    """`sweep` with each share of `drops` of its rays dropped at random, as the evaluation's completion settings
    drop them, filled edge-aware."""
    return filled_items(sweep, [Setting("ray drop", drop=d).mask(sweep.truth, rng) for d in drops])


def filled_items(sweep: Sweep, fills: list[np.ndarray]) -> list[Item]:
    """One item per (H, W) mask of rays to fill: the sweep without them, filled edge-aware exactly as
    `upsample` fills them, and the rays the loss scores."""
    items = []
    for fill in fills:
        res = upsample(None, sweep.given(fill), sensor=sweep.geometry.sensor, mask=fill, method=EDGE_AWARE)
        todo = res.mask & ~res.given.mask
        features = fill_features(res.given, res.image, todo, res.sensor)
        scored = todo & (res.image.range > 0) & sweep.truth.mask
        columns = np.flatnonzero(scored.any(axis=0))
        if len(columns):
            items.append(Item(features, sweep.truth.range.astype(np.float32), scored, columns,
                              sensor_family(sweep.geometry.sensor)))
    return items


def camera_view(sweep: Sweep, heading_deg: float = 0.0) -> Sweep | str:
    """`sweep` cut to the view of a camera looking `heading_deg` left of ahead (`CAMERA_HALF_WIDTH`, ...), each
    point on its beam, read on the geometry that is left (the beams the view still holds)."""
    points, rows = sweep.scan.points, sweep.geometry.rows
    heading = np.radians(heading_deg)
    x = points[:, 0] * np.cos(heading) + points[:, 1] * np.sin(heading)
    y, z = -points[:, 0] * np.sin(heading) + points[:, 1] * np.cos(heading), points[:, 2]
    keep = (rows >= 0) & (x > 0) & (np.abs(y) < CAMERA_HALF_WIDTH * x) & (z >= -CAMERA_DOWN * x - CAMERA_DROP_M)
    scan = Scan(points=points[keep], ring=rows[keep].astype(np.int64), ring_source="file", path=sweep.scan.path)
    return sweep_of(scan, f"{sweep.name} (camera view at {heading_deg:g} deg)")


def sim_sweep(dataset: SimDataset, sequence: int, frame: int) -> Sweep | str:
    """A simulated frame as a sweep file would bring it: its points with their rings, read on their geometry."""
    arrays = dataset.load_sequence(sequence)
    image = RangeImage(arrays["range"][frame], arrays["intensity"][frame])
    rows = np.broadcast_to(np.arange(image.shape[0])[:, None], image.shape)[image.mask]
    scan = Scan(points=unproject(image, dataset.sensor), ring=rows.astype(np.int64), ring_source="file",
                path=Path(f"{dataset.root.name}/{sequence}/{frame}"))
    return sweep_of(scan, scan.path.as_posix())


def build_pools(cfg: FillTrainConfig) -> dict[str, list[Item]]:
    """Step 1: the real and the simulated items."""
    pools: dict[str, list[Item]] = {"real": [], "sim": []}
    files = list(sweep_files(cfg.real)[0]) if cfg.real else []
    for index, path in enumerate(files):
        sweep = load_sweep(path)
        if isinstance(sweep, str):
            logger.warning("skipped %s", sweep)
            continue
        pools["real"] += ring_drops(sweep, cfg.every)
        pools["real"] += ray_drops(sweep, cfg.drops, np.random.default_rng([cfg.seed, index]))
        for heading in cfg.camera_headings if cfg.camera_view else ():
            cut = camera_view(sweep, heading)
            if isinstance(cut, Sweep):
                pools["real"] += ring_drops(cut, cfg.every)
            else:
                logger.warning("skipped %s", cut)
    for root in cfg.sim:
        dataset = SimDataset(root, cache_size=1)
        for sequence in range(min(cfg.sim_sequences, len(dataset))):
            for frame in cfg.sim_frames:
                sweep = sim_sweep(dataset, sequence, frame)
                if isinstance(sweep, str):
                    logger.warning("skipped %s", sweep)
                    continue
                pools["sim"] += ring_drops(sweep, cfg.every)
    logger.info("items: %d real, %d simulated", len(pools["real"]), len(pools["sim"]))
    return pools


def batch(pools: dict[str, list[Item]], cfg: FillTrainConfig, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    """Step 2's batch: crops of one pool's items of one height."""
    pool = pools["sim" if rng.random() < cfg.sim_share else "real"] or pools["real"] or pools["sim"]
    first = pool[rng.integers(len(pool))]
    same = [item for item in pool if item.truth.shape[0] == first.truth.shape[0]]
    xs, ts, ms = [], [], []
    for k in range(cfg.batch):
        item = first if k == 0 else same[rng.integers(len(same))]
        width = item.truth.shape[1]
        crop = min(cfg.crop, width)
        centre = int(item.columns[rng.integers(len(item.columns))])
        c0 = int(np.clip(centre - crop // 2, 0, width - crop))
        cut = slice(c0, c0 + crop)
        x, t, m = item.features[:, :, cut], item.truth[:, cut], item.scored[:, cut].copy()
        m[:, :CROP_MARGIN] = m[:, -CROP_MARGIN:] = False
        if rng.random() < 0.5:  # a sweep turning the other way is as likely
            x, t, m = x[:, :, ::-1], t[:, ::-1], m[:, ::-1]
        if cfg.range_scale != (1.0, 1.0):
            scale = float(np.exp(rng.uniform(*np.log(cfg.range_scale))))
            x, t = scaled(x, scale), t * scale
        if crop < cfg.crop:  # a narrow sweep: pad to the batch's width, the padding unscored
            pad = cfg.crop - crop
            x, t, m = (np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) for a in (x, t, m))
        xs.append(np.ascontiguousarray(x))
        ts.append(np.ascontiguousarray(t))
        ms.append(np.ascontiguousarray(m))
    return tuple(torch.from_numpy(np.stack(a)) for a in (xs, ts, ms))


def scaled(features: np.ndarray, scale: float) -> np.ndarray:
    """`features` of the same scene `scale` times larger: every range the planes hold times `scale`, angles
    unchanged."""
    out = features.copy()
    shift = np.log(scale) / LOG_SCALE
    index = FEATURES.index
    # a silent neighbour's plane holds 0, as a return at exp(LOG_CENTRE) m would: only a measure-zero range
    for plane, present in (("known log-range", features[index("known")] > 0),
                           ("fill log-range", features[index("fill returns")] > 0),
                           ("log-range above", (features[index("gap above")] != 0) & (features[index("log-range above")] != 0)),
                           ("log-range below", (features[index("gap below")] != 0) & (features[index("log-range below")] != 0))):
        out[index(plane)] += np.where(present, shift, 0.0).astype(out.dtype)
    return out


def loss_of(network: FillNetwork, x: torch.Tensor, truth: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean L1 (m) of the corrected fill on the scored rays."""
    return (corrected_range(x, network(x)) - truth).abs()[scored].mean()


def _log_setup(job_dir: Path) -> None:
    handler = logging.FileHandler(job_dir / LOG_NAME)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def train(cfg: FillTrainConfig, job_dir: Path) -> Path:
    """Steps 1-4; returns the fill network's file. A job dir with a checkpoint resumes from it."""
    job_dir.mkdir(parents=True, exist_ok=True)
    _check_same_config(cfg, job_dir)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    network = FillNetwork(FillNetworkConfig(cfg.channels))
    optimiser = torch.optim.AdamW(network.parameters(), cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, cfg.lr, total_steps=cfg.steps, pct_start=0.05)
    rng = np.random.default_rng(cfg.seed)
    step = _resume(job_dir, network, optimiser, schedule, rng)
    pools = build_pools(cfg) if step < cfg.steps else {}
    if pools:
        network.sensors = tuple(sorted({item.sensor for pool in pools.values() for item in pool}))
    start, since = time.perf_counter(), step
    while step < cfg.steps:
        loss = loss_of(network, *batch(pools, cfg, rng))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        step += 1
        if step % 50 == 0 or step == cfg.steps:
            logger.info("step %d loss %.4f (%.2f s/step)", step, loss.item(),
                        (time.perf_counter() - start) / (step - since))
            start, since = time.perf_counter(), step
        if step % cfg.save_every == 0 or step == cfg.steps:
            state = {"network": network.state_dict(), "optimiser": optimiser.state_dict(),
                     "schedule": schedule.state_dict(), "rng": rng.bit_generator.state, "step": step,
                     "sensors": None if network.sensors is None else list(network.sensors)}
            atomic_torch_save(state, job_dir / CHECKPOINT_NAME)
    out = job_dir / FILL_WEIGHTS_NAME
    shown = {**asdict(cfg), "real": [shown_path(p) for p in cfg.real], "sim": [shown_path(p) for p in cfg.sim]}
    atomic_write_bytes(out, fill_network_bytes(network, {"steps": str(step), "config": json.dumps(shown)}))
    logger.info("wrote %s (step %d)", out, step)
    return out


def _check_same_config(cfg: FillTrainConfig, job_dir: Path) -> None:
    """A job dir is one training: its config is recorded on the first run and a rerun must match it."""
    path = job_dir / CONFIG_NAME
    text = json.dumps(asdict(cfg), indent=2) + "\n"
    if path.is_file() and json.loads(path.read_text()) != json.loads(text):
        raise InputError(f"{job_dir} holds a fill training with another config ({path}); use a new job dir")
    if not path.is_file():
        atomic_write_text(path, text)


def _resume(job_dir: Path, network: FillNetwork, optimiser: torch.optim.Optimizer,
            schedule: torch.optim.lr_scheduler.LRScheduler, rng: np.random.Generator) -> int:
    path = job_dir / CHECKPOINT_NAME
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=True)
    network.load_state_dict(state["network"])
    optimiser.load_state_dict(state["optimiser"])
    schedule.load_state_dict(state["schedule"])
    rng.bit_generator.state = state["rng"]
    network.sensors = None if state.get("sensors") is None else tuple(state["sensors"])
    logger.info("resumed %s at step %d", path, state["step"])
    return int(state["step"])


def install(weights: Path, release: Path) -> Path:
    """Put a fill network beside a release's world model, checked by loading it; atomically."""
    if not (release / "config.json").is_file():
        raise InputError(f"--into {release} is not a release folder (no config.json)")
    load_fill_network(weights)
    target = release / FILL_WEIGHTS_NAME
    atomic_write_bytes(target, weights.read_bytes())
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", type=Path, required=True, help="where the checkpoint, log and weights go")
    parser.add_argument("--config", type=Path, default=None, help="a FillTrainConfig JSON (default: the release's)")
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
    parser.add_argument("--into", type=Path, default=None, help="then put fill.safetensors into this release folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("inference.upsample").setLevel(logging.WARNING)  # one line per ring drop otherwise
    try:
        cfg = FillTrainConfig.from_json(args.config) if args.config else FillTrainConfig()
        if args.steps is not None:
            cfg = FillTrainConfig(**{**asdict(cfg), "steps": args.steps})
        args.job_dir.mkdir(parents=True, exist_ok=True)
        _log_setup(args.job_dir)
        weights = train(cfg, args.job_dir)
        if args.into is not None:
            logger.info("installed %s", install(weights, args.into))
    except (InputError, FileNotFoundError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
