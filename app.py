"""LidarVerse Space: generate a LiDAR world around a driving car, continue a real scan, make a sweep denser,
inspect the model.

UI only. The model (inference), maps (lidar.sim), pictures and viewer files (lidar.render), point-cloud
files (lidar.formats) and what visitors may see and load (app_policy) are other modules' business; this file
holds the page layout, the per-request limits, the per-request scratch folder and the small formatting that
turns a rollout into Gradio outputs.

    python app.py [--model SRC] [--host H] [--port P] [--share] [--threads N] [--dtype D]
                  [--allow-model-switch [--allow-source SRC]...] [--allow-any-source]
    gradio app.py -- [--model SRC] ...      # the same, in Gradio's reload mode (the module-level `demo`)

A public Space serves the model it was started with: visitors can read where it came from (a label,
never a server path) but not switch it, unless the operator allows switching among named sources.

A generation request runs in three parts: prepare (read, check and register the uploads), roll out (the
sampler; on ZeroGPU the only part inside `spaces.GPU`) and deliver (previews, animations and downloads).
Its outputs are named (`Outputs`), and each event maps the names to its components.

Uploads are read, unzipped and registered in worker processes under the server's memory, CPU and time
limits (`lidar.sandbox`), never in the server's own process: a file that crashes its decoder costs a worker.
Every route goes through one bounded queue (`api_open=False`), and each client (by IP address; behind
proxies, the one the nearest proxy saw, see `PROXY_HOPS_ENV`) may hold only a few places in it, send only
small join and call bodies, and upload only so many bytes while Gradio's cache still keeps them. Generation runs on one worker
thread under a lock of its own; a request that is cancelled or whose client disconnects is stopped at its
next checkpoint (a decode, a zip chunk, a registered sweep, a sampler step, a written picture or file), so it
frees the worker, not just Gradio's slot.
"""

# No `from __future__ import annotations`: `gradio app.py` re-executes this file after taking it out of
# sys.modules, and a dataclass with string annotations looks its module up there (None: AttributeError).

# ZeroGPU patches torch's CUDA entry points when `spaces` is imported, so it must come before anything
# that imports torch. Elsewhere (laptop, CI, a dedicated-GPU Space) the package is absent and generation
# simply runs on whatever device the pipeline picked.
try:
    import spaces
except ImportError:
    spaces = None

import argparse
import asyncio
import contextlib
import contextvars
import functools
import io
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
import zipfile
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn

import gradio as gr
import numpy as np
import torch
from gradio.context import LocalContext
from PIL import Image, ImageDraw
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app_policy import (
    DEFAULT_SOURCE,
    SWITCH_ENV,
    ModelSwitch,
    SourceNotOffered,
    public_text,
    source_label,
    switch_policy,
)
from inference import LidarVersePipeline, RolloutResult, load_pipeline, write_rollout
from inference import Progress as RolloutProgress
from inference.limits import APP_LIMITS
from inference.loader import DTYPE_HELP, ModelSourceError, Provenance, env_flag
from inference.network import WorldModelConfig
from inference.observed import ObservedScene, check_inside, observe, record_prefix, shifted_path
from inference.results4d import write_upsample_views, write_views
from inference.upsample import (
    AUTO,
    EDGE_AWARE,
    LEARNED,
    MAX_FACTOR,
    METHODS,
    MODEL,
    RECORD_NAME,
    SWEEP_FORMATS,
    UpsampleResult,
    upsample_target,
    write_upsample,
)
from lidar import render, sandbox
from lidar.cancel import Cancelled, checkpoint, stop_when
from lidar.errors import InputError, shown
from lidar.formats import (
    READ_SUFFIXES,
    Scan,
    check_sensor,
    detect_sensor,
    point_limit,
    read_points,
    write_points,
)
from lidar.range_image import RangeImage
from lidar.real_scans import example_scans_dir, real_scans_dir
from lidar.recordings import CONTAINER_SUFFIXES
from lidar.recordings.argoverse import CALIBRATION_FILE as AV2_CALIBRATION_FILE
from lidar.recordings.argoverse import POSES_FILE as AV2_POSES_FILE
from lidar.recordings.argoverse import SWEEP_FOLDER as AV2_SWEEP_FOLDER
from lidar.recordings.nuscenes import SWEEP_FOLDERS as NUSCENES_SWEEP_FOLDERS
from lidar.sensors import HDL64, PRESETS, Sensor, get_sensor
from lidar.sequence import MAX_SWEEPS
from lidar.sim import STYLES, HDMap, World, make_world, plan_drive
from lidar.vocabulary import ACTION_LABELS, transform_points

logger = logging.getLogger(__name__)

# Server-side limits: a public Space must not let one request hold the GPU or the disk for long. Frames,
# steps and guidance are `APP_LIMITS`, the stricter instance of the library's own (which it checks again).
MAX_FRAMES = APP_LIMITS.max_frames
MAX_STEPS = APP_LIMITS.max_steps
MAX_GUIDANCE = APP_LIMITS.max_guidance
MAX_UPLOAD_MB = 50
#: Longest ROS topic name a visitor may type.
MAX_TOPIC_CHARS = 200
#: Most points one uploaded sweep may hold (refused from its header). The densest real sweeps hold ~0.5 M
#: (an Ouster 128x2048 with two returns); every point costs worker time, ~1 s a million here, and an LZF
#: stream of back-references declares the readers' own 5 M limit in 1 MB.
MAX_UPLOAD_POINTS = 1_000_000
#: Uploads are read and registered in worker processes under the server's limits (`lidar.sandbox`); this
#: many wait started ahead, so a visitor's read pays the hand-over, not an interpreter's start.
WORKER_SPARES = 2
MAX_SEED = APP_LIMITS.max_seed
# Generation holds the model: one at a time per replica, and a bounded wait list so memory stays bounded.
GENERATION_CONCURRENCY = 1
QUEUE_MAX_SIZE = 16
#: Places one client (IP address) may hold in the queue at once, waiting or running: a page load queues
#: two events (model info, map preview) and a click a third, so a visitor does not meet it in normal use;
#: a script that would fill the queue does.
MAX_QUEUED_PER_CLIENT = 4
#: How many proxies in front of the app append the visitor's address to X-Forwarded-For (default: 1 on a
#: Hugging Face Space, else 0). The client is the address the nearest of them saw, counted from the right,
#: since the left end is whatever the client wrote. With 0 it is the connection's peer, as uvicorn reports
#: it (which takes X-Forwarded-For only from 127.0.0.1, so a local reverse proxy needs nothing set).
PROXY_HOPS_ENV = "LIDARVERSE_PROXY_HOPS"
#: Gradio's cache cleaner: every 600 s it deletes uploads and outputs older than 1800 s.
DELETE_CACHE = (600, 1800)
#: Uploads count against these budgets until the cleaner has certainly deleted them (its age plus one
#: period), so the bytes they allow bound the disk that uploads can take.
UPLOAD_WINDOW_S = sum(DELETE_CACHE)
UPLOAD_BYTES_PER_CLIENT = 500 * 2**20
UPLOAD_BYTES_TOTAL = 5 * 2**30
#: How often a running request looks for its client (seconds): a disconnected one is stopped.
CLIENT_POLL_S = 0.2
#: Most bytes of a join or call body, and most file references in one: a request for 50 sweeps (`MAX_SWEEPS`)
#: takes ~25 KB; files themselves go through /upload.
MAX_REQUEST_BODY_BYTES = 256 * 1024
MAX_FILES_PER_REQUEST = MAX_SWEEPS
#: Most characters of one string in a join or call body: the longest legitimate one is an uploaded file's
#: server path (~350). Gradio's own checks quote a value they refuse in full (a choice not in a radio's
#: list), so a longer one is refused here before it can be echoed or logged.
MAX_REQUEST_STRING_CHARS = 1024
#: Seconds a client has to send a join or call body, once its headers are in.
REQUEST_BODY_TIMEOUT_S = 10.0

ACTIONS = {label: action for action, label in ACTION_LABELS.items()}
AUTO_SENSOR = "auto-detect"
#: The generation tab's sensor choice that draws on the served model's own grid.
MODEL_SENSOR = "model default"
#: Columns each preset is offered at in the generation tab: the common 1,024 and the 2,048 of a native
#: HDL-64E (KITTI's records ~2,000 points a ring) or an Ouster in its 2048 mode.
PRESET_WIDTHS = (1024, 2048)
#: Re-simulation sliders: how far the new path may leave the observed one (check_inside has the last word).
MAX_LATERAL_M = 5.0
MAX_FORWARD_M = 8.0
MAX_YAW_DEG = 45.0
#: What a scene's upload may be: sweep files, a zip of them, a recording container, or the loose files of a
#: recording (`_recording_layout`): an Ouster pcap's metadata json, nuScenes tables, Argoverse 2 feathers.
SCENE_SUFFIXES = (*READ_SUFFIXES, ".zip", *CONTAINER_SUFFIXES, ".json", ".feather")
#: The nuScenes tables an upload of LIDAR_TOP sweeps may bring (`lidar.recordings.nuscenes` poses the sweeps
#: with all three), and the version folder they are laid out in.
NUSCENES_TABLES = ("ego_pose.json", "sensor.json", "calibrated_sensor.json")
NUSCENES_VERSION = "v1.0-upload"
#: What names a nuScenes LIDAR_TOP sweep (`<log>__LIDAR_TOP__<microseconds>.pcd.bin`).
NUSCENES_NAME = "__LIDAR_TOP__"
#: Columns of the "Registered prefix" table.
PREFIX_COLUMNS = ["file", "x m", "y m", "z m", "yaw deg", "fitness"]
BEV_EXTENT_M = 50.0
ANIMATION_FPS = 5.0
#: Most points the 3D viewer is sent (observed and generated together; a seeded random subset beyond):
#: a 6 MB PLY. Display only: 32 frames of a 64 x 2048 sensor accumulate millions, and the downloads keep
#: every one.
VIEWER_MAX_POINTS = 400_000
#: About how many rows a range-image picture has: each beam is repeated up to 4 times (a 32-beam sensor 4,
#: a 128-beam one once), so a dense sensor's animation stays small.
RANGE_PICTURE_ROWS = 128
VIEWER_BACKGROUND = (0.05, 0.05, 0.08, 1.0)  # RGBA; dark, so height colours stand out
PATH_COLOUR = (0, 220, 255)
#: The upsample tab's target that takes the factor (`factor - 1` new beams between each two measured ones), and
#: its factor by default: 2 fits the server's rays with every shipped example (a KITTI 64 x 2,011 sweep becomes
#: 127 x 2,011, 255 k rays; the library's default of 4 would be 509 k, over `APP_LIMITS.max_rays`).
BY_FACTOR = "by factor"
UPSAMPLE_FACTOR = 2
#: The upsample tab's download by default: PCD keeps every point's ring.
UPSAMPLE_FORMAT = "pcd"
#: What the upsample tab takes: a sweep file, or a one-file recording whose first sweep it upsamples (a lab with
#: a sparse sensor records pcaps and bags, not sweep files).
UPSAMPLE_SUFFIXES = (*READ_SUFFIXES, *CONTAINER_SUFFIXES)
#: Real sweeps shipped with the app (licences in its README): the forecast examples of a fresh clone.
EXAMPLE_SCANS_DIR = example_scans_dir()
# The shared real scans (more forecast examples); absent in a bare clone.
REAL_SCANS_DIR = real_scans_dir()


#: The loaded model. Swapped whole by the Model tab; each request reads it once, at its start.
PIPELINE: LidarVersePipeline | None = None
#: What visitors see as the loaded model's source: a repo-relative path, a Hub id or a folder name.
SOURCE_LABEL = DEFAULT_SOURCE
#: The dtype every loaded model runs in (`--dtype`); None: the device's default (`inference.loader`).
DTYPE: str | None = None


#: Which sources visitors may switch the model to (`app_policy.switch_policy`); None: no switching.
SWITCH: ModelSwitch | None = None


def _pipeline() -> LidarVersePipeline:
    if PIPELINE is None:
        raise gr.Error("No model is loaded yet; start the app with `python app.py` or load one in the Model tab.")
    return PIPELINE


# ----------------------------------------------------------------------------------------------------------
# Input checks: every number is re-checked here because API clients can send anything.


def _whole_number(value: Any, name: str, lo: int, hi: int) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be a whole number from {lo} to {hi}; got {shown(value)}.") from None
    if not math.isfinite(number) or number != int(number) or not lo <= number <= hi:
        raise gr.Error(f"{name} must be a whole number from {lo} to {hi}; got {shown(value)}.")
    return int(number)


def _rollout_numbers(frames: Any, steps: Any, seed: Any) -> tuple[int, int, int]:
    """Frames, sampling steps and seed of every rollout tab, checked against the server's limits."""
    return (
        _whole_number(frames, "Frames", 1, MAX_FRAMES),
        _whole_number(steps, "Sampling steps", 1, MAX_STEPS),
        _whole_number(seed, "Seed", 0, MAX_SEED),
    )


def _real_number(value: Any, name: str, lo: float, hi: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be a number from {lo} to {hi}; got {shown(value)}.") from None
    if not math.isfinite(number) or not lo <= number <= hi:
        raise gr.Error(f"{name} must be a number from {lo} to {hi}; got {shown(value)}.")
    return number


def _choice(value: Any, name: str, choices: dict[str, str] | tuple[str, ...]) -> str:
    if value not in choices:
        raise gr.Error(f"{name} must be one of {', '.join(map(repr, choices))}; got {shown(value)}.")
    return choices[value] if isinstance(choices, dict) else value


def _grid_label(sensor: Sensor) -> str:
    """How the generation tab names a preset at its columns: "hdl64 (64 x 2048)"."""
    return f"{sensor.name} ({sensor.height} x {sensor.width})"


def _preset_grids() -> dict[str, Sensor]:
    """Every preset at each of `PRESET_WIDTHS` columns within the app's rays per frame (`APP_LIMITS.max_rays`),
    by its label."""
    grids = (preset.with_width(width) for preset in PRESETS.values() for width in PRESET_WIDTHS)
    return {_grid_label(grid): grid for grid in grids if grid.height * grid.width <= APP_LIMITS.max_rays}


#: The sensors the generation tab offers besides the model's own, by label.
GENERATION_SENSORS = _preset_grids()


def _frames_sensor(pipe: LidarVersePipeline, sensor: Sensor | None = None, scans: list[Scan] | None = None) -> Sensor:
    """The grid a request's frames are drawn on, as the pipeline picks it (`sensor`, else the newest of `scans`'
    own beams and columns, else the model's), at most `APP_LIMITS.max_rays`: a denser one keeps its beams at
    fewer columns. Worked out before the rollout, so on ZeroGPU the GPU part does not measure the scans."""
    with _user_errors("Cannot draw frames on this sensor"):
        grid = pipe.grid(sensor, scans)
    if grid.height * grid.width > APP_LIMITS.max_rays:
        grid = grid.with_width(max(APP_LIMITS.max_rays // grid.height, 1))
    return grid


def _upload_path(upload: str | Path | None, suffixes: tuple[str, ...] = READ_SUFFIXES) -> Path:
    """The uploaded file's path, after the checks that need no parsing: present, size, extension."""
    if upload is None:
        raise gr.Error("No scan uploaded: drop a .bin, .pcd, .ply, .npy or .las file on 'Scan'.")
    path = Path(upload)
    if not path.is_file():
        raise gr.Error(f"The uploaded file {shown(path.name)} could not be found on the server; upload it again.")
    size = path.stat().st_size
    if size == 0:
        raise gr.Error(f"{shown(path.name)} is empty (0 bytes); expected a LiDAR scan.")
    if size > MAX_UPLOAD_MB * 1024 * 1024:
        raise gr.Error(f"{shown(path.name)} is {size / 2**20:.1f} MB; uploads are limited to {MAX_UPLOAD_MB} MB.")
    if path.suffix.lower() not in suffixes:
        raise gr.Error(f"{shown(path.name)} has an unsupported extension; expected one of {', '.join(suffixes)}.")
    return path


@contextlib.contextmanager
def _user_errors(what: str, path: Path | None = None) -> Iterator[None]:
    """The UI boundary: an `InputError` (the readers', the registration's and the pipeline's input checks)
    becomes a message for the visitor; anything else is a bug, logged with its traceback and reported
    without one, so a failure never takes the server down or leaks internals. `Cancelled` (a
    `BaseException`) passes through to the worker."""
    try:
        yield
    except gr.Error:
        raise
    except InputError as err:
        message = public_text(str(err) if path is None else str(err).replace(str(path), path.name))
        raise gr.Error(f"{what}: {message}") from None
    except Exception as err:
        logger.exception("%s failed", what)
        raise gr.Error(f"{what} failed on the server ({type(err).__name__}); the details are in the server log.") from None


# ----------------------------------------------------------------------------------------------------------
# Per-request scratch space and outputs.


@contextlib.contextmanager
def _request_dir() -> Iterator[Path]:
    """A scratch folder for one request, removed when the request is done.

    Gradio copies every returned file into its own cache (bounded by `delete_cache`) while post-processing
    a yield, so the callbacks yield their outputs from inside this block and the folder goes right after.
    """
    path = Path(tempfile.mkdtemp(prefix="lidarverse-request-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _progress_callback(progress: gr.Progress, label: str) -> Callable[[RolloutProgress], None]:
    """Adapt the pipeline's per-step callback (frame, frames, step, steps, fraction) to Gradio's bar."""

    def callback(p: RolloutProgress) -> None:
        checkpoint()  # after every sampler step: a cancelled request stops here
        progress(p.fraction, desc=f"{label}: frame {p.frame + 1}/{p.frames}, step {p.step}/{p.steps}")

    return callback


# ----------------------------------------------------------------------------------------------------------
# The worker: one generation at a time, and cancelled work stops.

#: Held by the generation that is running, from its start until its thread has stopped; a cancelled
#: request keeps it until it reaches a checkpoint, so the next one cannot start beside it.
_GENERATION = threading.Lock()
#: The one thread generations run on, step by step (each step runs the callback up to its next yield).
_WORKER = ThreadPoolExecutor(1, thread_name_prefix="lidarverse-generation")
_DONE = object()


def _step(gen: Iterator[tuple], stop: threading.Event) -> Any:
    """Run `gen` to its next output on the worker thread; `checkpoint()` inside raises once `stop` is set."""
    with stop_when(stop):
        return next(gen, _DONE)


def _client_gone() -> Callable[[], bool]:
    """A test of whether this request's client has gone (disconnected, or its event was cancelled).

    Gradio marks such an event not alive, but only its next yield would notice; a rollout yields once, at
    its end. Reads Gradio's queue (`Event.alive`), so test_app_server pins that this still works.
    """
    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    if blocks is None or event_id is None:  # called outside a Gradio event (tests, scripts)
        return lambda: False

    def gone() -> bool:
        event = blocks._queue.event_ids_to_events.get(event_id)
        return event is not None and not event.alive

    return gone


def _retrieved(future: asyncio.Future) -> None:
    """Mark a step's outcome as read, so asyncio does not log a cancelled request's `Cancelled` as lost."""
    if not future.cancelled():
        future.exception()


def _finish(step: Future | None, gen: Iterator[tuple] | None, name: str) -> None:
    """Once the last step has stopped, close the generator (its scratch folder goes) and free the worker."""

    def finish(_: Any = None) -> None:
        try:
            if step is not None and not step.cancelled() and isinstance(step.exception(), Cancelled):
                logger.info("%s stopped at a checkpoint: its request was cancelled or its client left", name)
            if gen is not None:
                gen.close()
        except Exception:
            logger.exception("closing a generation failed")
        finally:
            _GENERATION.release()

    if step is None or step.done():
        _WORKER.submit(finish)
    else:
        step.add_done_callback(finish)  # runs on the worker thread when the step stops


def _worker(fn: Callable[..., Iterator[tuple]]) -> Callable[..., AsyncIterator[tuple]]:
    """`fn` (a generation callback, a generator) as Gradio's async generator, run on the worker thread.

    It waits for the generation lock (cancellable while it waits), runs `fn` one output at a time, and stops
    it at its next checkpoint when the request is cancelled (Gradio cancels this task, or closes it) or its
    client goes. The lock is released when `fn`'s thread has stopped, not when Gradio gives up on it.
    """

    @functools.wraps(fn)  # Gradio reads the signature (the gr.Progress parameter) through __wrapped__
    async def run(*args: Any, **kwargs: Any) -> AsyncIterator[tuple]:
        while not _GENERATION.acquire(blocking=False):
            await asyncio.sleep(CLIENT_POLL_S)
        stop, gone = threading.Event(), _client_gone()
        context = contextvars.copy_context()  # Gradio's event context, which the progress bar reads
        step: Future | None = None
        gen: Iterator[tuple] | None = None
        try:
            gen = fn(*args, **kwargs)  # a generator: nothing runs yet
            while True:
                step = _WORKER.submit(context.run, _step, gen, stop)
                waiting = asyncio.wrap_future(step)
                waiting.add_done_callback(_retrieved)  # read even when this task is cancelled mid-step
                while not (await asyncio.wait({waiting}, timeout=CLIENT_POLL_S))[0]:
                    if gone():
                        stop.set()
                try:
                    item = waiting.result()
                except Cancelled:
                    raise gr.Error("The request was cancelled.") from None
                if item is _DONE:
                    return
                yield item
        finally:
            stop.set()
            _finish(step, gen, fn.__name__)

    return run


# ----------------------------------------------------------------------------------------------------------
# Per-client limits, in front of Gradio's routes.


class ClientLimits:
    """ASGI middleware: each client (IP address) may hold `MAX_QUEUED_PER_CLIENT` places in the queue, and
    upload `UPLOAD_BYTES_PER_CLIENT` bytes (all clients together `UPLOAD_BYTES_TOTAL`) per `UPLOAD_WINDOW_S`;
    a join or call body may take `MAX_REQUEST_BODY_BYTES`, list `MAX_FILES_PER_REQUEST` files and hold no
    string longer than `MAX_REQUEST_STRING_CHARS`.

    Gradio bounds the queue as a whole, so without this one client could fill it and lock every visitor
    out, and it keeps uploads until its cache cleaner runs, so a client could fill the disk meanwhile. It
    also parses and checks a request's every file reference on the event loop, so a body listing 30,000
    files held every visitor for seconds: bodies are read and bounded here first, within
    `REQUEST_BODY_TIMEOUT_S`, and no lock is held while a client sends (a half-sent body holds up nobody).
    A refusal is a 4xx (507 when all uploads together are over budget) whose detail says why.
    """

    def __init__(self, app: ASGIApp, blocks: gr.Blocks, proxy_hops: int = 0) -> None:
        self.app, self.blocks, self.proxy_hops = app, blocks, proxy_hops
        #: joins that have passed the count and not yet reached Gradio's queue, by client: counted with the
        #: queue's events, so a burst cannot slip between a count and its event
        self.joining: dict[str, int] = defaultdict(int)
        self.uploads: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" and scope.get("method") == "POST" else ""
        raw = list(scope.get("headers") or [])
        lines = [value.decode("latin-1") for key, value in raw if key == b"x-forwarded-for"]
        client = self.client_of(", ".join(lines), (scope.get("client") or ("unknown",))[0])
        if path.endswith("/queue/join") or "/call/" in path:
            refusal = self._call_refusal(path)
            body = b""
            if refusal is None:
                body, refusal = await _bounded_body(receive, dict(raw).get(b"content-length"))
            refusal = refusal or self._queue_refusal(client)
            if refusal is None:  # no await between the count and this: the reservation is the count's
                await self._join(client, scope, _replay(body, receive), send)
                return
        elif path.endswith("/upload"):
            refusal = self._upload_refusal(client, dict(raw).get(b"content-length"))
        else:
            refusal = None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            logger.warning("refused %s from %s: %s", shown(path), shown(client), refusal[1])
            await JSONResponse({"detail": refusal[1]}, status_code=refusal[0])(scope, receive, send)

    async def _join(self, client: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass a join to Gradio with `client` holding one more place until Gradio answers it (its event is
        in the queue by then, or it was refused)."""
        self.joining[client] += 1
        reserved = True

        def release() -> None:
            nonlocal reserved
            if reserved:
                reserved = False
                self.joining[client] -= 1
                if not self.joining[client]:
                    del self.joining[client]

        async def answered(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                release()
            await send(message)

        try:
            await self.app(scope, receive, answered)
        finally:
            release()

    def client_of(self, forwarded: str, peer: str) -> str:
        """The visitor's address: the `proxy_hops`-th X-Forwarded-For entry from the right, else the peer.

        `forwarded` is every X-Forwarded-For line joined in order (HTTP reads repeated header lines as one
        comma-separated list), so a client that sends its own lines cannot move the proxies' entries."""
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        return hops[-self.proxy_hops] if 0 < self.proxy_hops <= len(hops) else peer

    def _call_refusal(self, path: str) -> tuple[int, str] | None:
        """A 404 for /call/<name> of a name that is not a public endpoint (Gradio would answer 500)."""
        name = path.rpartition("/call/")[2] if "/call/" in path else ""
        public = {fn.api_name for fn in self.blocks.fns.values() if fn.api_name and fn.api_visibility == "public"}
        if not name or name in public:
            return None
        return 404, f"No endpoint named {shown(name)}; see the API page for the ones this app offers."

    def _queue_refusal(self, client: str) -> tuple[int, str] | None:
        """A 429 when `client` already holds its share of the queue (waiting or running events, and joins on
        their way in). Each event's client is read as `__call__` reads it, from the same header lines."""
        requests = [event.request for event in list(self.blocks._queue.event_ids_to_events.values())]
        held = self.joining.get(client, 0) + sum(
            1 for request in requests if request is not None and request.client is not None
            and self.client_of(", ".join(request.headers.getlist("x-forwarded-for")), request.client.host) == client)
        if held < MAX_QUEUED_PER_CLIENT:
            return None
        return 429, (f"You have {held} requests waiting or running; at most {MAX_QUEUED_PER_CLIENT} per visitor. "
                     "Wait for one to finish.")

    def _upload_refusal(self, client: str, length: bytes | None) -> tuple[int, str] | None:
        """A refusal when this upload would pass the client's or everyone's upload budget (it is counted
        by its Content-Length, which the upload must state)."""
        if length is None or not length.isdigit():
            return 411, "Uploads must state their Content-Length."
        size, now = int(length), time.monotonic()
        for key, history in list(self.uploads.items()):
            while history and history[0][0] < now - UPLOAD_WINDOW_S:
                history.popleft()
            if not history:
                del self.uploads[key]
        mine = sum(n for _, n in self.uploads[client])
        everyone = sum(n for history in self.uploads.values() for _, n in history)
        if mine + size > UPLOAD_BYTES_PER_CLIENT:
            return 429, (f"You have uploaded {mine / 2**20:.0f} MB in the last {UPLOAD_WINDOW_S // 60} minutes; at "
                         f"most {UPLOAD_BYTES_PER_CLIENT / 2**20:.0f} MB per visitor. Try again later.")
        if everyone + size > UPLOAD_BYTES_TOTAL:
            return 507, "The server holds as many uploads as it can; try again in a few minutes."
        self.uploads[client].append((now, size))
        return None


async def _bounded_body(receive: Receive, length: bytes | None) -> tuple[bytes, tuple[int, str] | None]:
    """A join or call body, read whole before Gradio sees it, or the refusal of one that is too large, lists
    too many files or does not arrive within `REQUEST_BODY_TIMEOUT_S`."""
    too_large = 413, (f"A request body may take at most {MAX_REQUEST_BODY_BYTES // 1024} KB; upload files through "
                      "/upload and send their references.")
    if length is not None and (not length.isdigit() or int(length) > MAX_REQUEST_BODY_BYTES):
        return b"", too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(REQUEST_BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left
                    return b"", (400, "The request body did not arrive.")
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > MAX_REQUEST_BODY_BYTES:
                    return b"", too_large
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        return b"", (408, f"The request body did not arrive within {REQUEST_BODY_TIMEOUT_S:g} s.")
    body = b"".join(chunks)
    files, longest = _body_shape(body)
    if files > MAX_FILES_PER_REQUEST:
        return b"", (413, f"The request lists {files:,} files; at most {MAX_FILES_PER_REQUEST} per request.")
    if longest > MAX_REQUEST_STRING_CHARS:
        return b"", (413, f"The request holds a value of {longest:,} characters; at most {MAX_REQUEST_STRING_CHARS:,} "
                          "per value (files go through /upload).")
    return body, None


def _body_shape(body: bytes) -> tuple[int, int]:
    """How many file references (objects with a "path") a JSON body holds, and its longest string (a key or
    a value); one that is not JSON holds none here, and Gradio refuses it."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return 0, 0
    count, longest, stack = 0, 0, [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += "path" in item
            longest = max(longest, *map(len, item), 0)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            longest = max(longest, len(item))
    return count, longest


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app after the middleware has read the body: the body once, then the client's own
    messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


# ----------------------------------------------------------------------------------------------------------
# What a generation shows, by name.


class _Named:
    """What an event shows, by name: the event maps each field's name to its component, so no list of values
    has to follow a list of components in step. A field left None is not updated."""

    def by_component(self, targets: dict[str, gr.components.Component]) -> dict[gr.components.Component, Any]:
        """The set fields keyed by their components in `targets` (field name -> component), as Gradio takes them."""
        return {targets[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class Outputs(_Named):
    """What a generation event shows (`RolloutView.show`): the scene tabs show the registered prefix first,
    before the rollout has run."""

    viewer: str | None = None
    bev_animation: str | None = None
    range_animation: str | None = None
    stats: dict[str, Any] | None = None
    downloads: list[str] | None = None
    #: per-frame (BEV, range) PNGs: session state for the frame viewer, not sent to API clients
    frame_pngs: list[tuple[bytes, bytes]] | None = None
    #: the scene tabs' "Registered prefix" table
    prefix: list[list[Any]] | None = None


@dataclass
class UpsampleOutputs(_Named):
    """What the upsample event shows: the 3D view (the input in grey, the filled rays by height), the input and
    the result side by side (BEV) and one above the other (range image, on the target grid), stats, downloads."""

    viewer: str
    bev: str
    range: str
    stats: dict[str, Any]
    downloads: list[str]


def _by_component(run: Callable[..., AsyncIterator[_Named]],
                  targets: dict[str, gr.components.Component]) -> Callable[..., AsyncIterator[dict]]:
    """`run` (a worker's generation) yielding its `Outputs` by component. Closing it closes `run`, so a
    request Gradio gives up on still stops its work and frees the worker."""

    @functools.wraps(run)  # Gradio reads the signature (the gr.Progress parameter) through __wrapped__
    async def show(*args: Any, **kwargs: Any) -> AsyncIterator[dict]:
        async with contextlib.aclosing(run(*args, **kwargs)) as outputs:
            async for item in outputs:
                yield item.by_component(targets)

    return show


# ----------------------------------------------------------------------------------------------------------
# A request in three parts: prepare (CPU: read, check, register), roll out (the GPU), deliver (CPU: encode).


@dataclass(frozen=True)
class RolloutJob:
    """A rollout (or the model's fill of an upsampled sweep) as its GPU part runs it, every input read and
    checked on the CPU beforehand.

    On ZeroGPU the job crosses to the process that holds the GPU, so it carries arrays and numbers, never the
    pipeline: the GPU part calls the served pipeline's `method` with `kwargs`.
    """

    method: Literal["generate_world", "forecast", "resimulate", "upsample"]
    kwargs: dict[str, Any]
    #: what the progress bar says: "Generating", "Forecasting", "Re-simulating", "Upsampling"
    label: str


def _on_gpu(fn: Callable) -> Callable:
    """ZeroGPU attaches a GPU only inside `spaces.GPU` calls; without ZeroGPU the function runs as is."""
    return spaces.GPU(duration=120)(fn) if spaces is not None else fn


@_on_gpu
def roll_out(job: RolloutJob, progress: gr.Progress) -> RolloutResult | UpsampleResult:
    """The sampler's frames: the only part of a request that holds a GPU on ZeroGPU, so a bad input, a slow
    registration or a slow encode never does. The pipeline is read here rather than passed, since arguments
    cross to the GPU's process; the generation lock keeps `PIPELINE` the request's model meanwhile."""
    return getattr(_pipeline(), job.method)(**job.kwargs, callback=_progress_callback(progress, job.label))


def _generate(job: RolloutJob, progress: gr.Progress, failure: str,
              upload: Path | None = None) -> RolloutResult | UpsampleResult:
    """Run `job` on the GPU, unless the request was cancelled while it was being prepared; a failure is
    reported as `failure: ...` (naming `upload` by its name)."""
    checkpoint()
    progress(0.0, desc=job.label)
    with _user_errors(failure, upload):
        return roll_out(job, progress)


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)  # session state, not a download: speed over size
    return buf.getvalue()


def _viewer_file(out: Path, world: np.ndarray, observed: np.ndarray | None) -> tuple[Path, int]:
    """The 3D viewer's PLY and how many points it holds: the accumulated world coloured by height, observed
    points (forecast) in grey, at most `VIEWER_MAX_POINTS` of them together."""
    colors = render.colorize(world, "height")
    points = world
    if observed is not None and len(observed):
        points = np.concatenate([observed[:, :4], world])
        colors = np.concatenate([np.full((len(observed), 3), 150, np.uint8), colors])
    path = render.write_ply_for_viewer(out / "world_viewer.ply", points, colors, max_points=VIEWER_MAX_POINTS)
    return path, min(len(points), VIEWER_MAX_POINTS)


def _bev_picture(points: np.ndarray) -> Image.Image:
    """A sweep's BEV in its sensor frame, on the one colour scale of every picture the app draws."""
    return render.bev_image(points, extent=BEV_EXTENT_M, resolution=0.2, value_range=(-3.0, 5.0))


def _range_picture(image: RangeImage, max_range: float) -> Image.Image:
    """A range image with each beam repeated up to 4 times, to about `RANGE_PICTURE_ROWS` rows."""
    rows = int(np.clip(RANGE_PICTURE_ROWS // image.shape[0], 1, 4))
    return render.range_image_png(image, max_range=max_range, scale=rows)


def _frame_pictures(result: RolloutResult, max_range: float) -> tuple[list[Image.Image], list[Image.Image]]:
    """Per-frame BEV and range pictures (sensor frame, one colour scale across frames), checking between
    frames whether the request was cancelled."""
    bevs, ranges = [], []
    for frame in result.frames:
        checkpoint()
        bevs.append(_bev_picture(frame.points))
        ranges.append(_range_picture(frame.range_image, max_range))
    return bevs, ranges


def _downloads(out: Path, result: RolloutResult, world: np.ndarray, pipe: LidarVersePipeline, grid: Sensor,
               request: dict[str, Any], scene: ObservedScene | None) -> list[Path]:
    """Per-frame KITTI .bin + poses.json (the CLI's layout; its sensor is the frames' `grid`) in a zip, and the
    world as .ply, .pcd and .las: every point of every frame, whatever the viewer shows."""
    folder = out / "frames_kitti"
    write_rollout(folder, result, "bin", sensor=grid, provenance=public_provenance(pipe.provenance),
                  request=request)
    if scene is not None:  # poses.json lists the observed sweeps too, as the CLI writes it
        record_prefix(folder, scene)
    frames_zip = out / "frames_kitti.zip"
    with zipfile.ZipFile(frames_zip, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for path in sorted(folder.iterdir()):
            checkpoint()
            zf.write(path, f"{folder.name}/{path.name}")
    shutil.rmtree(folder)
    world_files = []
    for ext in (".ply", ".pcd", ".las") if len(world) else ():
        checkpoint()
        world_files.append(write_points(out / f"world{ext}", world))
    kind = "generate" if scene is None else "resimulate" if "shift" in request else "forecast"
    views = write_views(out, result, kind, scene)  # result.rrd (Rerun) and result.mcap (Foxglove, RViz)
    return [frames_zip, *world_files, *views.values()]


def _present(result: RolloutResult, out: Path, pipe: LidarVersePipeline, grid: Sensor, request: dict[str, Any],
             stats: dict[str, Any], observed: np.ndarray | None, scene: ObservedScene | None) -> Outputs:
    """Write the files for one rollout (its frames on `grid`) into `out` and collect what the page shows."""
    world = np.asarray(result.world, dtype=np.float32)
    viewer, shown_points = _viewer_file(out, world, observed)
    bevs, ranges = _frame_pictures(result, grid.max_range)
    bev_gif = render.save_animation(bevs, out / "bev.gif", fps=ANIMATION_FPS)
    range_gif = render.save_animation(ranges, out / "range.gif", fps=ANIMATION_FPS)
    downloads = _downloads(out, result, world, pipe, grid, request, scene)
    beams, columns = result.frames[0].range_image.shape
    stats = {**stats, "beams x columns": f"{beams} x {columns}", "frames": len(result.frames), "world points": len(world),
             "points per frame": round(float(np.mean([len(f.points) for f in result.frames])), 1),
             "points in the 3D view": shown_points}
    return Outputs(
        viewer=str(viewer),
        bev_animation=str(bev_gif),
        range_animation=str(range_gif),
        stats=stats,
        downloads=[str(p) for p in downloads],
        frame_pngs=[(_png_bytes(b), _png_bytes(r)) for b, r in zip(bevs, ranges, strict=True)],
        prefix=_prefix_table(scene) if scene is not None else None,
    )


def _deliver(result: RolloutResult, started: float, pipe: LidarVersePipeline, grid: Sensor, request: dict[str, Any],
             stats: dict[str, Any], *, observed: np.ndarray | None = None,
             scene: ObservedScene | None = None) -> Iterator[Outputs]:
    """The CPU part after the rollout: its stats (wall time since `started`, the frames' `grid`), files and
    pictures, handed to Gradio from a request folder that lives until Gradio has taken them, i.e. until it
    resumes the generator."""
    stats = {**_rollout_stats(result, time.perf_counter() - started, pipe), "frames' sensor": grid.name, **stats}
    with _request_dir() as out, _user_errors("Writing the results"):
        yield _present(result, out, pipe, grid, request, stats, observed, scene)


def _rollout_stats(result: RolloutResult, seconds: float, pipe: LidarVersePipeline) -> dict[str, Any]:
    """Time and frames/s as a visitor reads them (wall time includes checks and building the cache)."""
    timings = result.timings
    return {
        "seconds": round(seconds, 3),
        "frames/s": round(float(timings["frames_per_second"]), 3),
        "seconds per frame": round(float(np.mean(timings["per_frame"])), 3),
        "device": str(pipe.provenance.device),
    }


# ----------------------------------------------------------------------------------------------------------
# Callbacks.


@functools.lru_cache(maxsize=8)
def _world(map_seed: int, style: str) -> World:
    """Worlds are rebuilt on every preview tweak (action, frames, seed); building one takes ~0.5 s."""
    return make_world(map_seed, style)


def preview_map(map_seed: Any, style: Any, action: Any, frames: Any, seed: Any) -> Image.Image:
    """The HD map around the start of the drive (forward up, as the BEV previews) with the planned path.

    The path is the one `generate_world` will drive: `plan_drive` with the same world, action, frames and
    seed, the sensor at the model's mount height.
    """
    world = _world(_whole_number(map_seed, "Map seed", 0, MAX_SEED), _choice(style, "Style", STYLES))
    frames = _whole_number(frames, "Frames", 1, MAX_FRAMES)
    poses = plan_drive(world, _choice(action, "Action", ACTIONS), frames, seed=_whole_number(seed, "Seed", 0, MAX_SEED),
                       mount_height=_pipeline().sensor.mount_height)
    path = transform_points(poses[:, :3, 3], np.linalg.inv(poses[0]))[:, :2]  # start's frame: x forward, y left
    extent = float(np.clip(np.abs(path).max() + 25.0, 40.0, 120.0))
    size = 400
    image = Image.fromarray(HDMap.colorize(world.hdmap.bev_raster(resolution=2 * extent / size, extent=extent, pose=poses[0])))
    px = (size / 2 - path[:, 1] * size / (2 * extent), size / 2 - path[:, 0] * size / (2 * extent))  # col, row
    draw = ImageDraw.Draw(image)
    if len(path) > 1:
        draw.line(list(zip(*px, strict=True)), fill=PATH_COLOUR, width=4)
    for (col, row), colour in (((px[0][0], px[1][0]), (255, 255, 255)), ((px[0][-1], px[1][-1]), PATH_COLOUR)):
        draw.ellipse((col - 6, row - 6, col + 6, row + 6), fill=colour, outline=(0, 0, 0))
    return image


def generate_world(
    map_seed: Any,
    style: Any,
    action: Any,
    frames: Any,
    steps: Any,
    seed: Any,
    guidance: Any,
    sensor: Any = MODEL_SENSOR,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
) -> Iterator[Outputs]:
    """Roll out a world around a car driving the chosen action on the chosen map, seen by the chosen sensor
    (the model's own, or a preset at its columns: `GENERATION_SENSORS`)."""
    pipe = _pipeline()
    map_seed = _whole_number(map_seed, "Map seed", 0, MAX_SEED)
    style = _choice(style, "Style", STYLES)
    action = _choice(action, "Action", ACTIONS)
    frames, steps, seed = _rollout_numbers(frames, steps, seed)
    guidance = _real_number(guidance, "Guidance", 0.0, MAX_GUIDANCE)
    sensor_label = _choice(sensor, "Sensor", (MODEL_SENSOR, *GENERATION_SENSORS))
    grid = _frames_sensor(pipe, GENERATION_SENSORS.get(sensor_label))

    start = time.perf_counter()
    with _user_errors("Cannot generate this world"):
        world = _world(map_seed, style)
    job = RolloutJob("generate_world", {"map": world, "action": action, "frames": frames, "steps": steps, "seed": seed,
                                        "guidance": guidance, "sensor": grid}, "Generating")
    result = _generate(job, progress, "Cannot generate this world")
    request = {"map_seed": map_seed, "style": style, "action": action, "frames": frames, "steps": steps,
               "seed": seed, "guidance": guidance, "sensor": sensor_label}
    yield from _deliver(result, start, pipe, grid, request, {})


def _read_sweep(path: Path, task: str, sensor: Sensor | None = None) -> Scan:
    """One uploaded sweep (a one-file recording's first), read in a bounded worker (as `sensor` recorded it,
    when given), refused unless it is in its sensor's frame: `task` ("Forecasting") needs rays from the LiDAR's
    origin."""
    with _user_errors("Cannot read the scan", path), point_limit(MAX_UPLOAD_POINTS):  # errors name the file, not its path
        scan = _first_sweep(path) if path.suffix.lower() in CONTAINER_SUFFIXES else sandbox.read_points(path, sensor)
        if sensor is not None:
            check_sensor(scan, sensor)
    if not scan.sensor_frame:  # no sensor choice helps
        why = "; ".join(note for note in scan.notes if "sensor frame" in note)
        raise gr.Error(f"{shown(path.name)} is {why or 'not in the sensor frame'}. {task} needs a sweep whose "
                       "origin is the LiDAR (e.g. KITTI velodyne .bin, nuScenes LIDAR_TOP, an Ouster frame).")
    return scan


def _first_sweep(path: Path) -> Scan:
    """The first sweep of a one-file recording, its index and the sweep decoded in the bounded worker. A refusal
    says what this one-file tab cannot take: the reader's advice (a topic to choose, a metadata json beside an
    Ouster capture) is for the command line."""
    try:
        return sandbox.open_recording(path).sweep(0)
    except InputError as err:
        raise InputError(f"{str(err).rstrip('.')}. This tab reads the first sweep of a recording given as one "
                         "file (a Velodyne .pcap, a bag with one point-cloud topic); for a topic or an Ouster capture "
                         "use `python -m inference upsample --scan FILE --topic T`, with the metadata json beside the "
                         "pcap") from None


def _read_scan(path: Path, sensor_name: str) -> tuple[Scan, Sensor]:
    """The uploaded sweep and the sensor that recorded it (the visitor's choice, else detected)."""
    sensor = None if sensor_name == AUTO_SENSOR else get_sensor(sensor_name)
    scan = _read_sweep(path, "Forecasting", sensor)
    if sensor is None:
        sensor = detect_sensor(scan)
    if sensor is None:
        raise gr.Error(f"Could not tell which sensor recorded {shown(path.name)}; choose it under 'Sensor'.")
    return scan, sensor


def forecast_from_scan(
    scan_file: Any,
    sensor_name: Any,
    action: Any,
    frames: Any,
    steps: Any,
    seed: Any,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
) -> Iterator[Outputs]:
    """Continue an uploaded real scan: the model drives on from it and fills in the world it sees."""
    pipe = _pipeline()
    path = _upload_path(scan_file)
    sensor_name = _choice(sensor_name, "Sensor", (AUTO_SENSOR, *PRESETS))
    action = _choice(action, "Action", ACTIONS)
    frames, steps, seed = _rollout_numbers(frames, steps, seed)
    scan, sensor = _read_scan(path, sensor_name)
    # a detected sensor is the scan's own geometry, the grid the pipeline would measure from it again
    grid = _frames_sensor(pipe, sensor if sensor_name == AUTO_SENSOR else None, scans=[scan])

    start = time.perf_counter()
    job = RolloutJob("forecast", {"prefix_scans": [scan], "action": action, "frames": frames, "steps": steps,
                                  "seed": seed, "sensor": grid}, "Forecasting")
    result = _generate(job, progress, f"Cannot forecast from {shown(path.name)}", path)
    stats = {"input": path.name, "input points": len(scan.points), "input sensor": sensor.name, "input notes": scan.notes}
    request = {"input": path.name, "input_sensor": sensor.name, "action": action, "frames": frames,
               "steps": steps, "seed": seed}
    yield from _deliver(result, start, pipe, grid, request, stats, observed=scan.points)


def _sweep_uploads(uploads: Any) -> list[Path]:
    """Several uploaded sweeps, or one zip of them, or one recording (an Ouster .pcap with its metadata json),
    after the checks that need no parsing (count, sizes, suffixes)."""
    items = [uploads] if isinstance(uploads, str | Path) else list(uploads or [])
    if not items:
        raise gr.Error("No sweeps uploaded: drop the sweeps of one drive (or one .zip of them) on 'Sweeps'.")
    if len(items) > MAX_SWEEPS:
        raise gr.Error(f"{len(items)} files uploaded; a scene may hold at most {MAX_SWEEPS} sweeps.")
    paths = [_upload_path(p, SCENE_SUFFIXES) for p in items]
    alone = [p for p in paths if p.suffix.lower() in (".zip", *CONTAINER_SUFFIXES)]
    ouster = sorted(p.suffix.lower() for p in paths) == [".json", ".pcap"]
    if alone and len(paths) > 1 and not ouster:
        raise gr.Error("Upload either sweep files, or one .zip of them, or one recording (.bag, .mcap, .db3, .pcap; "
                       "an Ouster .pcap with its metadata .json).")
    return paths


def _upload_names(paths: list[Path]) -> dict[str, Path]:
    """The uploads by their file names, which a recording's layout keys on; two of one name are refused."""
    names: dict[str, Path] = {}
    for path in paths:
        if path.name in names:
            raise gr.Error(f"Two uploads are named {shown(path.name)}; a recording's files need distinct names.")
        names[path.name] = path
    return names


def _laid_out(into: Path, placed: dict[Path, Path]) -> None:
    """Link each upload (value) at its place in `into` (key, relative), as a recording's reader finds it."""
    for where, upload in placed.items():
        target = into / where
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(upload.resolve())


def _recording_layout(paths: list[Path], into: Path) -> Path | None:
    """The file or folder a recording reader opens for loose uploads that make one recording, laid out in
    `into` as that reader expects (links to the uploads); None for anything else (sweep files, a zip, a
    container), which `observe` reads as it is.

    - an Ouster .pcap with its metadata .json: side by side (`lidar.recordings.ouster.find_metadata`);
    - nuScenes `<log>__LIDAR_TOP__<us>.pcd.bin` sweeps with its tables (`NUSCENES_TABLES`, ego_pose.json
      at least): `samples/LIDAR_TOP/` and a version folder;
    - Argoverse 2 `<ns>.feather` sweeps with `city_SE3_egovehicle.feather` and
      `egovehicle_SE3_sensor.feather`: `sensors/lidar/`, the log folder and `calibration/`.
    """
    names = _upload_names(paths)
    suffixes = {p.suffix.lower() for p in paths}
    if suffixes == {".pcap", ".json"}:
        _laid_out(into, {Path(name): path for name, path in names.items()})
        return into / next(name for name in names if name.lower().endswith(".pcap"))
    if suffixes == {".feather"}:
        side = {AV2_POSES_FILE: Path(AV2_POSES_FILE), AV2_CALIBRATION_FILE.name: AV2_CALIBRATION_FILE}
        odd = next((name for name in names if name not in side and not Path(name).stem.isdigit()), None)
        if odd is not None:
            raise gr.Error(f"{shown(odd)} is neither an Argoverse 2 sweep (<nanoseconds>.feather) nor one of "
                           f"{', '.join(side)}.")
        _laid_out(into, {side.get(name, AV2_SWEEP_FOLDER / name): path for name, path in names.items()})
        return into
    if ".json" not in suffixes:
        return None
    tables = {name for name in names if name.lower().endswith(".json")}
    if "ego_pose.json" not in tables or not tables <= set(NUSCENES_TABLES) or suffixes != {".json", ".bin"}:
        raise gr.Error(f"{shown(sorted(tables)[0])}: a .json goes with an Ouster .pcap (its metadata) or with nuScenes "
                       f".pcd.bin sweeps (its tables: {', '.join(NUSCENES_TABLES)}, ego_pose.json at least).")
    named = next((name for name in names if name not in tables and NUSCENES_NAME not in name), None)
    if named is not None:
        raise gr.Error(f"{shown(named)} is not named as a nuScenes sweep (<log>{NUSCENES_NAME}<microseconds>.pcd.bin); "
                       "the tables pose only those.")
    sweeps = NUSCENES_SWEEP_FOLDERS[0]
    _laid_out(into, {Path(NUSCENES_VERSION) / name if name in tables else sweeps / name: path
                     for name, path in names.items()})
    return into


def _topic(value: Any) -> str | None:
    """A recording's topic as typed (a bag's PointCloud2 topic, a nuScenes log), or None (the only one)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str) or len(value) > MAX_TOPIC_CHARS or not value.isprintable():
        raise gr.Error(f"Topic must be a ROS topic name or a nuScenes log of at most {MAX_TOPIC_CHARS} characters, "
                       "e.g. /velodyne_points.")
    return value.strip()


def _observed_scene(paths: list[Path], progress: gr.Progress, topic: str | None = None) -> ObservedScene:
    """Read the uploads (in a worker, `observe`) and register them (several sweeps without poses) or take their
    poses: a poses file's, or a recording's. Loose files of one recording are read in its own layout, from a
    scratch folder that goes once they are read."""
    progress(0.0, desc=f"Registering {len(paths)} upload(s)")
    with _request_dir() as scratch, _user_errors("Cannot register these sweeps"), point_limit(MAX_UPLOAD_POINTS):
        source = _recording_layout(paths, scratch) or (paths if len(paths) > 1 else paths[0])
        return observe(source, topic=topic)


def _prefix_table(scene: ObservedScene) -> list[list[Any]]:
    """One row per observed sweep, as the 'Registered prefix' table shows it."""
    rows = []
    for record in scene.prefix_records():
        pose = np.asarray(record["pose"])
        yaw = math.degrees(math.atan2(pose[1, 0], pose[0, 0]))
        rows.append([record["file"], *np.round(pose[:3, 3], 2).tolist(), round(yaw, 2), record.get("fitness")])
    return rows


def forecast_from_scans(
    scan_files: Any,
    action: Any,
    frames: Any,
    steps: Any,
    seed: Any,
    topic: Any = None,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
) -> Iterator[Outputs]:
    """Continue several sweeps of one drive (files, one zip or one recording: a bag's `topic`): registered
    with KISS-ICP unless posed, then forecast from the last one; the prefix is shown as soon as it is known."""
    pipe = _pipeline()
    paths = _sweep_uploads(scan_files)
    topic = _topic(topic)
    action = _choice(action, "Action", ACTIONS)
    frames, steps, seed = _rollout_numbers(frames, steps, seed)

    start = time.perf_counter()
    scene = _observed_scene(paths, progress, topic)
    yield Outputs(prefix=_prefix_table(scene))
    grid = _frames_sensor(pipe, scans=scene.scans)
    job = RolloutJob("forecast", {"prefix_scans": scene.scans, "prefix_poses": scene.poses, "prefix_times": scene.times,
                                  "action": action, "frames": frames, "steps": steps, "seed": seed, "sensor": grid},
                     "Forecasting")
    result = _generate(job, progress, "Cannot forecast from these sweeps")
    stats = {"inputs": scene.names, "poses": scene.pose_source}
    request = {"inputs": scene.names, "poses": scene.pose_source, "action": action, "frames": frames,
               "steps": steps, "seed": seed}
    yield from _deliver(result, start, pipe, grid, request, stats, observed=scene.world_points(), scene=scene)


def resimulate(
    scan_files: Any,
    lateral: Any,
    forward: Any,
    yaw: Any,
    frames: Any,
    steps: Any,
    seed: Any,
    topic: Any = None,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
) -> Iterator[Outputs]:
    """Render the uploaded scene (files, one zip or one recording: its `topic` where it holds several) from a
    path shifted sideways / forward and turned, along the observed one; generated frames are not fed back, so
    every frame shows the observed world from its new pose."""
    pipe = _pipeline()
    topic = _topic(topic)
    paths = _sweep_uploads(scan_files)
    lateral = _real_number(lateral, "Lateral shift", -MAX_LATERAL_M, MAX_LATERAL_M)
    forward = _real_number(forward, "Forward shift", -MAX_FORWARD_M, MAX_FORWARD_M)
    yaw = _real_number(yaw, "Yaw", -MAX_YAW_DEG, MAX_YAW_DEG)
    frames, steps, seed = _rollout_numbers(frames, steps, seed)

    start = time.perf_counter()
    scene = _observed_scene(paths, progress, topic)
    yield Outputs(prefix=_prefix_table(scene))
    with _user_errors("Cannot re-simulate this scene"):
        targets = shifted_path(scene.poses, (forward, lateral), yaw, frames)
        check_inside(targets, scene.poses)
    grid = _frames_sensor(pipe, scans=scene.scans)
    job = RolloutJob("resimulate", {"scans": scene.scans, "poses": scene.poses, "target_poses": targets, "steps": steps,
                                    "seed": seed, "sensor": grid}, "Re-simulating")
    result = _generate(job, progress, "Cannot re-simulate this scene")
    stats = {"inputs": scene.names, "poses": scene.pose_source, "shift (forward, left) m": [forward, lateral],
             "yaw deg": yaw}
    request = {"inputs": scene.names, "poses": scene.pose_source, "shift": [forward, lateral], "yaw_deg": yaw,
               "frames": frames, "steps": steps, "seed": seed}
    yield from _deliver(result, start, pipe, grid, request, stats, observed=scene.world_points(), scene=scene)


def upsample_scan(
    scan_file: Any,
    factor: Any,
    target: Any,
    method: Any,
    steps: Any,
    seed: Any,
    fmt: Any = UPSAMPLE_FORMAT,
    progress: gr.Progress = gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
) -> Iterator[UpsampleOutputs]:
    """An uploaded sweep on a denser beam table (`factor` beams per measured gap, or the `target` preset's beams
    at the sweep's columns), or with its silent rays filled (factor 1), by `method`; every input point is kept
    as it was. The target is worked out and checked against the server's rays before anything runs."""
    pipe = _pipeline()
    path = _upload_path(scan_file, UPSAMPLE_SUFFIXES)
    factor = _whole_number(factor, "Factor", 1, MAX_FACTOR)
    target = _choice(target, "Target beams", (BY_FACTOR, *PRESETS))
    method = _choice(method, "Method", (AUTO, *METHODS))
    if method == LEARNED and pipe.fill_network is None:
        raise gr.Error(f"Method '{LEARNED}' needs a fill network, and the loaded model ships none; choose "
                       f"'{EDGE_AWARE}', the same fill without the network's correction.")
    steps = _whole_number(steps, "Sampling steps", 1, MAX_STEPS)
    seed = _whole_number(seed, "Seed", 0, MAX_SEED)
    fmt = _choice(fmt, "Download format", SWEEP_FORMATS)
    scan = _read_sweep(path, "Upsampling")
    asked = {"factor": factor} if target == BY_FACTOR else {"sensor": target}
    failure = f"Cannot upsample {shown(path.name)}"

    start = time.perf_counter()
    with _user_errors(failure, path):
        grid = upsample_target(scan, **asked, limits=APP_LIMITS)
    job = RolloutJob("upsample", {"points": scan, "sensor": grid, "method": method, "steps": steps, "seed": seed,
                                  "limits": APP_LIMITS}, "Upsampling")
    result = _upsampled(job, progress, failure, path)
    request = {"input": path.name, **asked, "method": method, **({"steps": steps, "seed": seed} if method == MODEL else {})}
    stats = {"seconds": round(time.perf_counter() - start, 3), "input": path.name, "method": result.method}
    with _request_dir() as out, _user_errors("Writing the results"):
        yield _present_upsample(out, scan, result, pipe, fmt, request, stats)


def _upsampled(job: RolloutJob, progress: gr.Progress, failure: str, upload: Path) -> UpsampleResult:
    """The upsampled sweep: the model's fill on the GPU (`_generate`); the interpolations are CPU work and ask
    for none."""
    if job.kwargs["method"] == MODEL:
        return _generate(job, progress, failure, upload)
    checkpoint()
    progress(0.0, desc=job.label)
    with _user_errors(failure, upload):
        return _pipeline().upsample(**job.kwargs)


def _present_upsample(out: Path, scan: Scan, result: UpsampleResult, pipe: LidarVersePipeline, fmt: str,
                      request: dict[str, Any], stats: dict[str, Any]) -> UpsampleOutputs:
    """Write one upsampled sweep's files into `out` (the command line's: `upsampled.<fmt>` with the rings,
    `upsample.json`, `result.rrd` and `result.mcap`) and its pictures, and collect what the page shows."""
    checkpoint()  # a request cancelled while the fill ran writes nothing
    filled = result.points[result.filled]
    viewer, shown_points = _viewer_file(out, filled, scan.points)
    checkpoint()
    bev = render.labelled([(f"before: {len(scan.points):,} points", _bev_picture(scan.points)),
                           (f"after: {len(result.points):,} points", _bev_picture(result.points))])
    checkpoint()
    max_range = result.sensor.max_range
    ranges = render.labelled([("before, on the target grid", _range_picture(result.given, max_range)),
                              (f"after ({result.method})", _range_picture(result.image, max_range))], across=False)
    bev.save(out / "upsample_bev.png")
    ranges.save(out / "upsample_range.png")
    checkpoint()
    record = write_upsample(out, result, fmt, provenance=public_provenance(pipe.provenance), request=request)
    checkpoint()
    views = write_upsample_views(out, scan, result)  # result.rrd (Rerun) and result.mcap (Foxglove, RViz)
    beams, columns = result.sensor.shape
    stats = {**stats, "target sensor": result.sensor.name, "beams x columns": f"{beams} x {columns}",
             "input points": record["input_points"], "filled points": record["filled_points"],
             "points": record["points"], "points in the 3D view": shown_points, "device": str(pipe.provenance.device)}
    downloads = [out / record["file"], out / RECORD_NAME, *views.values()]
    return UpsampleOutputs(viewer=str(viewer), bev=str(out / "upsample_bev.png"), range=str(out / "upsample_range.png"),
                           stats=stats, downloads=[str(p) for p in downloads])


def show_frame(index: Any, frame_pngs: list[tuple[bytes, bytes]] | None) -> tuple[Image.Image | None, Image.Image | None]:
    """The BEV and range image of one generated frame, for the frame slider."""
    if not frame_pngs:
        return None, None
    i = min(max(int(index or 0), 0), len(frame_pngs) - 1)
    bev, rng = frame_pngs[i]
    return Image.open(io.BytesIO(bev)), Image.open(io.BytesIO(rng))


def reset_frame_viewer(frame_pngs: list[tuple[bytes, bytes]] | None) -> tuple:
    """After a rollout: the slider spans its frames and the viewer shows the first one."""
    count = len(frame_pngs) if frame_pngs else 0
    slider = gr.Slider(minimum=0, maximum=max(count - 1, 1), value=0, interactive=count > 1)
    return (slider, *show_frame(0, frame_pngs))


def public_provenance(provenance: Provenance) -> Provenance:
    """`provenance` as a visitor may see it (the Model tab, poses.json in the downloads): the source by its
    label, every path and note without server paths."""
    public = {key: public_text(value) for key, value in provenance.to_dict().items() if isinstance(value, str)}
    notes = tuple(public_text(note) for note in provenance.notes)
    return replace(provenance, **{**public, "source": SOURCE_LABEL, "notes": notes})


def model_info() -> dict[str, Any]:
    """Where the loaded weights came from (source, iteration, EMA or regular, parameters, sensor, device),
    as a visitor may see it: the source by its label, file names without server paths."""
    return json.loads(json.dumps(public_provenance(_pipeline().provenance).to_dict(), default=str))


def load_model(source: str | None, label: str | None = None) -> LidarVersePipeline:
    """Load a pipeline and make it the one every tab uses (startup and the Model tab)."""
    global PIPELINE, SOURCE_LABEL
    PIPELINE = load_pipeline(source, dtype=DTYPE)
    SOURCE_LABEL = label or source_label(source)
    logger.info("model loaded as %r: %s", SOURCE_LABEL, PIPELINE.provenance.to_dict())
    return PIPELINE


def reload_model(choice: Any) -> tuple[dict[str, Any], str]:
    """Switch the served model, when the operator allows it, to one of the offered sources (or, in local
    development, to any path or Hub id). A failure keeps the old model and tells the visitor no more
    than that: loader messages name server paths and folder contents, so they go to the log only."""
    if SWITCH is None:
        raise gr.Error("Model switching is off on this server: it serves the model it was started with.")
    label = str(choice if choice is not None else "").strip()
    try:
        source = SWITCH.source_for(label)
    except SourceNotOffered as err:
        raise gr.Error(str(err)) from None
    start = time.perf_counter()
    try:
        with _GENERATION:  # not while a generation runs (it holds the model it started with anyway)
            load_model(source, public_text(label))
    except ModelSourceError as err:
        logger.warning("could not load %s (%s): %s", shown(label), shown(source), err)
        raise gr.Error(f"Could not load {shown(public_text(label))}; the details are in the server log.") from None
    except Exception:
        logger.exception("loading %s (%s) failed", shown(label), shown(source))
        raise gr.Error(f"Loading {shown(public_text(label))} failed on the server; the details are in the server log.") from None
    return model_info(), f"Loaded **{SOURCE_LABEL}** in {time.perf_counter() - start:.1f} s."


def random_seed() -> int:
    """A fresh seed for the dice button: deliberately unseeded (the seed itself is what the user keeps)."""
    return secrets.randbelow(MAX_SEED + 1)


# ----------------------------------------------------------------------------------------------------------
# Layout.

HOW_IT_WORKS = """
### How it works
LidarVerse is a causal, few-step, block-autoregressive LiDAR world model. For each new frame the car moves
along the chosen action (poses at 10 Hz). The model sees, in the new sensor's range view, everything it has
generated or observed so far (a rolling spatial cache, re-projected), the HD map's ground, buildings, walls,
fences, green areas, trees and hedges ray-cast from the new pose, and the other road users' 3-D boxes at that
moment. From these it
draws a prior sweep, and a few flow-matching steps (2 by default) correct its ranges and decide where each
ray returns (where the model judges the prior right, or its correction is within the network's precision,
the prior's exact range is kept; a ray the prior misses starts from its neighbours' range). The sweep is
unprojected, moved into the world frame and merged into the cache. Forecasting
seeds the cache with the uploaded scans and conditions every frame on them (its own frames are not fed back,
so its errors do not compound); re-simulation renders them from new poses. Either way, every ray the uploaded
sweeps see keeps their measured point, the rays they measured empty stay empty, and the model draws only what
they lack. A forecast from several registered sweeps continues at the speed and turn rate they measured.
*Guidance* trades diversity for fidelity to the map. *Upsample* puts new beams between a sweep's measured ones
(or fills the rays it left silent) from the known rays above and below, planar along the edge they agree on
best by default, or by the model's sample; every measured point stays as it was.
"""


def _guidance_default() -> float:
    """The guidance slider's default: the served model's (1 = no guidance; its card says what it was tuned
    for). The module-level `demo` is built before any model is loaded and shows the architecture's default;
    `main()` rebuilds the page once the model is loaded."""
    return PIPELINE.config.default_guidance if PIPELINE is not None else WorldModelConfig.default_guidance


def _steps_default() -> int:
    """The steps sliders' default: the served model's `default_steps`, as a call that leaves the steps out
    gets, within the server's limit (the module-level `demo` shows the architecture's, as `_guidance_default`)."""
    steps = PIPELINE.config.default_steps if PIPELINE is not None else WorldModelConfig.default_steps
    return min(steps, MAX_STEPS)


@dataclass
class Sampling:
    """A tab's sampling controls (`_sampling_controls`), in the order the rollout callbacks take them."""

    frames: gr.Slider
    steps: gr.Slider
    seed: gr.Number
    guidance: gr.Slider | None

    @property
    def inputs(self) -> list[gr.components.Component]:
        """The controls this tab has, as the callbacks' frames, steps, seed[, guidance] arguments."""
        return [c for c in (self.frames, self.steps, self.seed, self.guidance) if c is not None]


def _sampling_controls(frames: int, frames_label: str = "Frames", *, dice: bool = False,
                       guidance: float | None = None) -> Sampling:
    """Frames, sampling steps, seed (with a dice button when `dice`) and guidance (when it has a default):
    every tab's controls with the server's limits, so a tab cannot offer more than the callbacks accept."""
    frames_slider = gr.Slider(1, MAX_FRAMES, value=min(frames, MAX_FRAMES), step=1, label=frames_label)
    steps = gr.Slider(1, MAX_STEPS, value=_steps_default(), step=1, label="Sampling steps")
    with gr.Row() if dice else contextlib.nullcontext():
        seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, scale=3 if dice else None)
        if dice:
            gr.Button("Random seed", scale=1, min_width=40).click(random_seed, None, seed, api_visibility="private")
    guidance_slider = None
    if guidance is not None:
        guidance_slider = gr.Slider(0.0, MAX_GUIDANCE, value=guidance, step=0.1, label="Guidance")
    return Sampling(frames_slider, steps, seed, guidance_slider)


@dataclass
class RolloutView:
    """The output panel of a rollout tab. Its outputs are named as `Outputs` names them."""

    viewer: gr.Model3D
    bev_animation: gr.Image
    range_animation: gr.Image
    stats: gr.JSON
    downloads: gr.File
    frame_pngs: gr.State
    slider: gr.Slider
    frame_bev: gr.Image
    frame_range: gr.Image

    @classmethod
    def build(cls, prefix: str) -> "RolloutView":
        with gr.Row():
            viewer = gr.Model3D(
                label="Accumulated world (drag to orbit, scroll to zoom)", display_mode="point_cloud",
                clear_color=VIEWER_BACKGROUND, height=480, scale=3, elem_id=f"{prefix}-viewer",
                camera_position=(180, 45, None),  # from behind the start, looking forward and down
            )
            with gr.Column(scale=2):
                bev_animation = gr.Image(label="Bird's-eye view, frame by frame", type="filepath", height=300,
                                         elem_id=f"{prefix}-bev")
                range_animation = gr.Image(label="Range image, frame by frame", type="filepath", elem_id=f"{prefix}-range")
        with gr.Row():
            with gr.Column(scale=3):
                slider = gr.Slider(0, max(MAX_FRAMES - 1, 1), value=0, step=1, label="Frame viewer", interactive=False)
                with gr.Row():
                    frame_bev = gr.Image(label="Frame BEV", height=300, scale=2)
                    frame_range = gr.Image(label="Frame range image", scale=3)
            with gr.Column(scale=2):
                stats = gr.JSON(label="Stats", elem_id=f"{prefix}-stats")
                downloads = gr.File(
                    label="Downloads: frames (KITTI .bin + poses.json), world .ply / .pcd / .las", file_count="multiple",
                )
        # Kept per session for the frame slider; expires so API clients (no tab to close) cannot pile it up.
        frame_pngs = gr.State(None, time_to_live=900)
        slider.release(show_frame, [slider, frame_pngs], [frame_bev, frame_range], api_visibility="private")
        return cls(viewer, bev_animation, range_animation, stats, downloads, frame_pngs, slider, frame_bev, frame_range)

    def show(self, trigger: gr.Button, fn: Callable[..., Iterator[Outputs]], inputs: list[gr.components.Component],
             api_name: str, prefix: gr.Dataframe | None = None) -> None:
        """Clicking `trigger` runs generation callback `fn` on the worker as endpoint `api_name`, shows its
        outputs here (the registered prefix in `prefix`), then points the frame viewer at the new frames.

        The event's outputs, and so what an API client receives, follow the fields of `Outputs`."""
        targets = {f.name: prefix if f.name == "prefix" else getattr(self, f.name) for f in fields(Outputs)}
        if prefix is None:
            del targets["prefix"]
        event = trigger.click(_by_component(_worker(fn), targets), inputs, list(targets.values()), api_name=api_name,
                              concurrency_id="model", concurrency_limit=GENERATION_CONCURRENCY)
        event.then(reset_frame_viewer, self.frame_pngs, [self.slider, self.frame_bev, self.frame_range],
                   api_visibility="private")


@functools.cache
def example_scans() -> tuple[Path, ...]:
    """Scans a forecast can start from: those shipped in examples/scans (so a fresh clone has some), then
    the shared real scans beside the repository when there, minus the shipped ones and those not in their
    sensor's frame (PandaSet's are in the ego frame, which the pipeline refuses with a message)."""
    shipped = sorted(p for p in EXAMPLE_SCANS_DIR.iterdir() if p.suffix in READ_SUFFIXES)
    shared = sorted(REAL_SCANS_DIR.glob("*.bin")) if REAL_SCANS_DIR.is_dir() else []
    names = {p.name for p in shipped}
    return (*shipped, *(p for p in shared if p.name not in names and read_points(p).sensor_frame))


def upsample_examples() -> tuple[Path, ...]:
    """The Upsample tab's examples: the shipped recordings of sparse sensors first (what a lab would make denser:
    a VLP-16 capture, read from its pcap), then the forecast's scans."""
    recordings = sorted(p for p in EXAMPLE_SCANS_DIR.iterdir() if p.suffix.lower() in CONTAINER_SUFFIXES)
    return (*recordings, *example_scans())


def example_scene() -> list[str]:
    """KITTI seq-00 sweeps 0, 2, 4 (0.2 s apart) when the shared scans complete the shipped sweep 0, else
    nothing: one shipped sweep is the single-scan example already."""
    by_name = {p.name: p for p in example_scans()}
    kitti = [by_name.get(f"kitti_patchworkpp_{i:06d}.bin") for i in (0, 2, 4)]
    return [str(p) for p in kitti] if all(kitti) else []


def _scene_inputs(label: str) -> tuple[gr.File, gr.Dataframe]:
    """The upload of several sweeps (or one zip), its example when there is one, and the table of their
    registered poses."""
    files = gr.File(label=label, file_count="multiple", file_types=list(SCENE_SUFFIXES), type="filepath")
    if scene := example_scene():
        gr.Examples([[scene]], [files], label="KITTI seq 00, sweeps 0, 2, 4 (click)")
    table = gr.Dataframe(headers=PREFIX_COLUMNS, label="Registered prefix (world frame = the first sweep)",
                         interactive=False)
    return files, table


def _generation_sensor_choice() -> gr.Dropdown:
    """The generation tab's sensor: the model's own grid (named when a model is loaded) or a preset."""
    own = f"{MODEL_SENSOR}: {PIPELINE.sensor.name}, {PIPELINE.sensor.height} x {PIPELINE.sensor.width}" if PIPELINE else MODEL_SENSOR
    return gr.Dropdown([MODEL_SENSOR, *GENERATION_SENSORS], value=MODEL_SENSOR, label="Sensor (beams x columns)",
                       info=f"{own}; the presets at their native beams", elem_id="world-sensor")


#: What the scene uploads take, as their labels say.
SCENE_UPLOADS = ("files, one .zip, or one recording: a .bag, .mcap, .db3 or Velodyne .pcap, an Ouster .pcap with its "
                 "metadata .json, nuScenes .pcd.bin sweeps with ego_pose.json, Argoverse 2 .feather sweeps with their "
                 "poses and calibration")


def _topic_box() -> gr.Textbox:
    """Which stream of a recording to read where it holds several: a bag's PointCloud2 topic, a nuScenes log."""
    return gr.Textbox(label="Topic (a bag's PointCloud2 topic, or a nuScenes log, where there are several)",
                      max_lines=1, placeholder="/velodyne_points")


def _action_radio() -> gr.Radio:
    return gr.Radio(list(ACTIONS), value="Straight", label="Ego action")


def _world_tab(demo: gr.Blocks) -> None:
    """A procedural map with its preview and the planned drive, the sampling controls, Generate."""
    guidance = _guidance_default()
    with gr.Tab("World generation"):
        with gr.Row():
            with gr.Column(scale=1):
                with gr.Row():
                    map_seed = gr.Number(3, label="Map seed", precision=0, minimum=0, maximum=MAX_SEED)
                    style = gr.Dropdown(list(STYLES), value="urban", label="Style")
                action = _action_radio()
                sensor = _generation_sensor_choice()
                sampling = _sampling_controls(8, dice=True, guidance=guidance)
                generate = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=1):
                map_preview = gr.Image(label="HD map (BEV)", height=340, elem_id="map-preview")
        view = RolloutView.build("world")
        inputs = [map_seed, style, action, *sampling.inputs, sensor]
        gr.Examples([[3, "urban", "Turn left", 8, 4, 0, guidance, MODEL_SENSOR],
                     [11, "suburban", "Straight", 8, 4, 1, guidance, MODEL_SENSOR],
                     [7, "highway", "Turn right", 4, 4, 2, guidance, _grid_label(HDL64.with_width(2048))]], inputs)
    gr.on([demo.load, map_seed.change, style.change, action.change, sampling.frames.release, sampling.seed.change],
          preview_map, [map_seed, style, action, sampling.frames, sampling.seed], map_preview, api_visibility="private")
    view.show(generate, generate_world, inputs, "generate_world")


def _forecast_tab() -> None:
    """One uploaded (or example) scan, or several sweeps of one drive registered first, continued."""
    with gr.Tab("Forecast from a scan"):
        with gr.Row():
            with gr.Column(scale=1):
                scan_file = gr.File(label="Scan (.bin, .pcd, .ply, .npy, .las)", file_types=list(READ_SUFFIXES),
                                    type="filepath", elem_id="scan-file")
                sensor = gr.Dropdown([AUTO_SENSOR, *PRESETS], value=AUTO_SENSOR, label="Sensor (when it cannot be detected)")
                action = _action_radio()
                sampling = _sampling_controls(6)
                forecast = gr.Button("Forecast", variant="primary", elem_id="forecast")
            with gr.Column(scale=1):
                gr.Examples([[str(p)] for p in example_scans()], [scan_file], label="Real scans (click one)")
                with gr.Accordion("Several sweeps of one drive: registered, then forecast", open=True):
                    sweep_files, prefix_table = _scene_inputs(f"Sweeps, oldest first ({SCENE_UPLOADS})")
                    topic = _topic_box()
                    forecast_many = gr.Button("Register and forecast", elem_id="forecast-scans")
        view = RolloutView.build("forecast")
    view.show(forecast, forecast_from_scan, [scan_file, sensor, action, *sampling.inputs], "forecast_from_scan")
    view.show(forecast_many, forecast_from_scans, [sweep_files, action, *sampling.inputs, topic], "forecast_from_scans",
              prefix_table)


def _resimulate_tab() -> None:
    """Uploaded sweeps of a scene rendered from a shifted and turned path along the observed one."""
    with gr.Tab("Re-simulate"):
        with gr.Row():
            with gr.Column(scale=1):
                files, prefix_table = _scene_inputs(f"Sweeps of the scene ({SCENE_UPLOADS})")
                topic = _topic_box()
            with gr.Column(scale=1):
                lateral = gr.Slider(-MAX_LATERAL_M, MAX_LATERAL_M, value=2.0, step=0.1, label="Lateral shift (m, left +)")
                forward = gr.Slider(-MAX_FORWARD_M, MAX_FORWARD_M, value=0.0, step=0.1, label="Forward shift (m)")
                yaw = gr.Slider(-MAX_YAW_DEG, MAX_YAW_DEG, value=0.0, step=1, label="Yaw (deg, left +)")
                sampling = _sampling_controls(3, "Frames along the observed path")
                button = gr.Button("Re-simulate", variant="primary", elem_id="resimulate")
        view = RolloutView.build("resim")
    view.show(button, resimulate, [files, lateral, forward, yaw, *sampling.inputs, topic], "resimulate", prefix_table)


def _upsample_tab() -> None:
    """One uploaded (or example) sweep on a denser beam table, or with its silent rays filled: before | after."""
    with gr.Tab("Upsample"):
        with gr.Row():
            with gr.Column(scale=1):
                scan_file = gr.File(label="Sweep (.bin, .pcd, .ply, .npy, .las), or a recording (.pcap, .bag, .mcap, "
                                          ".db3): its first sweep", file_types=list(UPSAMPLE_SUFFIXES), type="filepath",
                                    elem_id="upsample-file")
                factor = gr.Slider(1, MAX_FACTOR, value=UPSAMPLE_FACTOR, step=1, label="Factor",
                                   info="beams per measured gap: 2 puts one new beam between each two; 1 fills the "
                                        "sweep's silent rays")
                target = gr.Dropdown([BY_FACTOR, *PRESETS], value=BY_FACTOR, label="Target beams",
                                     info="by the factor, or a preset's beam table at the sweep's own columns")
                method = gr.Radio([AUTO, *METHODS], value=AUTO, label="Method",
                                  info=f"'{AUTO}': '{LEARNED}' (the edge-aware fill corrected by the model's fill "
                                       "network) for new beams of a sweep from a sensor like those it learnt from "
                                       f"(KITTI's HDL-64E for the default model), else '{EDGE_AWARE}', which fills "
                                       "other sensors' sweeps and a sweep's own silent rays (factor 1) better")
                with gr.Accordion("Sampling (method 'model')", open=False):
                    steps = gr.Slider(1, MAX_STEPS, value=_steps_default(), step=1, label="Sampling steps")
                    seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED)
                fmt = gr.Dropdown(list(SWEEP_FORMATS), value=UPSAMPLE_FORMAT, label="Download format",
                                  info="every point with its ring (.bin has no place for rings)")
                button = gr.Button("Upsample", variant="primary", elem_id="upsample")
            with gr.Column(scale=1):
                gr.Examples([[str(p)] for p in upsample_examples()], [scan_file], label="Real sweeps (click one)")
                stats = gr.JSON(label="Stats", elem_id="upsample-stats")
                downloads = gr.File(label="Downloads: the upsampled sweep, upsample.json, result.rrd / .mcap",
                                    file_count="multiple")
        viewer = gr.Model3D(label="Before (grey) and the filled rays (by height)", display_mode="point_cloud",
                            clear_color=VIEWER_BACKGROUND, height=480, elem_id="upsample-viewer",
                            camera_position=(180, 45, None))
        bev = gr.Image(label="Bird's-eye view: before | after", type="filepath", elem_id="upsample-bev")
        ranges = gr.Image(label="Range image on the target grid: before (above), after (below)", type="filepath",
                          elem_id="upsample-range")
    targets = {"viewer": viewer, "bev": bev, "range": ranges, "stats": stats, "downloads": downloads}
    button.click(_by_component(_worker(upsample_scan), targets), [scan_file, factor, target, method, steps, seed, fmt],
                 list(targets.values()), api_name="upsample", concurrency_id="model",
                 concurrency_limit=GENERATION_CONCURRENCY)


def _model_tab(demo: gr.Blocks) -> None:
    """Where the served model came from, and the source picker when the operator allows switching."""
    with gr.Tab("Model"):
        info = gr.JSON(label="Loaded checkpoint (source, iteration, EMA or regular, parameters, sensor, device)")
        switch = _model_switch_controls()
    demo.load(model_info, None, info, api_name="model_info")
    if switch is not None:  # no switching, no endpoint: nothing for a client to call
        source, reload_button, status = switch
        reload_button.click(reload_model, source, [info, status], api_name="reload_model", concurrency_id="model",
                            concurrency_limit=GENERATION_CONCURRENCY)


def _model_switch_controls() -> tuple[gr.Dropdown, gr.Button, gr.Markdown] | None:
    """The Model tab's source picker when the operator allows switching, else a line saying it is off."""
    if SWITCH is None:
        gr.Markdown("This server serves the model it was started with; switching is off "
                    "(`python app.py --allow-model-switch` offers other sources).")
        return None
    info = "a release folder, a Hub id org/name[@revision] or a job dir" if SWITCH.allow_any else "the sources this server offers"
    with gr.Row():
        source = gr.Dropdown(list(SWITCH.sources), value=None, allow_custom_value=SWITCH.allow_any, scale=4,
                             label="Source", info=info)
        reload_button = gr.Button("Load", scale=1)
    return source, reload_button, gr.Markdown()


def build_demo() -> gr.Blocks:
    """The page, for the loaded model (if any) and the switch policy. Callbacks read the model from
    `PIPELINE` at request time, so the Model tab can swap it."""
    with gr.Blocks(title="LidarVerse", delete_cache=DELETE_CACHE) as demo:
        gr.Markdown(
            "# LidarVerse\nGenerate a 360° LiDAR world around a driving car, continue a real scan, "
            "make a sparse sweep dense, and download the result for your own tools."
        )
        _world_tab(demo)
        _forecast_tab()
        _resimulate_tab()
        _upsample_tab()
        _model_tab(demo)
        gr.Markdown(HOW_IT_WORKS)
    # api_open=False: the REST routes (/run/..., /api/...) do not skip the queue, so its bound holds for all
    demo.queue(max_size=QUEUE_MAX_SIZE, api_open=False)
    _unname_private(demo)
    return demo


def _unname_private(demo: gr.Blocks) -> None:
    """Take the name off every event that is not a public endpoint (frame viewer, map preview, dice,
    examples): Gradio names each one after its function, and /call/<name> runs any named event. The page
    calls them by index, through the same queue and its per-client limit."""
    for fn in demo.fns.values():
        if fn.api_visibility != "public":
            fn.api_name = None


# ----------------------------------------------------------------------------------------------------------
# Command line.


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one `app.py: error:` line (no usage block), like the other command lines."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"app.py: error: {' '.join(message.split())} (see `python app.py --help`)\n")


def _parser() -> _Parser:
    parser = _Parser(description="LidarVerse world-generation demo (Gradio).")
    parser.add_argument("--model", default=None,
                        help="release folder, weights file, job dir or Hub id (default: $LIDARVERSE_MODEL, else weights/default)")
    parser.add_argument("--host", default=None, help="interface to bind (default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: $GRADIO_SERVER_PORT, else 7860)")
    parser.add_argument("--share", action="store_true", help="also serve through a public gradio.live link")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the model (default: torch's choice; 1 is fastest on a busy machine)")
    parser.add_argument("--dtype", default=None, help=DTYPE_HELP)
    parser.add_argument("--allow-model-switch", action="store_true", default=env_flag(SWITCH_ENV),
                        help=f"let visitors switch the model among weights/default, --model and --allow-source "
                             f"(default: off, or on when ${SWITCH_ENV}=1)")
    parser.add_argument("--allow-source", action="append", default=[], metavar="SRC",
                        help="one more source visitors may switch to (repeatable; needs --allow-model-switch)")
    parser.add_argument("--allow-any-source", action="store_true",
                        help="LOCAL DEVELOPMENT ONLY: visitors may load any path or Hub id on this machine")
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python app.py`: check the arguments, load the model, set the switch policy, then build the page for
    them (rebinding the module's `demo`, which `gradio app.py` reloads by that name) and launch it behind the
    per-client limits."""
    global DTYPE, SWITCH, demo
    parser = _parser()
    args = parser.parse_args(argv)
    DTYPE = args.dtype
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.allow_source and not (args.allow_model_switch or args.allow_any_source):
        parser.error(f"--allow-source needs --allow-model-switch (or {SWITCH_ENV}=1)")
    hops = os.environ.get(PROXY_HOPS_ENV, "1" if os.environ.get("SPACE_ID") else "0").strip()
    if not hops.isdigit():
        parser.error(f"${PROXY_HOPS_ENV} must be a whole number of proxies (0, 1, ...), got {hops!r}")

    try:
        load_model(args.model)
    except InputError as err:  # a bad --model or $LIDARVERSE_MODEL; any other failure is a bug: traceback
        parser.error(f"cannot load the model: {err}")
    SWITCH = switch_policy(args.model, args.allow_source, args.allow_model_switch, args.allow_any_source)
    sandbox.configure(sandbox.SERVER_LIMITS, spares=WORKER_SPARES)
    allowed = [str(EXAMPLE_SCANS_DIR), *([str(REAL_SCANS_DIR)] if REAL_SCANS_DIR.is_dir() else [])]
    demo = build_demo()
    demo.launch(
        server_name=args.host, server_port=args.port, share=args.share, max_file_size=f"{MAX_UPLOAD_MB}mb",
        allowed_paths=allowed, theme=gr.themes.Soft(),
        app_kwargs={"middleware": [Middleware(ClientLimits, blocks=demo, proxy_hops=int(hops))]},
    )


#: The page at import, as `gradio app.py` (reload mode) and other importers find it: built without loading a
#: model, no switching. Serving it needs a model: `main()` loads one and rebinds `demo` before it launches.
#: Uploads are read under the server's limits from the start; `main()` starts the spare workers.
sandbox.configure(sandbox.SERVER_LIMITS)
demo = build_demo()

if __name__ == "__main__":
    main()
