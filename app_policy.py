"""What a public LidarVerse server shows its visitors of itself, and which models they may make it load.

Two rules of the app that are not page layout, kept out of app.py (the Gradio page only) so each reads and is
tested on its own:

- **No server paths.** `public_text` cuts every path in a text to what a visitor may see (repo-relative
  inside the app's folder, else its last component); the app passes every message, the Model tab and the
  `poses.json` of a download through it. The server log keeps the full paths.
- **The model-switch policy.** A load replaces the model for every visitor, so by default there is none
  (`switch_policy` returns None: the start-up model only). The operator may allow an allow-list (the shipped
  release, the start-up source and each `--allow-source`, offered by label) or, for local development only,
  any path or Hub id a visitor types.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from inference.loader import MODEL_ENV
from lidar.errors import InputError

logger = logging.getLogger(__name__)

#: The app's folder (the repository root): paths inside it are shown repo-relative.
APP_DIR = Path(__file__).resolve().parent
#: The release shipped in the repository, as visitors see it named.
DEFAULT_SOURCE = "weights/default"
#: Environment variable that turns model switching on, like --allow-model-switch (a Space sets it in its settings).
SWITCH_ENV = "LIDARVERSE_ALLOW_MODEL_SWITCH"

#: An absolute (or home-relative) path inside a message: not after a word character, a dot, a colon or a
#: slash, so Hub ids (org/name) and URLs are left alone.
_SERVER_PATH = re.compile(r"(?<![\w.:/~-])[/~][^\s'\"`,;()\[\]{}<>]*")


def public_text(text: str) -> str:
    """`text` with every server path cut to what a visitor may see: repo-relative inside the app's folder,
    else its last component. The server log keeps the full paths."""
    return _SERVER_PATH.sub(lambda match: _public_path(Path(match.group()).expanduser()), text)


def _public_path(path: Path) -> str:
    if path.is_relative_to(APP_DIR):
        return str(path.relative_to(APP_DIR))
    return path.name or "(server path)"


class SourceNotOffered(InputError):
    """A visitor asked for a model source the server does not offer; the message lists the ones it does."""


@dataclass(frozen=True)
class ModelSwitch:
    """The sources visitors may switch the served model to (`switch_policy` gives None, no switching, unless
    the operator allows it)."""

    #: label shown to visitors -> source passed to `load_pipeline` (absolute paths stay on the server)
    sources: dict[str, str]
    #: local development only (--allow-any-source): any path or Hub id a visitor types is loaded
    allow_any: bool = False

    @classmethod
    def of(cls, sources: list[str], allow_any: bool = False) -> ModelSwitch:
        """Label each source for visitors, once per folder; a label two sources share gets a number."""
        labelled: dict[str, str] = {}
        seen: set[str] = set()
        for source in sources:
            key = str(Path(source).resolve()) if Path(source).exists() else source
            if key in seen:
                continue
            seen.add(key)
            base = public_text(source)
            label, k = base, 2
            while label in labelled:
                label, k = f"{base} ({k})", k + 1
            labelled[label] = source
        return cls(labelled, allow_any)

    def source_for(self, label: str) -> str:
        """The source behind a visitor's choice; `SourceNotOffered` naming what is offered otherwise."""
        if label in self.sources:
            return self.sources[label]
        if self.allow_any and label:
            return str(APP_DIR / label) if (APP_DIR / label).exists() else label  # repo-relative from any cwd
        raise SourceNotOffered(f"{public_text(label)!r} is not a model this server offers; choose one of: "
                               f"{', '.join(self.sources)}.")


def start_up_source(source: str | None) -> str | None:
    """The source the app starts with: --model, else $LIDARVERSE_MODEL, else None (the shipped release),
    read as `load_pipeline` reads it, so the label and the switch list name the model actually served."""
    return source or os.environ.get(MODEL_ENV, "").strip() or None


def source_label(source: str | None) -> str:
    """How visitors see a start-up source: None is $LIDARVERSE_MODEL or the shipped release."""
    return public_text(start_up_source(source) or DEFAULT_SOURCE)


def switch_policy(model: str | None, extra: list[str], allow_switch: bool, allow_any: bool) -> ModelSwitch | None:
    """The policy the command line asks for: None (no switching), an allow-list (the shipped release, the
    start-up model, the --allow-source entries), or any source for local development."""
    if not (allow_switch or allow_any):
        return None
    start_up = start_up_source(model)
    switch = ModelSwitch.of([str(APP_DIR / DEFAULT_SOURCE), *([start_up] if start_up else []), *extra], allow_any)
    logger.info("model switching on among %s%s", switch.sources,
                "; ANY path or Hub id may be loaded (--allow-any-source: local development only)" if allow_any else "")
    return switch
