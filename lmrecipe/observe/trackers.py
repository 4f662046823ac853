"""Experiment trackers (``logging.trackers``): Accelerate's tracker classes, with each tool's own conventions.

Every backend is Accelerate's ``GeneralTracker`` for it (``accelerate.tracking``: the interface Accelerate's
``log_with=`` and Trainer's ``report_to`` use), built here rather than through ``Accelerator(log_with=...)`` because
where its data goes depends on ``out_dir`` and on whether the run resumes, known after the Accelerator exists. The
main process alone logs. What each backend does with a run that resumes or rolls back:

- ``wandb``: its own login (``wandb login`` / ``~/.netrc`` or ``WANDB_API_KEY``) and ``WANDB_MODE`` decide online or
  offline (without a login and without ``WANDB_MODE`` it runs offline and says so), ``WANDB_PROJECT`` /
  ``WANDB_ENTITY`` / ``WANDB_DIR`` are respected (default project ``logging.project``, files under ``out_dir``). The
  run id is kept in ``out_dir/wandb_run_id``: a resumed or requeued job continues the same run. When logged steps
  are undone (a loss-spike rollback, a resume from an earlier checkpoint), an online run is rewound in place
  (wandb's ``resume_from="<id>?_step=<step>"``); an offline one cannot be, so a new run continues it, its config
  naming the run it continues (``lmrecipe_continues_run``) and ``wandb_run_id`` pointing at it.
- ``tensorboard``: event files in ``out_dir/tensorboard``. One log folder over resumes; undone steps are purged
  (``SummaryWriter(purge_step=...)``: TensorBoard drops the earlier events of those steps).
- ``mlflow``: ``MLFLOW_TRACKING_URI`` if set, else a SQLite store ``out_dir/mlflow.db`` (MLflow 3 keeps its file store
  in maintenance mode), artifacts under ``out_dir/mlflow``; experiment ``MLFLOW_EXPERIMENT_NAME`` or
  ``logging.project``. The run id is kept in ``out_dir/mlflow_run_id`` and resumed. MLflow cannot delete metric
  values, so undone steps start a new run tagged with the one it continues (``lmrecipe.continues_run``).
- ``comet_ml``, ``aim``, ``clearml``, ``dvclive``, ``swanlab``, ``trackio``: Accelerate's classes as they are, each
  session a new run (logged at start-up); undone steps are logged again in the new session.

``metrics.jsonl`` stays the record: the trackers receive exactly its rows.

:func:`check_trackers` runs at start-up, before anything is written to ``out_dir``: each tracker's library, the
folders it writes, its server (one request, no retry) and, for wandb online, a login. What it finds stops the run
with exit 2 and the fix.
"""

from __future__ import annotations

import http.client
import importlib.util
import logging
import os
import tempfile
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lmrecipe.errors import fail
from lmrecipe.fileio import write_text_atomic

logger = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"


@dataclass(frozen=True)
class Backend:
    accelerate_class: str
    module: str
    """The module that must import for the backend to work."""
    install: str
    """What to pip install."""


BACKENDS = {
    "wandb": Backend("WandBTracker", "wandb", "wandb"),
    "tensorboard": Backend("TensorBoardTracker", "tensorboard", "tensorboard"),
    "mlflow": Backend("MLflowTracker", "mlflow", "mlflow-skinny sqlalchemy alembic"),
    "comet_ml": Backend("CometMLTracker", "comet_ml", "comet_ml"),
    "aim": Backend("AimTracker", "aim", "aim"),
    "clearml": Backend("ClearMLTracker", "clearml", "clearml"),
    "dvclive": Backend("DVCLiveTracker", "dvclive", "dvclive"),
    "swanlab": Backend("SwanLabTracker", "swanlab", "swanlab"),
    "trackio": Backend("TrackioTracker", "trackio", "trackio"),
}


#: How long the start-up check waits for a tracking server to answer its one request (seconds).
SERVER_TIMEOUT_S = 10.0
#: wandb's modes (``WANDB_MODE``); the first three log to local files only.
WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")
WANDB_MODES = (*WANDB_OFFLINE_MODES, "online", "run", "shared")


def check_trackers(names: list[str], out_dir: Path | None = None, accelerator=None) -> None:
    """Exit 2 naming the fix, before anything is written, when a tracker of ``names`` cannot work: an unknown name or
    a library that is not installed (every rank); with ``out_dir``, on the main process (the one that logs): a folder
    it writes that is a file or cannot be created, an ``MLFLOW_TRACKING_URI`` that MLflow refuses, cannot write or
    whose server does not answer, ``WANDB_MODE`` that is not a mode, wandb online without a login or an answer from
    its server. ``accelerator`` shares the main process's finding, so every rank stops alike."""
    for name in names:
        if name not in BACKENDS:
            raise fail(f"logging.trackers: unknown tracker {name!r}. Choose from {', '.join(BACKENDS)} "
                       "(a list, e.g. logging.trackers=[wandb,tensorboard]), or [] for none.")
        backend = BACKENDS[name]
        if importlib.util.find_spec(backend.module) is None:
            raise fail(f"logging.trackers includes {name!r} but its library is not installed here: "
                       f"pip install {backend.install} (in this environment), or remove {name!r} from logging.trackers.")
    if out_dir is None or not names:
        return
    problem = None
    if accelerator is None or accelerator.is_main_process:
        problem = next((found for name in names if (found := _tracker_problem(name, Path(out_dir)))), None)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem])[0]
    if problem:
        raise fail(problem)


def _tracker_problem(name: str, out_dir: Path) -> str | None:
    """Why tracker ``name`` cannot start for a run in ``out_dir`` (None: nothing found)."""
    if name == "wandb":
        return _wandb_problem(out_dir)
    if name == "mlflow":
        return _mlflow_problem(out_dir)
    if name == "tensorboard":
        return _folder_problem(out_dir / "tensorboard", "logging.trackers: tensorboard writes its event files")
    import accelerate.tracking as tracking

    if getattr(tracking, BACKENDS[name].accelerate_class).requires_logging_directory:
        return _folder_problem(out_dir / name, f"logging.trackers: {name} writes its files")
    return None


def _wandb_problem(out_dir: Path) -> str | None:
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        return (f"WANDB_MODE={mode!r} is not a wandb mode (choose from {', '.join(WANDB_MODES)}): set WANDB_MODE=online "
                "or offline, or unset it (online with a wandb login, offline without).")
    if mode == "disabled":
        return None
    folder = Path(os.environ.get("WANDB_DIR") or out_dir) / "wandb"
    if problem := _folder_problem(folder, "logging.trackers: wandb writes its run files"):
        return problem + " (WANDB_DIR, when set, moves them.)"
    if mode in WANDB_OFFLINE_MODES:
        return None
    import wandb

    if not wandb.login(prompt=False, verify=False):  # netrc or WANDB_API_KEY; no network
        if mode is None:
            return None  # logs offline and says so (Trackers._wandb)
        return (f"WANDB_MODE={mode} logs to the wandb server, but no wandb login was found (WANDB_API_KEY, or `wandb "
                "login`, which writes ~/.netrc): log in or set WANDB_API_KEY, or set WANDB_MODE=offline to log under "
                f"{folder} and upload later with `wandb sync`.")
    server = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return _server_problem(
        server, "wandb", f"check the network and WANDB_BASE_URL, or set WANDB_MODE=offline to log under {folder} and "
                         "upload later with `wandb sync`.")


def _mlflow_problem(out_dir: Path) -> str | None:
    artifacts = _folder_problem(out_dir / "mlflow", "logging.trackers: mlflow writes its artifacts")
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return artifacts or _file_problem(out_dir / "mlflow.db", "logging.trackers: mlflow keeps its SQLite store")
    what = f"MLFLOW_TRACKING_URI={uri}"
    fix = "set it to a reachable server or a writable sqlite:///PATH.db, or unset it (a SQLite store in out_dir)."
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return artifacts or _server_problem(uri.rstrip("/") + "/health", what, fix)
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):].partition("?")[0]
        if path in ("", ":memory:"):
            return artifacts
        return artifacts or _file_problem(Path(path), f"{what}: its SQLite store", fix)
    if scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            return (f"{what} is a file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true: use a "
                    "SQLite store instead (MLFLOW_TRACKING_URI=sqlite:///PATH.db, or unset it for out_dir/mlflow.db), "
                    "or set MLFLOW_ALLOW_FILE_STORE=true.")
        return artifacts or _folder_problem(Path(parts.path if scheme else uri), f"{what}: its file store", fix)
    return artifacts  # databricks, a database server: MLflow's own client checks those


def _folder_problem(path: Path, what: str, fix: str = "") -> str | None:
    """Why ``path`` cannot be a folder that a tracker writes in (None: it is one, or can be created)."""
    if path.exists() and not path.is_dir():
        return (f"{what} in {path}, which is a file, not a folder: "
                f"{fix or 'move the file away, or choose another out_dir.'}")
    return _creatable(path, what, fix)


def _file_problem(path: Path, what: str, fix: str = "") -> str | None:
    """Why ``path`` cannot be a file that a tracker writes (None: it is one, or can be created)."""
    if path.is_dir():
        return (f"{what} in {path}, which is a folder, not a file: "
                f"{fix or 'move the folder away, or choose another out_dir.'}")
    if path.exists():
        return None if os.access(path, os.R_OK | os.W_OK) else (
            f"{what} in {path}, which this user cannot write: {fix or 'choose another out_dir.'}")
    return _creatable(path.parent, what, fix, path)


def _creatable(folder: Path, what: str, fix: str, target: Path | None = None) -> str | None:
    """Whether ``folder`` can be written in: its nearest existing ancestor takes a new entry (created and removed at
    once, so nothing is left; root passes every permission check, so the check writes)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    target = target or folder
    if not existing.is_dir():
        return f"{what} in {target}, which cannot be created ({existing} is a file): {fix or 'choose another out_dir.'}"
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".lmrecipe-write-check-").cleanup()
    except OSError as err:
        return (f"{what} in {target}, which cannot be created ({existing}: {err.strerror or err}): "
                f"{fix or 'choose another out_dir, or make it writable.'}")
    return None


def _server_problem(url: str, what: str, fix: str) -> str | None:
    """One request to ``url``: None when the server answers at all (any HTTP status), else why not and ``fix``. A
    tracker's own client retries an absent server for minutes before it fails."""
    try:
        urllib.request.urlopen(url, timeout=SERVER_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, http.client.HTTPException, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        return f"{what}: the server at {url} did not answer ({reason}; waited up to {SERVER_TIMEOUT_S:g} s): {fix}"
    return None


class Trackers:
    """The run's trackers on the main process: :meth:`log` a metrics row, :meth:`rewind` undone steps, :meth:`close`.

    ``last_logged_step``: the last step the trackers received before this session (the last row of metrics.jsonl
    before it was trimmed to ``start_step``); steps after ``start_step`` up to it are undone.
    """

    def __init__(self, names: list[str], out_dir: Path, project: str, run_name: str, config: dict,
                 start_step: int, last_logged_step: int):
        check_trackers(names)
        self.out_dir = out_dir
        self.project = project
        self.run_name = run_name
        self.config = _flat(config)
        self.trackers: dict[str, object] = {}
        undone = last_logged_step > start_step
        for name in names:
            self.trackers[name] = self._open(name, start_step, undone)

    # ---- opening each backend

    def _open(self, name: str, step: int, undone: bool):
        import accelerate.tracking as tracking

        cls = getattr(tracking, BACKENDS[name].accelerate_class)
        if name == "wandb":
            tracker = self._wandb(cls, step, undone)
        elif name == "tensorboard":
            tracker = cls("tensorboard", self.out_dir, **({"purge_step": step + 1} if step > 0 else {}))
            tracker.start()
            if step > 0:
                logger.info("tensorboard: %s continues; events after step %d are purged", self.out_dir / "tensorboard",
                            step)
        elif name == "mlflow":
            tracker = self._mlflow(cls, step, undone)
        else:
            tracker = cls(self.run_name, **({"logging_dir": str(self.out_dir / name)}
                                             if cls.requires_logging_directory else {}))
            tracker.start()
            logger.info("%s: a new run for this session (it has no resume here); see its own interface", name)
        if name not in ("wandb", "mlflow", "tensorboard"):  # tensorboard: the config is out_dir/config.yaml
            tracker.store_init_configuration(self.config)
        return tracker

    def _wandb(self, cls, step: int, undone: bool):
        import wandb

        id_file = self.out_dir / WANDB_ID_FILE
        previous = id_file.read_text().strip() if id_file.is_file() else None
        mode = os.environ.get("WANDB_MODE")
        if mode is None and not wandb.login(prompt=False, verify=False):  # netrc or WANDB_API_KEY
            mode = "offline"
            logger.info("wandb: no login found (`wandb login` or WANDB_API_KEY) and WANDB_MODE is unset: this run "
                        "logs offline under %s (upload it later with `wandb sync`)", self.out_dir / "wandb")
        offline = mode in ("offline", "dryrun", "disabled")
        kwargs = {"name": self.run_name, "dir": os.environ.get("WANDB_DIR", str(self.out_dir)), "config": self.config}
        if mode is not None:
            kwargs["mode"] = mode
        run_id = previous or uuid.uuid4().hex[:8]  # wandb's id form: 8 lowercase alphanumerics
        if previous and undone and not offline:
            kwargs["resume_from"] = f"{previous}?_step={step}"  # rewind the same run
        elif previous and undone:
            run_id = uuid.uuid4().hex[:8]
            kwargs["config"] = {**self.config, "lmrecipe_continues_run": previous}
            logger.info("wandb: steps after %d of offline run %s were undone; offline runs cannot be rewound, so run %s "
                        "continues it", step, previous, run_id)
        if "resume_from" not in kwargs:
            kwargs.update(id=run_id, resume="allow")
        tracker = cls(os.environ.get("WANDB_PROJECT", self.project), **kwargs)
        try:
            tracker.start()
        except Exception as err:  # noqa: BLE001 - a server that cannot rewind: continue in a linked run instead
            if "resume_from" not in kwargs:
                raise
            run_id = uuid.uuid4().hex[:8]
            logger.warning("wandb: rewinding run %s failed (%s); run %s continues it", previous, err, run_id)
            kwargs.pop("resume_from")
            kwargs.update(id=run_id, resume="allow", config={**self.config, "lmrecipe_continues_run": previous})
            tracker = cls(os.environ.get("WANDB_PROJECT", self.project), **kwargs)
            tracker.start()
        write_text_atomic(id_file, run_id + "\n")
        logger.info("wandb run %s (%s) under %s", run_id, "offline" if offline else mode or "online", kwargs["dir"])
        return tracker

    def _mlflow(self, cls, step: int, undone: bool):
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            mlflow.set_tracking_uri(f"sqlite:///{(self.out_dir / 'mlflow.db').resolve()}")
        id_file = self.out_dir / MLFLOW_ID_FILE
        previous = id_file.read_text().strip() if id_file.is_file() else None
        tags = {"lmrecipe.continues_run": previous} if previous and undone else None
        tracker = cls(experiment_name=self.project, logging_dir=str((self.out_dir / "mlflow").resolve()),
                      run_id=None if undone else previous, run_name=self.run_name, tags=tags)
        tracker.start()
        run_id = tracker.active_run.info.run_id
        if previous is None or undone:
            tracker.store_init_configuration(self.config)
        if previous and undone:
            logger.info("mlflow: steps after %d of run %s were undone; MLflow keeps metric values, so run %s continues "
                        "it (tag lmrecipe.continues_run)", step, previous, run_id)
        write_text_atomic(id_file, run_id + "\n")
        logger.info("mlflow run %s at %s", run_id, mlflow.get_tracking_uri())
        return tracker

    # ---- logging

    def log(self, row: dict) -> None:
        step = row["step"]
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        for tracker in self.trackers.values():
            tracker.log(numbers, step=step)

    def rewind(self, step: int) -> None:
        """Steps after ``step`` were undone (a rollback): each backend as the module docstring says."""
        for name in list(self.trackers):
            self.trackers[name].finish()
            self.trackers[name] = self._open(name, step, undone=True)

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.finish()


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``: one value per key, as trackers show hyperparameters."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
