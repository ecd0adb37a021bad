"""Every model source form resolves to the same weights, and every bad source fails with a message that says why.

Models are tiny and randomly initialised, written to tmp dirs as real files: releases with safetensors, job
dirs through the real `FSDPCheckpointer.save`, and a Hub cache in the standard
`models--org--name/{blobs,refs,snapshots}` layout used with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import huggingface_hub.constants as hf_constants  # imported before any test sets HF_HUB_OFFLINE
import pytest
import torch

from checkpointing import CheckpointConfig, FSDPCheckpointer, JobConfig, ModelWithEMA
from inference import load_pipeline, loader
from inference.loader import (
    CONFIG_NAME,
    MODEL_ENV,
    WEIGHTS_NAME,
    ModelSourceError,
    cpu_computes_bfloat16,
    inference_device,
    load_model,
    resolve_source,
    select_device,
)
from inference.network import WorldModel
from tests.helpers import TINY_SENSOR, tiny_config, tiny_model, write_hub_cache, write_release
from tests.hub_stand_in import HubServer as _HubServer
from tests.hub_stand_in import serve_hub
from training.config import TrainConfig


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


@pytest.fixture
def release(tmp_path: Path) -> tuple[Path, WorldModel]:
    model = tiny_model(seed=1)
    return write_release(tmp_path / "release", model), model


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


# --- local forms -------------------------------------------------------------------------------------------


def test_release_folder_loads_its_weights_with_provenance(release):
    folder, model = release
    loaded, prov = load_model(folder)
    assert params_equal(loaded, model)
    assert not loaded.training
    assert (prov.kind, prov.iteration, prov.weights) == ("release", 123, "ema")
    assert prov.parameters == model.num_parameters()
    assert prov.sensor == "tiny8"
    assert (prov.device, prov.dtype) == ("cpu", "float32")
    assert prov.resolved_path == str(folder / WEIGHTS_NAME)


def test_no_source_uses_the_environment_variable(release, monkeypatch):
    folder, _ = release
    monkeypatch.setenv(MODEL_ENV, str(folder))
    resolved = resolve_source(None)
    assert resolved.weights_path == folder / WEIGHTS_NAME
    assert resolved.source == str(folder)


def test_no_source_without_a_default_release_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    monkeypatch.setattr(loader, "DEFAULT_MODEL", tmp_path / "weights" / "default")
    with pytest.raises(
        ModelSourceError, match=r"embedded default .* holds no model\.safetensors.*training\.export"
    ):
        resolve_source(None)


def test_single_safetensors_file_takes_config_beside_it_or_passed_in(release, tmp_path):
    folder, model = release
    loaded, prov = load_model(folder / WEIGHTS_NAME)
    assert prov.kind == "file" and params_equal(loaded, model)

    lone = tmp_path / "lone" / "weights.safetensors"
    lone.parent.mkdir()
    lone.write_bytes((folder / WEIGHTS_NAME).read_bytes())
    with pytest.raises(ModelSourceError, match=r"no config\.json beside .*pass config="):
        load_model(lone)
    loaded, _ = load_model(lone, config=folder / CONFIG_NAME)
    assert params_equal(loaded, model)
    loaded, _ = load_model(lone, config=model.config)
    assert params_equal(loaded, model)


def test_pt_state_dict_with_wrapper_prefixes_loads(release, tmp_path):
    _, model = release
    path = tmp_path / "wrapped.pt"
    torch.save({f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}, path)
    loaded, prov = load_model(path, config=model.config.to_dict())
    assert params_equal(loaded, model)
    assert prov.weights == "unknown"


def test_prefixed_safetensors_release_loads(tmp_path):
    model = tiny_model(seed=2)
    folder = write_release(tmp_path / "fsdp", model, prefix="_fsdp_wrapped_module.")
    loaded, _ = load_model(folder)
    assert params_equal(loaded, model)


# --- training job dirs, written by the real FSDPCheckpointer ---------------------------------------------------


def write_job(job: Path, generations: dict[int, tuple[WorldModel, WorldModel | None]]) -> Path:
    """A job dir as training leaves it: config.json (TrainConfig) + checkpoints/ with numbered generations."""
    job.mkdir(parents=True, exist_ok=True)
    some_model = next(iter(generations.values()))[0]
    (job / CONFIG_NAME).write_text(TrainConfig(model=some_model.config.to_dict(), data_root="data").to_json())
    checkpointer = FSDPCheckpointer(
        CheckpointConfig(keep_last_checkpoints=5, async_saving=False), JobConfig(path_local=str(job))
    )
    for iteration, (model, ema) in sorted(generations.items()):
        checkpointer.save(ModelWithEMA(model, ema), None, None, None, iteration, async_saving=False)
    checkpointer.finalize()
    return job


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, dict[str, WorldModel]]:
    models = {name: tiny_model(seed=i) for i, name in enumerate(("reg10", "ema10", "reg20", "ema20"))}
    path = write_job(
        tmp_path / "job", {10: (models["reg10"], models["ema10"]), 20: (models["reg20"], models["ema20"])}
    )
    return path, models


def test_job_dir_follows_the_pointer_and_prefers_ema(job):
    path, models = job
    for source in (path, path / "checkpoints", path / "checkpoints" / "iter_000000020.pt"):
        loaded, prov = load_model(source)
        assert params_equal(loaded, models["ema20"]), source
        assert (prov.kind, prov.iteration, prov.weights, prov.notes) == ("job", 20, "ema", ())
        assert prov.resolved_path.endswith("iter_000000020_ema_model.pt")


def test_job_without_ema_falls_back_to_regular_weights_with_a_notice(tmp_path):
    model = tiny_model(seed=5)
    path = write_job(tmp_path / "job", {30: (model, None)})
    loaded, prov = load_model(path)
    assert params_equal(loaded, model)
    assert (prov.iteration, prov.weights) == (30, "regular")
    assert any("no EMA weights" in note for note in prov.notes)


def test_corrupt_latest_generation_falls_back_to_the_newest_valid_one(job):
    path, models = job
    ema20 = path / "checkpoints" / "iter_000000020_ema_model.pt"
    ema20.write_bytes(ema20.read_bytes()[: ema20.stat().st_size // 2])  # a torn write
    loaded, prov = load_model(path)
    assert params_equal(loaded, models["ema10"])
    assert (prov.iteration, prov.weights) == (10, "ema")
    assert any("falling back to iter_000000010.pt" in note for note in prov.notes)


def test_a_generation_weights_file_takes_the_job_config(job):
    path, models = job
    loaded, prov = load_model(path / "checkpoints" / "iter_000000010_reg_model.pt")
    assert params_equal(loaded, models["reg10"])
    assert (prov.kind, prov.iteration, prov.weights) == ("file", 10, "regular")


def test_job_that_has_not_saved_yet_says_to_wait(tmp_path):
    (tmp_path / "job" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ModelSourceError, match=r"has no loadable checkpoint.*Wait for the job's first save"):
        resolve_source(tmp_path / "job")


# --- Hub ids through a real on-disk cache --------------------------------------------------------------------


def test_hub_id_resolves_offline_from_the_standard_cache(release, offline_hub):
    folder, model = release
    commit = write_hub_cache(offline_hub, "lidarverse/tiny", folder, refs=("main", "v1"))
    for source in (
        "lidarverse/tiny",
        "lidarverse/tiny@v1",
        f"hf://lidarverse/tiny@{commit}",
        "hf://lidarverse/tiny",
    ):
        loaded, prov = load_model(source)
        assert params_equal(loaded, model), source
        assert (prov.kind, prov.revision, prov.source) == ("hub", commit, source)
        assert prov.resolved_path.startswith(str(offline_hub))


def test_hub_cache_dir_argument_overrides_the_environment(release, tmp_path, monkeypatch):
    folder, _ = release
    cache = tmp_path / "elsewhere"
    commit = write_hub_cache(cache, "lidarverse/tiny", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    resolved = resolve_source("lidarverse/tiny", cache_dir=cache, local_files_only=True)
    assert resolved.revision == commit


def test_hub_offline_with_nothing_cached_names_the_fix(offline_hub):
    with pytest.raises(
        ModelSourceError,
        match=r"holds nothing for 'lidarverse/absent'.*HF_HUB_OFFLINE.*hf download.*no local path 'lidarverse/absent'",
    ):
        resolve_source("lidarverse/absent")


def test_hub_offline_unknown_revision_lists_what_is_cached(release, offline_hub):
    folder, _ = release
    write_hub_cache(offline_hub, "lidarverse/tiny", folder)
    with pytest.raises(
        ModelSourceError, match=r"only at refs \['main'\].*not at revision 'v9'.*--revision v9"
    ):
        resolve_source("hf://lidarverse/tiny@v9")


def test_hub_snapshot_without_weights_names_the_missing_file(release, offline_hub):
    folder, _ = release
    write_hub_cache(offline_hub, "lidarverse/configonly", folder, files=(CONFIG_NAME,))
    with pytest.raises(
        ModelSourceError, match=r"snapshot of 'lidarverse/configonly'@main has no model\.safetensors"
    ):
        resolve_source("lidarverse/configonly")


@pytest.fixture
def online_hub(release, tmp_path, monkeypatch):
    if hf_constants.HF_HUB_OFFLINE:
        pytest.skip("this process started with HF_HUB_OFFLINE=1, so huggingface_hub refuses every request")
    folder, _ = release
    _HubServer.reset({
        "lidarverse/tiny": {name: (folder / name).read_bytes() for name in (CONFIG_NAME, WEIGHTS_NAME)},
        "lidarverse/configonly": {CONFIG_NAME: (folder / CONFIG_NAME).read_bytes()},
        "lidarverse/wide": {CONFIG_NAME: json.dumps({**tiny_config().to_dict(), "base_channels": 2048}).encode(),
                            WEIGHTS_NAME: (folder / WEIGHTS_NAME).read_bytes()},
    })
    with serve_hub(monkeypatch, tmp_path / "hub"):
        yield tmp_path / "hub"


def test_hub_download_fills_the_standard_cache_then_works_offline(online_hub, release, monkeypatch):
    _, model = release
    loaded, prov = load_model("lidarverse/tiny")
    assert params_equal(loaded, model)
    assert prov.revision == _HubServer.commit
    snapshot = online_hub / "models--lidarverse--tiny" / "snapshots" / _HubServer.commit
    assert prov.resolved_path == str(snapshot / WEIGHTS_NAME)
    assert (online_hub / "models--lidarverse--tiny" / "refs" / "main").read_text() == _HubServer.commit
    assert {auth for _, auth in _HubServer.requests} == {"Bearer hf_from_the_environment"}  # token from env
    # the weights come from the commit the config came from, even if main moves in between
    assert f"/lidarverse/tiny/resolve/{_HubServer.commit}/{WEIGHTS_NAME}" in {
        path for path, _ in _HubServer.requests
    }
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _HubServer.repos = {}  # anything that still asked the server would now fail
    loaded, prov = load_model("lidarverse/tiny")
    assert params_equal(loaded, model) and prov.revision == _HubServer.commit


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "lidarverse/nothere",
            r"'lidarverse/nothere' .*does not exist or is private \(no local path .*HF_TOKEN",
        ),
        ("hf://lidarverse/gated", r"is gated: accept its terms on https://huggingface.co/lidarverse/gated"),
        ("hf://lidarverse/tiny@v9", r"revision 'v9' does not exist; use a branch, tag or commit hash"),
        ("hf://lidarverse/configonly", r"has no model\.safetensors; expected a LidarVerse release"),
    ],
)
def test_hub_errors_name_the_fix(online_hub, source, message):
    with pytest.raises(ModelSourceError, match=message):
        resolve_source(source)


def weights_fetched(cache: Path) -> list[Path]:
    return [p for p in cache.rglob(WEIGHTS_NAME)] + [p for p in cache.rglob("*.incomplete")]


def test_hub_weights_over_the_size_limit_are_refused_from_their_metadata_before_download(online_hub, monkeypatch):
    monkeypatch.setattr(loader, "MAX_HUB_WEIGHTS_BYTES", 1000)
    size = len(_HubServer.repos["lidarverse/tiny"][WEIGHTS_NAME])
    with pytest.raises(
        ModelSourceError,
        match=rf"'lidarverse/tiny' at revision '{_HubServer.commit}': model\.safetensors is {size:,} bytes, "
        r"over the 1,000-byte download limit.*hf download lidarverse/tiny",
    ):
        load_model("lidarverse/tiny")
    assert weights_fetched(online_hub) == [], "the weights must not be downloaded"


def test_hub_config_with_an_unbounded_architecture_is_refused_before_the_weights_download(online_hub):
    with pytest.raises(ModelSourceError, match=r"config of 'lidarverse/wide' is not a valid WorldModelConfig.*base_channels"):
        load_model("lidarverse/wide")
    assert weights_fetched(online_hub) == []


# --- bad sources -----------------------------------------------------------------------------------------------


def test_missing_path_says_what_was_expected(tmp_path):
    with pytest.raises(ModelSourceError, match=r"does not exist; expected a release folder"):
        resolve_source(tmp_path / "nope")


def test_empty_folder_says_it_is_empty(tmp_path):
    with pytest.raises(ModelSourceError, match=r"is not a model: it is empty; expected a release folder"):
        resolve_source(tmp_path)


def test_job_that_has_not_made_its_checkpoints_folder_yet_says_to_wait(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / CONFIG_NAME).write_text(
        TrainConfig(model=tiny_config().to_dict(), data_root="data", save_iter=100).to_json()
    )
    with pytest.raises(ModelSourceError, match=r"training job .* has no checkpoint yet.*save_iter=100"):
        resolve_source(job)


def test_release_folder_without_weights_names_the_missing_file(release):
    folder, _ = release
    (folder / WEIGHTS_NAME).unlink()
    with pytest.raises(ModelSourceError, match=r"has config\.json but no model\.safetensors"):
        resolve_source(folder)


def test_unknown_file_suffix_is_refused(tmp_path):
    path = tmp_path / "weights.onnx"
    path.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match=r"unsupported suffix '\.onnx'.*\.pth or \.bin or \.ckpt"):
        resolve_source(path)


def test_wrong_architecture_lists_missing_unexpected_and_shape_mismatches(tmp_path):
    folder = write_release(tmp_path / "big", tiny_model(base_channels=16))
    small = tiny_config()
    with pytest.raises(ModelSourceError) as info:
        load_model(folder / WEIGHTS_NAME, config=small)
    message = str(info.value)
    assert "does not fit WorldModel: shape mismatches (" in message
    assert "file (32, 32, 3, 3) vs model (16, 16, 3, 3)" in message


def test_wrong_architecture_names_missing_and_unexpected_keys(tmp_path):
    folder = write_release(tmp_path / "attn", tiny_model(bottleneck_attention=True))
    with pytest.raises(ModelSourceError) as info:
        load_model(folder / WEIGHTS_NAME, config=tiny_config(bottleneck_attention=False))
    assert "unexpected" in str(info.value) and "mid_attn" in str(info.value)
    with pytest.raises(ModelSourceError) as info:
        load_model(folder / WEIGHTS_NAME, config=tiny_config(blocks=2))
    assert "missing" in str(info.value)


class _Payload:
    """Pickles to a call of os.system: what a malicious checkpoint looks like."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_is_refused_and_its_payload_never_runs(release, tmp_path):
    _, model = release
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    state = dict(model.state_dict())
    state["__payload__"] = _Payload(marker)
    torch.save(state, path)
    with pytest.raises(ModelSourceError, match=r"system|unsafe|global"):
        load_model(path, config=model.config)
    assert not marker.exists()


def test_bad_config_is_named(release, tmp_path):
    folder, _ = release
    (folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ModelSourceError, match=r"config .*config\.json is not valid JSON"):
        resolve_source(folder)
    (folder / CONFIG_NAME).write_text(json.dumps({"base_channels": 8, "wings": 2}))
    with pytest.raises(ModelSourceError, match=r"not a valid WorldModelConfig.*wings"):
        load_model(folder)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_channels", 2048),  # 2048-wide levels: ~0.4 G parameters if it were built
        ("channel_mults", [1, 2, 4, 8, 16, 32, 64]),
        ("blocks", 1000),
        ("sensor", {**TINY_SENSOR.to_dict(), "width": 1_000_000}),
        ("strides", [[1, 2], [2], [2, 2]]),  # a wrong-length entry used to raise IndexError
        ("strides", [[1, 2], [2, 2]]),  # one level short
    ],
)
def test_a_local_config_out_of_bounds_is_refused_quickly_naming_the_field(release, field, value):
    folder, _ = release
    (folder / CONFIG_NAME).write_text(json.dumps({**tiny_config().to_dict(), field: value}))
    start = time.perf_counter()
    with pytest.raises(ModelSourceError, match=rf"not a valid WorldModelConfig: .*{field}"):
        load_model(folder)
    assert time.perf_counter() - start < 1.0, "the config must be refused before the network is built"


def test_torn_safetensors_file_is_refused(release):
    folder, _ = release
    weights = folder / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelSourceError, match=r"not a readable \.safetensors"):
        resolve_source(folder)


# --- device and dtype ------------------------------------------------------------------------------------------


def test_a_pipeline_runs_bfloat16_on_the_cpu_only_where_it_computes_it_in_hardware(monkeypatch, tmp_path):
    """One CPU is either kind, so the other is its capability check answering the other way. Loading to train
    or to export (`select_device`, `load_model`) keeps float32 on every CPU."""
    cpu = torch.device("cpu")
    release = write_release(tmp_path / "r", tiny_model(seed=1))
    for amx, default in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert cpu_computes_bfloat16() is amx
        assert inference_device("cpu") == (cpu, default)
        assert inference_device("cpu", "float32") == (cpu, torch.float32)  # a choice is never changed
        assert select_device("cpu") == (cpu, torch.float32)
        assert next(load_model(str(release), device="cpu")[0].parameters()).dtype == torch.float32
        pipe = load_pipeline(release, device="cpu")
        assert next(pipe.model.parameters()).dtype == default and pipe.provenance.dtype == str(default).split(".")[1]
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert inference_device("cpu") == (cpu, torch.float32)  # a torch without the check keeps float32


def test_device_defaults_to_cpu_float32_without_cuda():
    if torch.cuda.is_available():
        assert select_device() == (torch.device("cuda"), torch.bfloat16)
    else:
        assert select_device() == (torch.device("cpu"), torch.float32)
    assert select_device("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ModelSourceError, match=r"unsupported dtype 'int8'"):
        select_device("cpu", "int8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelSourceError, match=r"CUDA is not available; use device='cpu'"):
            select_device("cuda")
