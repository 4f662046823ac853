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
"""

from __future__ import annotations

import importlib.util
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

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


def check_trackers(names: list[str]) -> None:
    """Every name is a backend and its library imports; else exit 2 naming the fix (before anything is written)."""
    for name in names:
        if name not in BACKENDS:
            raise fail(f"logging.trackers: unknown tracker {name!r}. Choose from {', '.join(BACKENDS)} "
                       "(a list, e.g. logging.trackers=[wandb,tensorboard]), or [] for none.")
        backend = BACKENDS[name]
        if importlib.util.find_spec(backend.module) is None:
            raise fail(f"logging.trackers includes {name!r} but its library is not installed here: "
                       f"pip install {backend.install} (in this environment), or remove {name!r} from logging.trackers.")


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
