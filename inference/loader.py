"""Model sources -> a loaded `WorldModel` plus where it came from.

diffusers' `from_pretrained` sets the bar: one call takes every form a user has at hand (the embedded
default, a release folder, a single weights file, the job dir of a run that is still training, a Hub id)
and every failure says what was expected and how to fix it. Weights only ever enter through
`checkpointing.FSDPInferenceCheckpointer`, so the demo and training share one loading path and its safety
checks: nothing is ever unpickled into code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from checkpointing import (
    CheckpointError,
    FSDPInferenceCheckpointer,
    ResolvedWeights,
    StateDictMismatchError,
    layout,
    resolve_weights,
)
from checkpointing.weights import WEIGHT_SUFFIXES, checkpoints_dir_of
from inference.fill_network import FILL_WEIGHTS_NAME, MAX_FILL_BYTES
from inference.network import WorldModel, WorldModelConfig
from lidar.errors import InputError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The release shipped in the repository; what a laptop user gets offline with no arguments.
DEFAULT_MODEL = REPO_ROOT / "weights" / "default"
#: Environment variable naming the source used when none is given (a Space sets it to its Hub id).
MODEL_ENV = "LIDARVERSE_MODEL"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
HUB_PREFIX = "hf://"
#: Largest Hub weights file downloaded, judged from the Hub's file metadata before any byte of it is fetched
#: (the default release is 5.2 MB; a Space must not let one id fill its disk or memory).
MAX_HUB_WEIGHTS_BYTES = 1 << 30
#: Largest Hub config.json downloaded; a real one is under 2 KB.
MAX_HUB_CONFIG_BYTES = 1 << 20
#: `org/name` with an optional `@revision` (branch, tag or commit hash), as the Hub spells repo ids.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
_EXPECTED = (
    "a release folder (config.json + model.safetensors), a .safetensors/.pt weights file, a training job "
    "dir (or its checkpoints/ folder), or a Hub id org/name[@revision] / hf://org/name@revision"
)


class ModelSourceError(InputError):
    """A source that cannot be resolved or loaded; the message names the source, the problem and the fix."""


@dataclass(frozen=True)
class ResolvedSource:
    """A source pinned to one weights file on local disk, with the config it was built from."""

    #: What the caller asked for (the default or $LIDARVERSE_MODEL spelled out when none was given).
    source: str
    #: "release", "file", "job" or "hub".
    kind: str
    weights_path: Path
    #: `WorldModelConfig.to_dict()` of the network the weights belong to.
    config: dict[str, Any]
    iteration: int | None = None
    #: True for EMA weights, False for the regular ones, None when a bare file does not say.
    ema: bool | None = None
    #: The Hub commit hash the files came from.
    revision: str | None = None
    #: Things the user should know (e.g. "fell back to regular weights").
    notes: tuple[str, ...] = ()
    #: The release's fill network for upsampling (`inference.fill_network`), where it ships one.
    fill_path: Path | None = None


@dataclass(frozen=True)
class Provenance:
    """Where a loaded pipeline came from; `info` prints it and the app shows it."""

    source: str
    kind: str
    resolved_path: str
    iteration: int | None
    weights: str
    parameters: int
    sensor: str
    device: str
    dtype: str
    revision: str | None
    notes: tuple[str, ...]
    load_seconds: float
    #: The fill network's file, or None where the source ships none.
    fill: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


# ---------------------------------------------------------------------------------------------------------
# 1. Resolve: source -> ResolvedSource (one branch per form, nothing loaded yet)
# ---------------------------------------------------------------------------------------------------------


def resolve_source(
    source: str | os.PathLike[str] | None = None,
    *,
    config: WorldModelConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> ResolvedSource:
    """Pin `source` to one local weights file and its config.

    `config` supplies (or overrides) the architecture, e.g. for a bare weights file with no config.json
    beside it. `cache_dir` and `local_files_only` only matter for Hub ids; by default they follow
    HF_HUB_CACHE and HF_HUB_OFFLINE as set when this is called.
    """
    if source is None:
        env = os.environ.get(MODEL_ENV, "").strip()
        source = env or DEFAULT_MODEL
        if not env and not (DEFAULT_MODEL / WEIGHTS_NAME).is_file():
            raise ModelSourceError(
                f"no model source given and the embedded default {DEFAULT_MODEL} holds no {WEIGHTS_NAME}; pass --model SRC "
                f"(or set ${MODEL_ENV}) to {_EXPECTED}, or export a release there with "
                "`python -m training.export JOB_DIR weights/default`"
            )
    text = os.fspath(source).strip()
    override = _config_override(config)
    if text.startswith(HUB_PREFIX):
        return _resolve_hub(text[len(HUB_PREFIX) :], text, override, cache_dir, local_files_only)
    path = Path(text).expanduser()
    if path.is_file():
        return _resolve_file(path, text, override)
    if path.is_dir():
        return _resolve_folder(path, text, override)
    if _HUB_ID.match(text) and not path.suffix:
        return _resolve_hub(text, text, override, cache_dir, local_files_only)
    raise ModelSourceError(f"model source {text!r} does not exist; expected {_EXPECTED}")


def _resolve_folder(path: Path, source: str, override: dict[str, Any] | None) -> ResolvedSource:
    if (path / WEIGHTS_NAME).is_file():
        return _resolve_release(path, source, "release", override)
    if _holds_checkpoints(path):
        return _resolve_job(path, source, override)
    if (path / CONFIG_NAME).is_file():
        data = _read_json(path / CONFIG_NAME)
        if "data_root" in data:  # a TrainConfig: the job dir of a run that has not saved yet
            raise ModelSourceError(
                f"training job {path} has no checkpoint yet (no checkpoints/ folder); wait for its first save "
                f"(every save_iter={data.get('save_iter', '?')} iterations), or point at a release folder"
            )
        raise ModelSourceError(
            f"release folder {path} has {CONFIG_NAME} but no {WEIGHTS_NAME}; expected both"
        )
    listing = sorted(p.name for p in path.iterdir())[:8]
    held = f"it holds {listing}" if listing else "it is empty"
    raise ModelSourceError(f"model folder {path} is not a model: {held}; expected {_EXPECTED}")


def _resolve_release(
    path: Path, source: str, kind: str, override: dict[str, Any] | None, revision: str | None = None
) -> ResolvedSource:
    weights = path / WEIGHTS_NAME
    meta = _safetensors_metadata(weights)
    config = override if override is not None else _config_beside(weights, meta)
    return ResolvedSource(
        source=source,
        kind=kind,
        weights_path=weights,
        config=config,
        iteration=_int_or_none(meta.get("iteration")),
        ema=_ema_from_metadata(meta, default=True),  # docs/design.md: a release holds the EMA weights
        revision=revision,
        fill_path=path / FILL_WEIGHTS_NAME if (path / FILL_WEIGHTS_NAME).is_file() else None,
    )


def _resolve_file(path: Path, source: str, override: dict[str, Any] | None) -> ResolvedSource:
    """A single weights file; a checkpoint marker (iter_*.pt) resolves to its generation's weights."""
    if path.suffix not in WEIGHT_SUFFIXES:
        raise ModelSourceError(
            f"model file {path} has an unsupported suffix {path.suffix!r}; expected a weights file ending in "
            f"{' or '.join(WEIGHT_SUFFIXES)}, or {_EXPECTED}"
        )
    if path.suffix == ".pt":
        weights = _checkpoint_weights(path, source)
        if weights.kind != "file":  # a generation marker
            return _from_generation(weights, source, override)
        iteration, ema = _generation_member(path)
        config = override if override is not None else _config_beside(path, {})
        return ResolvedSource(source, "file", path, config, iteration, ema)
    meta = _safetensors_metadata(path)
    config = override if override is not None else _config_beside(path, meta)
    return ResolvedSource(
        source,
        "file",
        path,
        config,
        _int_or_none(meta.get("iteration")),
        _ema_from_metadata(meta, default=None),
    )


# ---------------------------------------------------------------------------------------------------------
# Training job dirs: checkpointing owns the layout, the validation and the fallback; this only asks it
# ---------------------------------------------------------------------------------------------------------


def _holds_checkpoints(path: Path) -> bool:
    try:
        checkpoints_dir_of(path)
    except CheckpointError:
        return False
    return True


def _resolve_job(path: Path, source: str, override: dict[str, Any] | None) -> ResolvedSource:
    """Follow latest_checkpoint.txt to a valid generation (falling back as a resume would), EMA first."""
    return _from_generation(_checkpoint_weights(path, source), source, override)


def _checkpoint_weights(path: Path, source: str) -> ResolvedWeights:
    try:
        return resolve_weights(path, prefer_ema=True)
    except CheckpointError as exc:
        raise ModelSourceError(
            f"training job {source!r} has no loadable checkpoint: {exc}. Wait for the job's first save, or "
            f"point at an older job or a release folder"
        ) from None


def _from_generation(
    weights: ResolvedWeights, source: str, override: dict[str, Any] | None
) -> ResolvedSource:
    config = override if override is not None else _config_beside(weights.path, {})
    return ResolvedSource(
        source=source,
        kind="job",
        weights_path=weights.path,
        config=config,
        iteration=weights.iteration,
        ema=weights.kind == "ema",
        notes=tuple(weights.notices),
    )


def _generation_member(path: Path) -> tuple[int | None, bool | None]:
    """(iteration, is EMA) of a file named like a generation's weights, e.g. iter_000000100_ema_model.pt."""
    marker = layout.generation_of(path.name)
    if marker is None:
        return None, None
    iteration = layout.parse_marker(marker)
    kinds = {
        layout.sibling_name(marker, layout.EMA_MODEL): True,
        layout.sibling_name(marker, layout.REG_MODEL): False,
    }
    return iteration, kinds.get(path.name)


# ---------------------------------------------------------------------------------------------------------
# Hub ids
# ---------------------------------------------------------------------------------------------------------


def _resolve_hub(
    spec: str,
    source: str,
    override: dict[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    local_files_only: bool | None,
) -> ResolvedSource:
    """Fetch a release's files through huggingface_hub's standard cache (or find them there offline)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    match = _HUB_ID.match(spec)
    if match is None:
        raise ModelSourceError(
            f"model source {source!r} is not a Hub id; expected org/name[@revision] or hf://org/name@revision"
        )
    repo, revision = match["repo"], match["revision"] or "main"
    # Read at call time, not at import: the app or a test may set them after huggingface_hub is imported.
    offline = (
        local_files_only
        if local_files_only is not None
        else (constants.HF_HUB_OFFLINE or env_flag("HF_HUB_OFFLINE"))
    )
    cache = Path(cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # a mirror or a private Hub; None: huggingface.co
    where = f"Hub repo {repo!r} at revision {revision!r}"
    local_hint = "" if source.startswith(HUB_PREFIX) else f" (no local path {spec!r} exists either)"
    files: dict[str, Path] = {}
    start = time.perf_counter()
    pinned = revision  # after the first file, the commit it came from: both files from one commit
    limits = {CONFIG_NAME: MAX_HUB_CONFIG_BYTES, WEIGHTS_NAME: MAX_HUB_WEIGHTS_BYTES}
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            # a cached file was bounded when it was fetched; a file whose size cannot be read is not fetched
            cache_only = offline or not _hub_file_size_ok(repo, name, pinned, endpoint, limits[name])
            files[name] = Path(
                hf_hub_download(
                    repo, name, revision=pinned, cache_dir=cache, local_files_only=cache_only, endpoint=endpoint
                )
            )
            pinned = files[name].parent.name  # .../snapshots/<commit>/<name>
            if name == CONFIG_NAME and override is None:  # a bad architecture is refused before the weights come
                _validated_config(_read_config(files[name]), source)
        except GatedRepoError:
            raise ModelSourceError(
                f"{where} is gated: accept its terms on https://huggingface.co/{repo} and set HF_TOKEN "
                "(or run `hf auth login`) to a token of that account"
            ) from None
        except RepositoryNotFoundError:
            raise ModelSourceError(
                f"{where} does not exist or is private{local_hint}; check the id, or set HF_TOKEN (or run "
                "`hf auth login`) if the repo is private"
            ) from None
        except RevisionNotFoundError:
            raise ModelSourceError(
                f"{where}: revision {revision!r} does not exist; use a branch, tag or commit hash of the repo "
                "(e.g. org/name@main)"
            ) from None
        except LocalEntryNotFoundError as exc:
            raise ModelSourceError(
                _not_cached_message(repo, revision, name, cache, offline, exc) + local_hint
            ) from None
        except EntryNotFoundError:
            raise ModelSourceError(
                f"{where} has no {name}; expected a LidarVerse release (config.json + model.safetensors, "
                "as `python -m training.export` writes it)"
            ) from None
        except HFValidationError as exc:
            raise ModelSourceError(
                f"model source {source!r} is not a valid Hub id ({exc}); expected org/name[@revision]"
            ) from None
    _fetch_hub_fill(repo, pinned, cache, offline, endpoint)
    logger.info(
        "resolved %s to commit %s in %.2fs (offline=%s)", where, pinned, time.perf_counter() - start, offline
    )
    return _resolve_release(files[WEIGHTS_NAME].parent, source, "hub", override, revision=pinned)


def _fetch_hub_fill(repo: str, commit: str, cache: Path, offline: bool, endpoint: str | None) -> None:
    """The release's fill network into the cache beside its weights, where the repo has one (it is optional:
    without it only the learned upsampling is missing); bounded like the weights."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        cache_only = offline or not _hub_file_size_ok(repo, FILL_WEIGHTS_NAME, commit, endpoint, MAX_FILL_BYTES)
        hf_hub_download(repo, FILL_WEIGHTS_NAME, revision=commit, cache_dir=cache, local_files_only=cache_only,
                        endpoint=endpoint)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        logger.info("Hub repo %r at %s has no %s (or it is not cached): no learned upsampling", repo, commit,
                    FILL_WEIGHTS_NAME)


def _hub_file_size_ok(repo: str, name: str, revision: str, endpoint: str | None, limit: int) -> bool:
    """Refuse a Hub file larger than `limit` from its metadata (one HEAD request), before downloading it.

    False when the Hub cannot be asked: the caller then takes the file from the cache only, since an
    unjudged file is never downloaded.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, name, revision=revision, endpoint=endpoint), endpoint=endpoint)
    except HfHubHTTPError:
        raise  # not found, gated, unknown revision: the caller names the fix
    except Exception as exc:  # the HTTP client's transport errors (no network, proxy, timeout)
        logger.warning("cannot ask the Hub for the size of %s in %s (%s); using the cache only", name, repo, exc)
        return False
    if meta.size is None or meta.size > limit:
        size = "of unknown size" if meta.size is None else f"{meta.size:,} bytes"
        raise ModelSourceError(
            f"Hub repo {repo!r} at revision {revision!r}: {name} is {size}, over the {limit:,}-byte download limit "
            f"for a LidarVerse release (the default one is 5.2 MB); download it yourself (`hf download {repo}`) "
            "and pass the local folder if you trust it"
        )
    return True


def _not_cached_message(
    repo: str, revision: str, name: str, cache: Path, offline: bool, exc: Exception
) -> str:
    """Say what the cache holds for the repo, so the user can tell a typo from a missing download."""
    from huggingface_hub.file_download import repo_folder_name

    folder = cache / repo_folder_name(repo_id=repo, repo_type="model")
    refs = sorted(p.name for p in (folder / "refs").glob("*")) if folder.is_dir() else []
    snapshots = sorted(p.name for p in (folder / "snapshots").glob("*")) if folder.is_dir() else []
    if not folder.is_dir():
        held = f"the Hub cache {cache} holds nothing for {repo!r}"
    elif revision in refs or revision in snapshots:
        held = f"the cached snapshot of {repo!r}@{revision} has no {name}"
    else:
        held = (
            f"the Hub cache {cache} holds {repo!r} only at refs {refs} / commits "
            f"{[s[:12] for s in snapshots]}, not at revision {revision!r}"
        )
    if offline:
        rev_flag = f" --revision {revision}" if revision != "main" else ""
        return (
            f"{held}, and offline mode (HF_HUB_OFFLINE=1) forbids downloading; unset HF_HUB_OFFLINE (or run "
            f"`hf download {repo}{rev_flag}` with network access) to fetch it, or pass a local release folder"
        )
    return (
        f"could not reach the Hub to fetch {name} of {repo!r}@{revision} ({exc.__class__.__name__}) and "
        f"{held}; check the network connection, proxy or HF_ENDPOINT, or pass a local release folder"
    )


def env_flag(name: str) -> bool:
    """True when the environment variable is set to 1, true, yes or on (any case)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# ---------------------------------------------------------------------------------------------------------
# Configs and metadata
# ---------------------------------------------------------------------------------------------------------


def _config_override(
    config: WorldModelConfig | dict[str, Any] | str | os.PathLike[str] | None,
) -> dict[str, Any] | None:
    if config is None:
        return None
    if isinstance(config, WorldModelConfig):
        return config.to_dict()
    if isinstance(config, dict):
        return _model_section(config, "the config argument")
    return _read_config(Path(config))


def _model_section(data: Any, where: str) -> dict[str, Any]:
    """A release's config.json is a WorldModelConfig dict; a job dir's is a TrainConfig holding one as "model"."""
    if not isinstance(data, dict):
        raise ModelSourceError(f"{where} must hold a JSON object, got {type(data).__name__}")
    model = data.get("model")
    return model if isinstance(model, dict) else data


def _read_config(path: Path) -> dict[str, Any]:
    return _model_section(_read_json(path), f"config {path}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"config {path} does not exist; expected a config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"config {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"config {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _config_beside(weights: Path, meta: dict[str, str]) -> dict[str, Any]:
    """config.json next to the weights (or, for a checkpoint, in the job dir above), else the file's metadata."""
    for candidate in (weights.parent / CONFIG_NAME, weights.parent.parent / CONFIG_NAME):
        if candidate.is_file():
            return _read_config(candidate)
    if "config" in meta:
        try:
            return _model_section(json.loads(meta["config"]), f"the metadata of {weights}")
        except json.JSONDecodeError as exc:
            raise ModelSourceError(
                f"the config in the metadata of {weights} is not valid JSON ({exc})"
            ) from None
    raise ModelSourceError(
        f"no {CONFIG_NAME} beside {weights} (nor in {weights.parent.parent}); put the release's config.json "
        "there or pass config=... (CLI: --config FILE)"
    )


def _validated_config(config: dict[str, Any], source: str) -> WorldModelConfig:
    """The validated `WorldModelConfig` of a source; its bounds (widths, depth, sensor size) hold before
    anything is built, and the error names the field."""
    try:
        return WorldModelConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ModelSourceError(f"the config of {source!r} is not a valid WorldModelConfig: {exc}") from None


def _safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a .safetensors header (iteration, source, ...); no tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for torn or foreign files
        raise ModelSourceError(f"weights file {path} is not a readable .safetensors file ({exc})") from None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _ema_from_metadata(meta: dict[str, str], default: bool | None) -> bool | None:
    value = str(meta.get("ema", meta.get("weights", ""))).strip().lower()
    if value in {"1", "true", "ema"}:
        return True
    if value in {"0", "false", "regular", "reg"}:
        return False
    return default


# ---------------------------------------------------------------------------------------------------------
# 2. Load: ResolvedSource -> WorldModel on a device
# ---------------------------------------------------------------------------------------------------------


#: What a command line's `--dtype` chooses, in its help: `inference_device`'s default where none is given.
DTYPE_HELP = "float32, bfloat16 or float16 (default: bfloat16 on a GPU and on a CPU with AMX, else float32)"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles: Intel Xeon since Sapphire Rapids).

    There a pipeline runs faster in bfloat16 than in float32 with the same figures on real sweeps
    (docs/benchmarks.md); elsewhere bfloat16 is emulated and slower. AVX512-BF16 without AMX (AMD Zen 4) is
    not measured and keeps float32.
    """
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own check; private, so looked up
    return bool(amx is not None and amx())


def inference_device(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """What a pipeline runs in: `select_device`'s choice, but bf16 on a CPU that computes it in hardware
    (`cpu_computes_bfloat16`) unless a dtype is given. Loading to train or to export keeps float32."""
    dev, resolved = select_device(device, dtype)
    if dtype is None and dev.type == "cpu" and cpu_computes_bfloat16():
        return dev, torch.bfloat16
    return dev, resolved


def select_device(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 when available, else CPU float32; an explicit choice is checked, never silently changed."""
    if device is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ModelSourceError(f"unknown device {device!r}; expected 'cpu', 'cuda' or 'cuda:N'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ModelSourceError(
                f"device {device!r} was asked for but CUDA is not available; use device='cpu'"
            )
        if dev.type not in {"cpu", "cuda"}:
            raise ModelSourceError(f"unsupported device {device!r}; expected 'cpu' or 'cuda'")
    if dtype is None:
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    resolved = (
        dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    )
    if resolved not in {torch.float32, torch.bfloat16, torch.float16}:
        raise ModelSourceError(f"unsupported dtype {dtype!r}; expected one of float32, bfloat16, float16")
    return dev, resolved


def load_model(
    source: str | os.PathLike[str] | None = None,
    *,
    config: WorldModelConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> tuple[WorldModel, Provenance]:
    """Resolve `source`, rebuild the network from its config and load the weights, ready for inference."""
    start = time.perf_counter()
    # 1. Resolve the source to one local weights file and its config.
    resolved = resolve_source(source, config=config, cache_dir=cache_dir, local_files_only=local_files_only)
    dev, dt = select_device(device, dtype)
    # 2. Rebuild the architecture from the config alone (docs/design.md: self-describing weights), checked and
    #    bounded first so a hostile or mistyped config.json cannot allocate a giant network.
    model_config = _validated_config(resolved.config, resolved.source)
    model = WorldModel(model_config)
    # 3. Load the weights through the checkpointer: safe formats only, prefixes stripped, shapes checked.
    _load_weights(model, resolved)
    model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    for note in resolved.notes:
        logger.warning("%s", note)
    provenance = Provenance(
        source=resolved.source,
        kind=resolved.kind,
        resolved_path=str(resolved.weights_path),
        iteration=resolved.iteration,
        weights={True: "ema", False: "regular", None: "unknown"}[resolved.ema],
        parameters=model.num_parameters(),
        sensor=model_config.sensor_obj.name,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        revision=resolved.revision,
        notes=resolved.notes,
        load_seconds=time.perf_counter() - start,
        fill=None if resolved.fill_path is None else str(resolved.fill_path),
    )
    logger.info(
        "loaded %s (%s, %d parameters) from %s in %.2fs",
        resolved.source,
        provenance.weights,
        provenance.parameters,
        resolved.weights_path,
        provenance.load_seconds,
    )
    return model, provenance


def _load_weights(model: WorldModel, resolved: ResolvedSource) -> None:
    """The one place weights enter: weights-only unpickling or safetensors, wrapper prefixes stripped, strict."""
    start = time.perf_counter()
    try:
        FSDPInferenceCheckpointer(resolved.weights_path, strict_resume=True).load_model_during_init(model)
    except StateDictMismatchError as exc:
        reason = str(exc).replace(" Pass strict_resume=False to load only what matches.", "")
        raise ModelSourceError(
            f"{reason} Check that the config belongs to these weights (or pass the right config=...)"
        ) from None
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise ModelSourceError(f"cannot load the weights of {resolved.source!r}: {exc}") from None
    logger.info("read %s in %.2fs", resolved.weights_path, time.perf_counter() - start)
