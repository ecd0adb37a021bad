"""Turn a training job into a release, and optionally publish it:
`python -m training.export JOB_DIR OUT_DIR [--metrics EVAL.json] [--push-to-hub ORG/NAME [--revision R]]`.

A release is what the app loads (docs/design.md): `model.safetensors` holding the EMA weights with metadata
naming the iteration and the source, `config.json` with the architecture, sensor and normalisation, and
`README.md`, the model card (its YAML front matter is the Hub's metadata). Beside them `training.json` keeps
how to make the release again: the job's resolved training config and the data it was trained on (the
simulated dataset's simulator version, seed and sizes, and any recordings); nothing loads it at inference.
The card is written from what the job recorded (its resolved config, `progress.json`, the dataset manifest)
and, when given, an evaluation report, so it states facts rather than intentions.

The release is committed like a checkpoint: it is written into a staging folder beside OUT_DIR, fsynced,
loaded back through `inference.load_pipeline` (the path every user of the release takes) and required to
reproduce the job's EMA tensor for tensor; only then is it renamed into place. OUT_DIR therefore holds
either the previous release or the new verified one, never a mix. `--push-to-hub` uploads that folder as
one commit with huggingface_hub.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from checkpointing.atomic import atomic_write_text, fsync_dir, fsync_file
from inference import load_pipeline
from inference.fill_network import FILL_WEIGHTS_NAME, load_fill_network
from inference.loader import CONFIG_NAME, DEFAULT_MODEL, WEIGHTS_NAME
from inference.network import WorldModel
from lidar.errors import InputError
from lidar.sequence import open_recording
from lidar.sim.dataset import MANIFEST, SIMULATOR_VERSION
from lidar.vocabulary import FRAME_RATE_HZ, MAP_CLASSES
from training.config import TrainConfig
from training.data import FORECAST_FRAMES
from training.progress import read_progress, wall_seconds

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
#: How the release was trained: the resolved training config and the data spec (see `training_record`).
TRAINING_NAME = "training.json"
#: The repository's root: where a launch command's config must be tracked for a fresh clone to rerun it.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: The evaluation's pictures a release may carry for its card (`training.evaluate --pictures`, on the model's
#: grid or a preset's; `training.evaluate_real --pictures`, one recording's at a horizon in frames, and in a
#: dtype other than float32 where the model ran in one).
#: `training.evaluate_upsample --pictures`: one setting's (its index) given | each fill | truth, or the sparse
#: example's given | each fill.
PICTURE = re.compile(r"eval_sim_(?P<sim>bev|range)(?:_(?P<sensor>[a-z0-9-]+))?\.png|eval_kitti_bev\.png|"
                     r"real_(?P<recording>[a-z0-9_-]+?)_(?P<real>bev|range)_(?P<frames>[0-9]+)"
                     r"(?:_(?P<dtype>bfloat16|float16))?\.png|"
                     r"upsample_(?P<up>bev|range)_(?P<setting>[0-9]+|sparse)\.png")
#: What a release folder holds besides its pictures; exporting replaces the whole folder, so nothing else may be in it.
RELEASE_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, TRAINING_NAME, FILL_WEIGHTS_NAME)


def picture_caption(name: str) -> str | None:
    """What picture `name` shows, for its caption in the card; None for a file that is no release picture."""
    match = PICTURE.fullmatch(name)
    if match is None:
        return None
    if name == "eval_kitti_bev.png":
        return "real KITTI pair: truth | forecast | moved sweep"
    if match["up"]:
        return upsample_caption(match["setting"], match["up"] == "bev")
    bev = (match["sim"] or match["real"]) == "bev"
    join, view = (" | ", "BEV") if bev else (" / ", "range images")
    if match["sim"]:
        on = f" on {match['sensor']}" if match["sensor"] else ""
        panels = join.join(("truth", "forecast", "frame 0 moved", "generate"))
        return f"simulated drive{on}, 1.0 s ahead: {panels} ({view})"
    ahead = f"{int(match['frames']) / FRAME_RATE_HZ:g} s"
    panels = join.join(("truth", "forecast", "every prefix sweep moved"))
    dtype = f" in {match['dtype']}" if match["dtype"] else ""
    return f"real `{match['recording']}`{dtype}, {ahead} ahead: {panels} ({view})"


def upsample_caption(setting: str, bev: bool) -> str:
    """The caption of an upsampling picture: a setting's index, or "sparse" for the sparse example."""
    from training.evaluate_upsample import SETTINGS, SPARSE_CAPTION

    join, view = (" | ", "BEV") if bev else (" / ", "range images")
    if setting == "sparse":
        return f"{SPARSE_CAPTION}: {join.join(('given', 'each fill'))} ({view})"
    index = int(setting)
    what = SETTINGS[index].name if index < len(SETTINGS) else f"setting {index}"
    return f"a real KITTI sweep, {what}: {join.join(('given', 'each fill', 'truth'))} ({view})"


def is_release_file(name: str) -> bool:
    return name in RELEASE_FILES or picture_caption(name) is not None


#: The card's YAML front matter: what the Hub shows and searches (license, library, task, tags).
CARD_METADATA: dict[str, Any] = {
    "license": "apache-2.0",
    "library_name": "lidarverse",
    "pipeline_tag": "robotics",
    "tags": ["lidar", "world-model", "point-cloud", "range-image", "rectified-flow", "autonomous-driving"],
}
#: How the network's image channels relate to metres and intensities (lidar.range_image.encode_range).
NORMALISATION = {
    "range": "encode_range: 2 * log1p(clip(r, 0, max_range)) / log1p(max_range) - 1; -1 = no return",
    "intensity": "intensity * 2 - 1 where a return, -1 where none",
    "decode": "decode_range; anything decoding below min_range is a ray drop",
}


class ReleaseVerificationError(RuntimeError):
    """The staged release did not load back to the job's EMA; nothing was published."""


def export(
    job_dir: Path,
    out_dir: Path,
    metrics: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    base_model: str | None = None,
    pictures: Path | None = None,
    fill: Path | None = None,
    load_as: str | None = None,
) -> Path:
    """Publish the release of the job's newest valid checkpoint at `out_dir`; return the weights path.

    `base_model` (a Hub id) goes into the card's metadata when the job continued another release;
    `pictures` is a folder written by `training.evaluate --pictures`, whose BEV panels the card shows; `fill` a
    fill network (`training.train_fill`) the release ships for learned upsampling; `load_as` the source its card's
    load line names where a reader gets it elsewhere than `out_dir` (the Hub repo it is pushed to).
    """
    # 1. The job's own record of how it was trained.
    cfg = TrainConfig.from_json(job_dir / CONFIG_NAME)
    progress = read_progress(job_dir)
    # 2. The EMA weights, through the same loader the app uses (safe formats only, shapes checked).
    pipe = load_pipeline(str(job_dir), device="cpu", dtype=torch.float32)
    model, provenance = pipe.model, pipe.provenance
    if provenance.weights != "ema":
        raise ValueError(f"job {job_dir} has no EMA weights at iteration {provenance.iteration}; a release ships the EMA")
    iteration = int(provenance.iteration)
    check_replaceable(out_dir)
    # 3. Stage the release beside out_dir (same filesystem, so the final rename is atomic).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a release is read by everyone
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        source = f"{job_dir.resolve().name}/{Path(provenance.resolved_path).name}"
        weights = _write_weights(staging, state, _weights_metadata(model, iteration, source))
        dataset = _dataset_summary(Path(cfg.data_root)) if cfg.data_root else {}
        native = [_dataset_summary(Path(root)) for root in cfg.data_roots]
        release_config = _release_config(cfg, progress, model, iteration, [dataset, *native])
        atomic_write_text(staging / CONFIG_NAME, json.dumps(release_config, indent=2) + "\n")
        record = training_record(cfg, dataset, launch_commands(progress), native)
        atomic_write_text(staging / TRAINING_NAME, json.dumps(record, indent=2) + "\n")
        shown = _copy_pictures(pictures, staging)
        if fill is not None:
            load_fill_network(fill)  # refused before anything is published
            shutil.copyfile(fill, staging / FILL_WEIGHTS_NAME)
            fsync_file(staging / FILL_WEIGHTS_NAME)
        card = model_card(cfg, progress, dataset, iteration, model, weights, metrics, notes or [], base_model, shown,
                          native, folder=load_as or shown_path(out_dir))
        atomic_write_text(staging / CARD_NAME, card)
        # 4. Read it back as every user will.
        verify_release(staging, state, iteration)
        # 5. Rename it into place; the previous release, if any, goes only now.
        publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s (iteration %d, %.1f MB) to %s", source, iteration,
                (out_dir / WEIGHTS_NAME).stat().st_size / 1e6, out_dir)
    return out_dir / WEIGHTS_NAME


def shown_path(path: str | Path) -> str:
    """`path` as a release's files name it: relative to the working directory, so no machine's layout ships."""
    return Path(os.path.relpath(Path(path).resolve())).as_posix()


def _copy_pictures(pictures: Path | None, staging: Path) -> list[str]:
    """Copy the evaluation pictures that exist into the staged release; their names, for the card."""
    if pictures is None:
        return []
    if not pictures.is_dir():
        raise FileNotFoundError(f"--pictures {pictures} is not a folder; expected `training.evaluate --pictures` output")
    shown = sorted(p.name for p in pictures.iterdir() if p.is_file() and picture_caption(p.name) is not None)
    for name in shown:
        shutil.copyfile(pictures / name, staging / name)
        fsync_file(staging / name)
    return shown


def check_replaceable(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is anything but a release: the export swaps the whole folder, so other
    files in it would be lost."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; expected a release folder or a new path")
    extra = sorted(name for name in os.listdir(out_dir) if not is_release_file(name)) if out_dir.is_dir() else []
    if extra:
        raise FileExistsError(
            f"{out_dir} holds files that are not part of a release ({', '.join(extra[:5])}); the export replaces "
            f"the whole folder ({', '.join(RELEASE_FILES)} and the evaluation's pictures), so move them or choose "
            "a new OUT_DIR"
        )


def _weights_metadata(model: Any, iteration: int, source: str) -> dict[str, str]:
    """The safetensors header that makes the weights file self-describing (docs/design.md, conventions)."""
    return {
        "format": "lidarverse-release",
        "iteration": str(iteration),
        "weights": "ema",
        "ema": "true",
        "source": source,
        "git_commit": _git_commit(),
        "exported_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": json.dumps(model.config.to_dict()),
    }


def _write_weights(folder: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """safetensors does not fsync, so flush the file before the release can be published; it also writes the
    file private (0600), and a release is read by everyone (a server running as another user, a Space)."""
    weights = folder / WEIGHTS_NAME
    save_file(state, str(weights), metadata=metadata)
    weights.chmod(0o644)
    fsync_file(weights)
    return weights


def _release_config(
    cfg: TrainConfig, progress: dict[str, Any], model: Any, iteration: int, datasets: list[dict[str, Any]]
) -> dict[str, Any]:
    """config.json: what a loader needs to rebuild the network, and a summary of how it was trained (the world
    seeds of every simulated dataset, so an evaluation can check its drives are disjoint from all of them)."""
    return {
        "model": model.config.to_dict(),
        "sensor": model.config.sensor,
        "normalisation": NORMALISATION,
        "map_classes": list(MAP_CLASSES),
        "training": {
            "iteration": iteration,
            "max_iters": cfg.max_iters,
            "batch_size": cfg.batch_size,
            "world_size": _world_size(progress),
            "wall_seconds": round(wall_seconds(progress), 1),
            "world_seeds": sorted({seed for d in datasets for seed in d.get("world_seeds", [])}),
        },
    }


def verify_release(folder: Path, state: dict[str, torch.Tensor], iteration: int) -> None:
    """Load `folder` through `load_pipeline` and require the job's EMA tensor for tensor at `iteration`."""
    pipe = load_pipeline(str(folder), device="cpu", dtype=torch.float32)
    loaded = pipe.model.state_dict()
    problems = []
    if (pipe.provenance.iteration, pipe.provenance.weights) != (iteration, "ema"):
        problems.append(f"it reports {pipe.provenance.weights} weights at iteration {pipe.provenance.iteration}, "
                        f"expected ema at {iteration}")
    if loaded.keys() != state.keys():
        problems.append(f"its keys differ: {sorted(set(loaded) ^ set(state))[:5]}")
    differing = [k for k in state if k in loaded and not torch.equal(loaded[k], state[k])]
    if differing:
        problems.append(f"{len(differing)} tensor(s) differ from the job's EMA, e.g. {differing[0]}")
    if problems:
        raise ReleaseVerificationError(
            f"the staged release {folder} does not load back to the job's EMA: {'; '.join(problems)}. "
            "Nothing was published."
        )
    logger.info("verified the staged release by loading it back (%d tensors)", len(state))


def publish(staging: Path, out_dir: Path) -> None:
    """Rename the verified staging folder to `out_dir`, durably.

    A previous release is renamed aside first and deleted only once the new one is in place (renamed
    back if that fails). Between the two renames OUT_DIR is briefly absent, never partial.
    """
    fsync_dir(staging)
    previous = None
    if out_dir.exists():
        previous = out_dir.with_name(f".{out_dir.name}.previous-{os.getpid()}")
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(out_dir, previous)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        if previous is not None:
            os.rename(previous, out_dir)
        raise
    finally:
        fsync_dir(out_dir.parent)
    if previous is not None:
        shutil.rmtree(previous)


def push_to_hub(release: Path, repo_id: str, revision: str | None = None) -> str:
    """Upload a published release folder to the Hub model repo `repo_id` as one commit; return its hash.

    The repo is created if missing; `revision` names a branch, created from main if missing, so a release
    can be pushed for review before main moves. The token is huggingface_hub's (HF_TOKEN or `hf auth login`).
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now, as the loader does
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    if revision not in (None, "main"):
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    iteration = json.loads((release / CONFIG_NAME).read_text())["training"]["iteration"]
    info = api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=release,
        revision=revision,
        allow_patterns=sorted(name for name in os.listdir(release) if is_release_file(name)),
        commit_message=f"LidarVerse release: EMA weights at iteration {iteration}",
    )
    logger.info("pushed %s to %s@%s (commit %s)", release, repo_id, revision or "main", info.oid)
    return info.oid


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _world_size(progress: dict[str, Any]) -> int | None:
    launches = progress["launches"]
    if not launches:
        return None
    command = launches[-1]["command"].split()
    return int(command[command.index("--nproc_per_node") + 1]) if "--nproc_per_node" in command else None


def _dataset_summary(root: Path) -> dict[str, Any]:
    """What the card says about the training data, from the dataset's manifest."""
    path = root / MANIFEST
    if not path.is_file():
        return {"root": str(root)}
    manifest = json.loads(path.read_text())
    seqs = manifest["sequences"]
    styles: dict[str, int] = {}
    actions: dict[str, int] = {}
    for s in seqs:
        styles[s["style"]] = styles.get(s["style"], 0) + 1
        actions[s["action"]] = actions.get(s["action"], 0) + 1
    return {
        "root": str(root),
        "simulator": manifest.get("simulator", 1),  # manifests before simulator version 2 did not record it
        "seed": manifest["seed"],
        "sequences": len(seqs),
        "frames": sum(s["frames"] for s in seqs),
        "frames_per_sequence": sorted({s["frames"] for s in seqs}),
        "sensor": manifest["sensor"],
        "styles": styles,
        "actions": actions,
        "world_seeds": sorted(int(s["world_seed"]) for s in seqs),
    }


def data_command(dataset: dict[str, Any]) -> str:
    """The `python -m lidar.sim` line that writes the dataset `_dataset_summary` describes (at its simulator
    version), for the card and training.json."""
    sensor = dataset["sensor"]
    return (f"python -m lidar.sim --sensor {sensor['name']} --width {sensor['width']} --sequences {dataset['sequences']} "
            f"--frames {dataset['frames_per_sequence'][0]} --seed {dataset['seed']} --out {dataset['root']}")


def _recording_summary(folder: str) -> dict[str, Any]:
    """What a recorded drive the job trained on holds, as far as this machine still has it."""
    try:
        recording = open_recording(folder)
    except InputError:  # moved, or not on this machine: the path is all the job recorded
        return {"path": folder}
    return {"path": folder, "sweeps": len(recording), "first": recording.names[0], "last": recording.names[-1],
            "poses": "from its poses file" if recording.poses is not None else "registered (KISS-ICP)"}


def _data_record(dataset: dict[str, Any]) -> dict[str, Any]:
    """One simulated dataset as training.json keeps it: its sizes and the command that writes it again."""
    if "sequences" not in dataset:
        return {"root": dataset["root"], "manifest": "not found when exporting"}
    keep = ("root", "simulator", "seed", "sequences", "frames_per_sequence", "frames", "sensor", "styles", "actions")
    return {**{k: dataset[k] for k in keep}, "command": data_command(dataset)}


def training_record(cfg: TrainConfig, dataset: dict[str, Any], commands: list[str],
                    native: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """training.json: everything needed to train this release again besides the repository at `git_commit`
    and the weights `config.init_from` names. The job dir, its logs and its data folder stay behind, so
    the config and the data are copied here rather than referred to. `native` summarises `data_roots`."""
    simulated = _data_record(dataset) if cfg.data_root else None
    return {
        "commands": commands,
        "git_commit": _git_commit(),
        "config": cfg.to_dict(),
        "data": {
            "simulated": simulated,
            "native": [_data_record(d) for d in native or []],
            "recordings": [_recording_summary(r) for r in cfg.recordings],
            "recording_fraction": cfg.recording_fraction if cfg.data_root and cfg.recordings else None,
        },
    }


def launch_commands(progress: dict[str, Any]) -> list[str]:
    """The job's distinct launch commands, in launch order."""
    return list(dict.fromkeys(launch["command"] for launch in progress["launches"]))


def configs_outside_the_repository(commands: list[str]) -> list[str]:
    """The `--config` files of `commands` that git does not track in this repository: a fresh clone lacks
    them, so the card must say where the config they held is kept instead (training.json)."""
    outside = []
    for command in commands:
        words = command.split()
        if "--config" not in words or words.index("--config") + 1 == len(words):
            continue
        config = words[words.index("--config") + 1]
        try:
            tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", config], cwd=REPO_ROOT,
                                     capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):  # no git here: nothing to say either way
            continue
        if Path(config).is_absolute() or not tracked:
            outside.append(config)
    return list(dict.fromkeys(outside))


def loss_curve_rows(losses: list[list[float]], points: int = 8) -> list[tuple[int, float]]:
    """A few (iteration, mean loss over the preceding stretch) rows summarising the curve."""
    if not losses:
        return []
    n = len(losses)
    edges = sorted({max(1, round(n * k / points)) for k in range(1, points + 1)})
    rows, prev = [], 0
    for edge in edges:
        window = losses[prev:edge]
        rows.append((int(window[-1][0]), sum(v for _, v in window) / len(window)))
        prev = edge
    return rows


def card_metadata(base_model: str | None = None) -> str:
    """The card's YAML front matter, as huggingface_hub writes it (the Hub reads it on upload)."""
    from huggingface_hub import ModelCardData

    return f"---\n{ModelCardData(**CARD_METADATA, base_model=base_model).to_yaml()}\n---\n"


def _grid_name(sensor: dict[str, Any]) -> str:
    """A sensor entry of a manifest or config as the card names it: "hdl64 (64 x 2048)"."""
    return f"{sensor['name']} ({len(sensor['elevations_deg'])} x {sensor['width']})"


def _grids(native: list[dict[str, Any]]) -> str:
    """The native datasets' sensors as the card names them: "hdl64 (64 x 2048), vlp16 (16 x 1024)"."""
    return ", ".join(_grid_name(d["sensor"]) for d in native if "sensor" in d)


def card_intro(model: WorldModel, sensor: dict[str, Any], native: list[dict[str, Any]] | None = None,
               default: bool = True) -> list[str]:
    """The card's title and first paragraph: what the network is, which sensors it saw and which sampling rules
    its config switches on. Only the release the app loads by default is titled the default one."""
    model_cfg, parameters = model.config, model.num_parameters()
    seen = ([f"Trained at the native grids of {_grids(native)}, it draws each frame in the geometry of the",
             "sweep it is given (or of the sensor asked for), reading every pixel's elevation and azimuth from its",
             "condition."] if native else [])
    return [
        "# LidarVerse default world model" if default else "# LidarVerse world model",
        "",
        f"A causal, few-step (rectified flow, {model_cfg.default_steps} Euler steps from noise tempered to "
        f"{model_cfg.default_noise_scale:g} by default), block-autoregressive LiDAR world model:",
        f"a {parameters / 1e6:.2f} M-parameter range-image UNet with circular azimuth padding that generates the next",
        f"360° sweep of a {sensor['name']} ({len(sensor['elevations_deg'])} x {sensor['width']}). Each frame starts from a",
        "deterministic prior (the rolling spatial cache of what was observed, and in free generation of what was",
        "generated, else the HD map's ground, buildings, walls and fences, with the actors' 3-D boxes in front)",
        "and the network predicts a log-range residual to it plus a return (ray-drop) logit, conditioned on the",
        "cache, the map's geometry (green areas and the trees and hedges it lists included) and classes, the actor",
        "layout and beam/azimuth coordinates. Where a sampled range lies within "
        f"{model_cfg.prior_snap:g} (log-range) of the prior's it keeps",
        "the prior's exact range (`prior_snap`): smaller corrections are the residual head's noise.",
        *(["A keep gate (a fourth output, trained with cross-entropy on \"the return lies within that tolerance of",
           "the prior's range\") keeps the prior's range wherever it judges that the likelier outcome, rather than",
           "leaving the choice to the sampler's noise."] if model_cfg.keep_gate else []),
        *(["A pixel the prior misses starts from its nearest neighbour's range (`gap_fill`), not from flat ground:",
           "a hole in a cached wall starts at the wall."] if model_cfg.gap_fill else []),
        *seen,
        "It was trained in this repository, on the CPU, from the procedural simulator only.",
    ]


def _simulator_note(version: int) -> str:
    return (" (this checkout's)." if version == SIMULATOR_VERSION else
            f"; this checkout simulates version {SIMULATOR_VERSION}, so the same seeds give other drives: check out "
            f"a commit whose `lidar.sim.dataset.SIMULATOR_VERSION` is {version} to write the same data.")


def card_native_data(cfg: TrainConfig, native: list[dict[str, Any]]) -> list[str]:
    """The per-sensor datasets (`data_roots`): one row per sensor with the command that writes it again."""
    lines = ["Drives of each sensor at its native grid (`data_roots`)"
             + (f", each sample an azimuth window of about {cfg.crop_pixels:,} pixels of the full ring "
                "(`crop_pixels`):" if cfg.crop_pixels else ", full rings:"), "",
             "| sensor | beams x columns | drives | frames | written by |", "|---|---|---|---|---|"]
    for d in native:
        if "sequences" not in d:
            lines.append(f"| – | – | – | – | `{d['root']}` (no manifest found when exporting) |")
            continue
        sensor = d["sensor"]
        lines.append(f"| {sensor['name']} | {len(sensor['elevations_deg'])} x {sensor['width']} | {d['sequences']} | "
                     f"{d['frames']} | `{data_command(d)}` |")
    versions = sorted({d["simulator"] for d in native if "simulator" in d})
    if len(versions) == 1:
        lines += ["", f"Made by simulator version {versions[0]}" + _simulator_note(versions[0])]
    elif versions:
        lines += ["", f"Made by simulator versions {', '.join(map(str, versions))}."]
    return lines


def card_training_data(cfg: TrainConfig, dataset: dict[str, Any], native: list[dict[str, Any]] | None = None) -> list[str]:
    """Where the samples come from and how their conditions are corrupted, so a reader can rebuild the data."""
    lines = ["## Training data", ""]
    if "sequences" in dataset:
        version = dataset["simulator"]
        lines += [
            f"`{data_command(dataset)}`: {dataset['sequences']} simulated drives, {dataset['frames']} frames at 10 Hz, "
            f"made by simulator version {version}" + _simulator_note(version),
            f"Styles {dataset['styles']}, actions {dataset['actions']}. World seeds are drawn from dataset seed "
            f"{dataset['seed']}; evaluation uses worlds from other dataset seeds and checks they are disjoint.",
        ]
    elif cfg.data_root:
        lines.append(f"Dataset at `{dataset['root']}` (no manifest found when exporting).")
    if native:
        lines += [""] * (len(lines) > 2) + card_native_data(cfg, native)
    if cfg.recordings:
        share = f"{cfg.recording_fraction:.0%} of the samples" if cfg.data_root else "every sample"
        lines.append(f"Recorded drives ({share}, no map and no layout): {', '.join(f'`{r}`' for r in cfg.recordings)}.")
    lines += [
        "",
        "Each sample is one frame's range image as the target; the condition is built with the same",
        "`inference.conditioning.build_condition` rollout uses (in its two halves), from 1 to "
        f"{cfg.cache_frames} previous ground-truth frames",
        "unprojected, corrupted with `augment_cache_points` "
        f"(dropout {cfg.augment.dropout}, range noise {cfg.augment.range_noise} m, pose jitter "
        f"{cfg.augment.jitter_translation} m / {cfg.augment.jitter_rotation_deg}°) and merged in a `SpatialCache`; "
        f"{cfg.augment.fov_crop:.0%} of the time (`fov_crop`) only a narrower sensor's beams are cached;",
        *([f"{cfg.augment.forecast_gap:.0%} of the time (`forecast_gap`) the cache ends 1-{FORECAST_FRAMES} frames "
           "before the target, as a forecast's does at its horizons;"] if cfg.augment.forecast_gap else []),
        f"the actor layout is the frame's boxes with {cfg.augment.layout_missing:.0%} missing, centres shifted by "
        f"{cfg.augment.layout_center_noise} m and, {cfg.augment.layout_stale:.0%} of the time, 1-3 frames stale.",
        f"The cache is emptied with probability {cfg.model['p_drop_cache']} (first frame), the map dropped with "
        f"probability {cfg.model['p_drop_map']} (free generation / CFG) and the layout with "
        f"{cfg.model.get('p_drop_layout', 0.0)} (real-data forecasting).",
        "",
    ]
    return lines


def model_card(cfg: TrainConfig, progress: dict[str, Any], dataset: dict[str, Any], iteration: int,
               model: WorldModel, weights: Path, metrics: dict[str, Any] | None, notes: list[str],
               base_model: str | None = None, pictures: list[str] | None = None,
               native: list[dict[str, Any]] | None = None, folder: str | None = None) -> str:
    """The card of a release that a reader loads as `folder` (a path or a Hub source; default: the release the app
    loads), which its load and evaluate commands name."""
    default = shown_path(DEFAULT_MODEL)
    folder = folder or default
    sensor = cfg.model["sensor"]
    native = native or []
    launches = progress["launches"]
    commands = launch_commands(progress)
    outside = configs_outside_the_repository(commands)
    if outside:
        logger.warning("the job's config %s is not in the repository; the card points to %s instead",
                       ", ".join(outside), TRAINING_NAME)
    hardware = list(dict.fromkeys(launch["hardware"] for launch in launches))
    speed = launches[-1].get("samples_per_s") if launches else None
    wall = wall_seconds(progress)
    lines = [
        card_metadata(base_model),
        *card_intro(model, sensor, native, default=folder == default),
        "",
        "| file | what |",
        "|---|---|",
        f"| `model.safetensors` | EMA weights at iteration {iteration} ({weights.stat().st_size / 1e6:.1f} MB) |",
        "| `config.json` | architecture (`model`), sensor, normalisation, map classes, training summary |",
        f"| `{TRAINING_NAME}` | how to train it again: the resolved training config (`config`), the data "
        "(`data`: the simulator version, seed and sizes, recordings), the launch commands and the git commit |",
        "| `README.md` | this card |",
        "",
        f"Load it with `inference.load_pipeline(\"{folder}\")`"
        + (" (the app does this by default)." if folder == default else "."),
        "",
    ]
    lines += card_training_data(cfg, dataset, native)
    lines += [
        "## Training",
        "",
        "```bash",
        *commands,
        "```",
        "",
        *([f"The config {', '.join(f'`{c}`' for c in outside)} is not in the repository: `{TRAINING_NAME}` holds "
           "the config it resolved to (`config`); write that to a file and pass it as `--config`.", ""]
          if outside else []),
        *([f"- initialised from `{cfg.init_from}` (`init_from`: fine-tuned from that model's weights)"]
          if cfg.init_from else []),
        f"- iterations: {iteration} of {cfg.max_iters} (batch {cfg.batch_size} per rank), "
        f"{len(launches)} launch(es) (the job resumes by itself from its checkpoints)",
        f"- wall time: {wall / 60:.1f} min of training, summed over launches",
        f"- hardware: {'; '.join(hardware) or 'unknown'}",
        f"- throughput: {speed:.1f} samples/s at the end of the last launch" if speed else "- throughput: not logged",
        f"- optimiser: AdamW lr {cfg.lr:g}, betas {list(cfg.betas)}, weight decay {cfg.weight_decay:g}, "
        f"{cfg.warmup_iters} warm-up steps then cosine to {cfg.min_lr_ratio:g} x lr; grad clip {cfg.grad_clip:g}",
        f"- EMA decay {cfg.ema_decay} from iteration {cfg.ema_start_iter}; the release holds the EMA weights",
        "- objective: rectified flow on (range, intensity, return); the network predicts the clean image as a "
        "log-range residual to its geometric prior plus a return logit: L1 on range and intensity where the "
        "target returns, BCE on the return (`inference.flow.flow_matching_loss`, uniform t)"
        + (", BCE on the keep gate where the prior and the target both return" if cfg.model.get("keep_gate") else ""),
        "",
    ]
    rows = loss_curve_rows(progress["losses"])
    if rows:
        lines += ["Loss curve (mean training loss over each stretch ending at the iteration):", "",
                  "| iteration | loss |", "|---|---|"]
        lines += [f"| {it} | {loss:.4f} |" for it, loss in rows]
        lines.append("")
    lines += ["## Evaluation", ""]
    if metrics is None:
        lines += [f"Not evaluated yet: run `python -m training.evaluate --model {folder} --json`.", ""]
        lines += picture_lines(pictures or [])
    else:
        lines += evaluation_section(metrics, pictures or [])
    if notes:
        lines += ["## Notes", "", *[f"- {note}" for note in notes], ""]
    lines += [
        "## Limitations",
        "",
        "- Trained on simulated worlds only (boxes, cylinders and ellipsoids on a procedural road network); real",
        "  scans are out of distribution. On them there is no map or layout, so the prior is the observed sweep",
        "  moved to the new pose and the model mostly fills its holes.",
        "- What the map does not list (poles, signs, the rooms behind windows) is generated from scratch where",
        "  nothing observed covers it, and comes out softer than the ground truth; the map lists buildings, green",
        "  areas, barriers (walls, fences) and plants (tree crowns, hedges) only as extruded footprints.",
        "- Forecasts condition every frame on what was observed, not on their own earlier frames (unless",
        "  `feedback=True`): fed back, a 4-step model's errors compound over a second.",
        sensor_limitation(sensor, native, own_grid=bool(cfg.data_root or cfg.recordings) or not native),
        "- Small and briefly trained on 2 CPU cores; quality figures above are what it reaches, not a ceiling.",
        "",
    ]
    return "\n".join(lines)


def sensor_limitation(sensor: dict[str, Any], native: list[dict[str, Any]], own_grid: bool = True) -> str:
    """The card's line on which beam tables the network has seen (the model's own grid where `own_grid`, each
    of `native`'s): another one is drawn from the same per-pixel elevation and azimuth condition, which holds
    only within the elevations it was trained on."""
    tables = [*([sensor] if own_grid else []), *(d["sensor"] for d in native if "sensor" in d)] or [sensor]
    low = min(min(t["elevations_deg"]) for t in tables)
    high = max(max(t["elevations_deg"]) for t in tables)
    names = ", ".join(dict.fromkeys(map(_grid_name, tables)))
    return (f"- Trained on the beam tables of {names}: elevations {low:.1f}° to {high:.1f}°. Any other beam table and "
            "column count is drawn from each pixel's elevation and azimuth, untested outside that span.")


def picture_lines(names: list[str]) -> list[str]:
    return [line for name in names for line in (f"![{picture_caption(name)}]({name})", "")]


def evaluation_section(metrics: dict[str, Any], pictures: list[str] | None = None) -> list[str]:
    """The card's metrics from `python -m training.evaluate --json` output (the model's own grid), its
    per-sensor runs under `sensors` (`--sensor`), and real-recording reports (`python -m training.evaluate_real
    --json`) under `real_sequences`, each followed by its pictures; pictures no section claims come last."""
    from training.evaluate import KITTI_PICTURE, format_report, format_sensor_table, sim_pictures
    from training.evaluate_real import format_real, recording_slug
    from training.evaluate_upsample import format_report as format_upsample

    pictures = list(pictures or [])

    def claim(names: list[str], recording: str | None = None) -> list[str]:
        """The pictures among `names`, or of `recording`, in the order they were given; taken off the rest."""
        mine = [n for n in pictures if n in names or (recording and PICTURE.fullmatch(n)["recording"] == recording)]
        for name in mine:
            pictures.remove(name)
        return picture_lines(mine)

    lines: list[str] = []
    if "per_ray" in metrics:
        lines += ["### Simulated drives", "", format_report(metrics), ""]
        lines += claim([*sim_pictures(), KITTI_PICTURE])
    if metrics.get("sensors"):
        reports = metrics["sensors"]
        lines += ["### Simulated drives, sensor by sensor", "",
                  "Each trained sensor's own held-out drives at its native grid (`python -m training.evaluate "
                  "--sensor NAME --columns W --no-real`), the mean over frames 1-10:", "",
                  format_sensor_table(reports), ""]
        lines += claim([n for r in reports for n in sim_pictures(r["protocol"]["sensor"])])
    for report in metrics.get("real_sequences", []):
        lines += [f"### Real recordings: `{report['recording']}`, forecasts against the sweeps that followed", "",
                  format_real(report), ""]
        lines += claim([], recording_slug(report["recording"]))
    if "upsampling" in metrics:
        lines += ["### Upsampling and completion of real sweeps", "",
                  "Rings or rays of real sweeps dropped and filled again (`python -m training.evaluate_upsample`), "
                  "scored against what the sensor measured there:", "", format_upsample(metrics["upsampling"]), ""]
        lines += claim([n for n in pictures if PICTURE.fullmatch(n)["up"]])
    return lines + picture_lines(pictures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job_dir", type=Path, help="training job dir (with config.json and checkpoints/)")
    parser.add_argument("out_dir", type=Path, help="release folder to write (e.g. weights/default)")
    parser.add_argument("--metrics", type=Path, default=None, help="`training.evaluate --json` output for the card")
    parser.add_argument("--sensor-metrics", type=Path, action="append", default=[],
                        help="`training.evaluate --sensor NAME --json` output, one per trained sensor (repeatable)")
    parser.add_argument("--real-metrics", type=Path, action="append", default=[],
                        help="`training.evaluate_real --json` output, one section per recording (repeatable)")
    parser.add_argument("--upsample-metrics", type=Path, default=None,
                        help="`training.evaluate_upsample --json` output for the card's upsampling section")
    parser.add_argument("--fill", type=Path, default=None,
                        help="a fill network (`training.train_fill`'s fill.safetensors) for the release to ship")
    parser.add_argument("--note", action="append", default=[], help="a line for the card's Notes (repeatable)")
    parser.add_argument("--pictures", type=Path, default=None,
                        help="folder of `training.evaluate --pictures` output; the card shows its BEV panels")
    parser.add_argument("--base-model", metavar="ORG/NAME", default=None,
                        help="Hub id of the release this job continued (card metadata)")
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", default=None,
                        help="then upload the release to this Hub model repo (created if missing; token from HF_TOKEN)")
    parser.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.revision is not None and args.push_to_hub is None:
        parser.error("--revision needs --push-to-hub")
    if args.push_to_hub is not None:
        _check_repo_id(parser, args.push_to_hub)
    if not (args.job_dir / CONFIG_NAME).is_file():
        print(f"error: {args.job_dir} is not a training job dir: it has no {CONFIG_NAME}", file=sys.stderr)
        return 2
    metrics = json.loads(args.metrics.read_text()) if args.metrics else None
    if args.sensor_metrics:
        metrics = {**(metrics or {}), "sensors": [json.loads(f.read_text()) for f in args.sensor_metrics]}
    if args.real_metrics:
        metrics = {**(metrics or {}), "real_sequences": [json.loads(f.read_text()) for f in args.real_metrics]}
    if args.upsample_metrics:
        metrics = {**(metrics or {}), "upsampling": json.loads(args.upsample_metrics.read_text())}
    try:
        hub_source = None if args.push_to_hub is None else args.push_to_hub + (f"@{args.revision}" if args.revision else "")
        export(args.job_dir, args.out_dir, metrics, args.note, args.base_model, args.pictures, args.fill, hub_source)
    except (FileExistsError, FileNotFoundError, ReleaseVerificationError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.push_to_hub is None:
        return 0
    from huggingface_hub.errors import HfHubHTTPError

    try:
        push_to_hub(args.out_dir, args.push_to_hub, args.revision)
    except (HfHubHTTPError, OSError) as e:
        print(f"error: {args.out_dir} is published locally, but pushing it to {args.push_to_hub} failed: {e}",
              file=sys.stderr)
        return 1
    return 0


def _check_repo_id(parser: argparse.ArgumentParser, repo_id: str) -> None:
    """Fail on a malformed Hub id before any work is done."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        parser.error(f"--push-to-hub {repo_id!r} is not a Hub repo id: {e}")
    if repo_id.count("/") != 1:
        parser.error(f"--push-to-hub expects ORG/NAME, got {repo_id!r}")


if __name__ == "__main__":
    sys.exit(main())
