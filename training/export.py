"""Turn a training job into a release: `python -m training.export JOB_DIR OUT_DIR [--metrics EVAL.json]`.

A release is what the app loads (DESIGN.md): `model.safetensors` holding the EMA weights with metadata
naming the iteration and the source, `config.json` with the architecture, sensor and normalisation, and
`README.md`, the model card. The card is written from what the job recorded (its resolved config,
`progress.json`, the dataset manifest) and, when given, an evaluation report, so it states facts rather
than intentions. The weights are read back through `inference.load_pipeline`, the path every user of
the release takes, and must reproduce the job's EMA exactly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from checkpointing import atomic_write_text
from inference import load_pipeline
from inference.loader import CONFIG_NAME, WEIGHTS_NAME
from lidar.sim.dataset import MANIFEST
from lidar.sim.hdmap import MAP_CLASSES
from training.config import TrainConfig
from training.progress import read_progress, wall_seconds

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
#: How the network's image channels relate to metres and intensities (lidar.range_image.encode_range).
NORMALISATION = {
    "range": "encode_range: 2 * log1p(clip(r, 0, max_range)) / log1p(max_range) - 1; -1 = no return",
    "intensity": "intensity * 2 - 1 where a return, -1 where none",
    "decode": "decode_range; anything decoding below min_range is a ray drop",
}


def export(job_dir: Path, out_dir: Path, metrics: dict[str, Any] | None = None, notes: list[str] | None = None) -> Path:
    """Write the release of the job's newest valid checkpoint into `out_dir`; return the weights path."""
    # 1. The job's own record of how it was trained.
    cfg = TrainConfig.from_json(job_dir / CONFIG_NAME)
    progress = read_progress(job_dir)
    # 2. The EMA weights, through the same loader the app uses (safe formats only, shapes checked).
    pipe = load_pipeline(str(job_dir), device="cpu", dtype=torch.float32)
    model, provenance = pipe.model, pipe.provenance
    if provenance.weights != "ema":
        raise ValueError(f"job {job_dir} has no EMA weights at iteration {provenance.iteration}; a release ships the EMA")
    iteration = int(provenance.iteration)
    # 3. Weights with self-describing metadata, then the config, then the card.
    out_dir.mkdir(parents=True, exist_ok=True)
    source = f"{job_dir.resolve().name}/{Path(provenance.resolved_path).name}"
    metadata = {
        "format": "lidarverse-release",
        "iteration": str(iteration),
        "weights": "ema",
        "ema": "true",
        "source": source,
        "git_commit": _git_commit(),
        "exported_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": json.dumps(model.config.to_dict()),
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    weights = out_dir / WEIGHTS_NAME
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".safetensors.tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    save_file(state, str(tmp_path), metadata=metadata)
    tmp_path.chmod(0o644)  # NamedTemporaryFile makes it private; a release is read by everyone
    os.replace(tmp_path, weights)
    dataset = _dataset_summary(Path(cfg.data_root))
    release_config = {
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
            "world_seeds": dataset.get("world_seeds", []),
        },
    }
    atomic_write_text(out_dir / CONFIG_NAME, json.dumps(release_config, indent=2) + "\n")
    card = model_card(cfg, progress, dataset, iteration, model.num_parameters(), weights, metrics, notes or [])
    atomic_write_text(out_dir / CARD_NAME, card)
    logger.info("exported %s (iteration %d, %.1f MB) to %s", source, iteration, weights.stat().st_size / 1e6, out_dir)
    return weights


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
        "seed": manifest["seed"],
        "sequences": len(seqs),
        "frames": sum(s["frames"] for s in seqs),
        "frames_per_sequence": sorted({s["frames"] for s in seqs}),
        "sensor": manifest["sensor"],
        "styles": styles,
        "actions": actions,
        "world_seeds": sorted(int(s["world_seed"]) for s in seqs),
    }


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


def model_card(cfg: TrainConfig, progress: dict[str, Any], dataset: dict[str, Any], iteration: int,
               parameters: int, weights: Path, metrics: dict[str, Any] | None, notes: list[str]) -> str:
    sensor = cfg.model["sensor"]
    launches = progress["launches"]
    commands = list(dict.fromkeys(launch["command"] for launch in launches))  # in launch order
    hardware = list(dict.fromkeys(launch["hardware"] for launch in launches))
    speed = launches[-1].get("samples_per_s") if launches else None
    wall = wall_seconds(progress)
    lines = [
        "# LidarVerse default world model",
        "",
        "A causal, few-step (rectified flow, 4 Euler steps by default), block-autoregressive LiDAR world model:",
        f"a {parameters / 1e6:.2f} M-parameter range-image UNet with circular azimuth padding that generates the next",
        f"360° sweep of a {sensor['name']} ({len(sensor['elevations_deg'])} x {sensor['width']}) conditioned on the HD map",
        "ray-cast from the new pose, the rolling spatial cache of everything generated so far, and beam/azimuth",
        "coordinates. It was trained in this repository, on the CPU, from the procedural simulator only.",
        "",
        "| file | what |",
        "|---|---|",
        f"| `model.safetensors` | EMA weights at iteration {iteration} ({weights.stat().st_size / 1e6:.1f} MB) |",
        "| `config.json` | architecture (`model`), sensor, normalisation, map classes, training summary |",
        "| `README.md` | this card |",
        "",
        "Load it with `inference.load_pipeline(\"weights/default\")` (the app does this by default).",
        "",
        "## Training data",
        "",
    ]
    if "sequences" in dataset:
        lines += [
            f"`python -m lidar.sim --sensor {sensor['name']} --width {sensor['width']} --sequences "
            f"{dataset['sequences']} --frames {dataset['frames_per_sequence'][0]} --seed {dataset['seed']} "
            f"--out {dataset['root']}`: {dataset['sequences']} simulated drives, {dataset['frames']} frames at 10 Hz.",
            f"Styles {dataset['styles']}, actions {dataset['actions']}. World seeds are drawn from dataset seed "
            f"{dataset['seed']}; evaluation uses worlds from other dataset seeds and checks they are disjoint.",
        ]
    else:
        lines.append(f"Dataset at `{dataset['root']}` (no manifest found when exporting).")
    lines += [
        "",
        "Each sample is one frame's range image as the target; the condition is built with the same",
        "`inference.conditioning.build_condition` rollout uses, from 1 to "
        f"{cfg.cache_frames} previous ground-truth frames",
        "unprojected, corrupted with `augment_cache_points` "
        f"(dropout {cfg.augment.dropout}, range noise {cfg.augment.range_noise} m, pose jitter "
        f"{cfg.augment.jitter_translation} m / {cfg.augment.jitter_rotation_deg}°) and merged in a `SpatialCache`;",
        f"the cache is emptied with probability {cfg.model['p_drop_cache']} (first frame) and the map dropped with "
        f"probability {cfg.model['p_drop_map']} (free generation / CFG).",
        "",
        "## Training",
        "",
        "```bash",
        *commands,
        "```",
        "",
        f"- iterations: {iteration} of {cfg.max_iters} (batch {cfg.batch_size} per rank), "
        f"{len(launches)} launch(es) (the job resumes by itself from its checkpoints)",
        f"- wall time: {wall / 60:.1f} min of training, summed over launches",
        f"- hardware: {'; '.join(hardware) or 'unknown'}",
        f"- throughput: {speed:.1f} samples/s at the end of the last launch" if speed else "- throughput: not logged",
        f"- optimiser: AdamW lr {cfg.lr:g}, betas {list(cfg.betas)}, weight decay {cfg.weight_decay:g}, "
        f"{cfg.warmup_iters} warm-up steps then cosine to {cfg.min_lr_ratio:g} x lr; grad clip {cfg.grad_clip:g}",
        f"- EMA decay {cfg.ema_decay} from iteration {cfg.ema_start_iter}; the release holds the EMA weights",
        f"- objective: rectified flow, the network predicting {cfg.model.get('prediction', 'x0')}, "
        f"{'L1' if cfg.loss_norm == 'l1' else 'MSE'} loss (`inference.flow.flow_matching_loss`, uniform t) "
        "for the final launch; a job whose launches changed the objective says so in the notes",
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
        lines += ["Not evaluated yet: run `python -m training.evaluate --model weights/default --json`.", ""]
    else:
        lines += evaluation_section(metrics)
    if notes:
        lines += ["## Notes", "", *[f"- {note}" for note in notes], ""]
    lines += [
        "## Limitations",
        "",
        "- Trained on simulated worlds only (boxes, cylinders and ellipsoids on a procedural road network); real",
        "  scans are out of distribution: forecasts from them show the model's prior more than the scene.",
        f"- One sensor geometry ({sensor['name']}, {sensor['width']} columns); other sensors are re-projected.",
        "- Small and briefly trained on 2 CPU cores; quality figures above are what it reaches, not a ceiling.",
        "",
    ]
    return "\n".join(lines)


def evaluation_section(metrics: dict[str, Any]) -> list[str]:
    """The card's metrics table from `python -m training.evaluate --json` output."""
    from training.evaluate import format_report

    return [format_report(metrics), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job_dir", type=Path, help="training job dir (with config.json and checkpoints/)")
    parser.add_argument("out_dir", type=Path, help="release folder to write (e.g. weights/default)")
    parser.add_argument("--metrics", type=Path, default=None, help="`training.evaluate --json` output for the card")
    parser.add_argument("--note", action="append", default=[], help="a line for the card's Notes (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not (args.job_dir / CONFIG_NAME).is_file():
        print(f"error: {args.job_dir} is not a training job dir: it has no {CONFIG_NAME}", file=sys.stderr)
        return 2
    metrics = json.loads(args.metrics.read_text()) if args.metrics else None
    export(args.job_dir, args.out_dir, metrics, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
