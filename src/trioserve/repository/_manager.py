"""The repository API and the model control modes over the served models.

    none      every model found at startup is loaded; the API cannot load or unload
    poll      the same, and the folders are read again every ``poll_secs``: new or
              changed models load, removed ones unload
    explicit  only the ``--load-model`` names load at startup ("*": all); the API loads
              and unloads

Folders are read and model.py files imported in a worker thread, and each version loads
in its own runner, so loading never holds up requests to other models. Loads of
different models run at once, up to ``load_threads`` of them (Triton's
``--model-load-thread-count``); the loads and unloads of one model take turns. A load
that takes longer than ``load_timeout_s`` fails, and frees its turn: its thread, stuck
in the model's import or ``initialize``, cannot be stopped, and is left to finish on
its own (whatever it does then is dropped). A model that fails to load stays listed in
the index as UNAVAILABLE with the reason; a failed reload leaves the version served
before it serving, as in Triton. A load's uploaded files are removed as soon as that
load fails (before it answers), or once another load or an unload replaces the model
they made; in a worker thread, since deleting a large model's files takes tens of
milliseconds.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import trio
from prometheus_client import CollectorRegistry

from .._errors import InvalidArgumentError, NotFoundError, UnsupportedError
from .._model import DynamicBatching, Model
from .._model_code import model_failure
from .._model_import import failure_text
from .._served import LoadTimeout, ModelRepository, ServedModel, UploadedFile
from ._config import ConfigError
from ._ensemble import EnsembleModel
from ._layout import CheckpointLoader, model_folders
from ._pb_metrics_export import CustomMetrics
from ._pb_options import PythonOptions
from ._reading import read_model

logger = logging.getLogger("trioserve.repository")

ControlMode = Literal["none", "poll", "explicit"]
MakeRunners = Callable[[Sequence[Model]], list[ServedModel]]
_NAME_MAX = 255  # the longest file name component, as POSIX systems allow


class RepositoryManager:
    """Implements ``RepositoryControl`` for a server's ``ModelRepository``."""

    def __init__(
        self,
        repository: ModelRepository,
        make_runners: MakeRunners,
        *,
        folders: Sequence[Path] = (),
        builtin: Sequence[Model] = (),
        mode: ControlMode = "none",
        startup_models: Sequence[str] = (),
        poll_secs: float = 15.0,
        strict: bool = False,
        registry: CollectorRegistry | None = None,
        checkpoint_loader: CheckpointLoader | None = None,
        load_threads: int = 4,
        load_timeout_s: float = 600.0,
        python: PythonOptions | None = None,
    ) -> None:
        self._repository = repository
        self._make_runners = make_runners
        self._folders = tuple(folders)
        self._builtin = {model.name: model for model in builtin}
        self._mode = mode
        self._startup = tuple(startup_models)
        self._poll_secs = poll_secs
        self._strict = strict
        self._python = python
        self._checkpoint_loader = checkpoint_loader
        self._failures: dict[str, str] = {}  # model name -> why it is not served
        self._unloaded: set[str] = set()
        self._found: set[str] = set()  # model folders seen in the repositories
        # The scan that the loads of startup or of a poll share: a scan reads every
        # folder, so scanning again for each model would cost n scans of n folders.
        self._scanned: dict[str, Path] | None = None
        self._signatures: dict[str, tuple[tuple[str, int, int], ...]] = {}  # poll: what changed
        # The uploaded files of the model served under each name, and of each load in
        # progress (removed if it fails).
        self._uploads: dict[str, tempfile.TemporaryDirectory[str]] = {}
        self._uploading: dict[str, tempfile.TemporaryDirectory[str]] = {}
        # name -> (its lock, how many hold or wait for it): one load or unload of a
        # model at a time; the entry goes when nobody needs it.
        self._locks: dict[str, tuple[trio.Lock, int]] = {}
        self._load_slots = trio.Semaphore(load_threads)  # loads running at once
        self._load_timeout_s = load_timeout_s or math.inf  # 0: no limit
        self._polled = trio.lowlevel.ParkingLot()  # who waits for the next poll to end
        self._metrics = CustomMetrics()  # what Python-backend models make with pb_utils
        if registry is not None:
            registry.register(self._metrics)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the startup models, report started, then poll (in poll mode)."""
        self._repository.control = self
        names = await self._scan()
        with self._reusing(names):
            if self._mode == "explicit":
                wanted = set(names) | set(self._builtin) if "*" in self._startup else self._startup
            else:
                wanted = set(names)
            async with trio.open_nursery() as startup:  # at once, up to load_threads
                for name in sorted(wanted):
                    startup.start_soon(self._load_reporting, name)
        task_status.started()
        try:
            while self._mode == "poll":
                await trio.sleep(self._poll_secs)
                await self._poll()
                self._polled.unpark_all()
            await trio.sleep_forever()
        finally:
            for upload in [*self._uploads.values(), *self._uploading.values()]:
                await _remove(upload)

    async def next_poll(self) -> None:
        """Return once the next poll of the folders has been acted on (poll mode)."""
        await self._polled.park()

    async def _scan(self) -> dict[str, Path]:
        try:
            folders = await trio.to_thread.run_sync(model_folders, self._folders)
        except ConfigError as exc:
            logger.error("%s", exc)
            return {}
        self._found = set(folders)
        return folders

    @contextlib.contextmanager
    def _reusing(self, folders: dict[str, Path]) -> Iterator[None]:
        self._scanned = folders
        try:
            yield
        finally:
            self._scanned = None

    async def _poll(self) -> None:
        folders = await self._scan()
        for name in sorted(set(self._signatures) - set(folders)):
            logger.info("model '%s' left the repository: unloading", name)
            await self._unload_model(name)
            del self._signatures[name]
        with self._reusing(folders):
            for name, folder in sorted(folders.items()):
                signature = await trio.to_thread.run_sync(_signature, folder)
                if self._signatures.get(name) != signature:
                    await self._load_reporting(name)

    async def _load_reporting(self, name: str) -> None:
        with contextlib.suppress(InvalidArgumentError):  # logged, and listed in the index
            await self._load_model(name, None, {})

    def failed_models(self) -> list[str]:
        return sorted(name for name in self._failures if not self._repository.has(name))

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        """Every model the repositories hold or the server serves, by name."""
        entries = []
        known = set(self._builtin) | set(self._failures) | set(self._unloaded)
        known |= self._found | set(self._repository.names())
        loading = {name for name, _ in self._repository.loading}
        known |= loading
        for name in sorted(known):
            if self._repository.has(name):
                for v in self._repository.versions(name):
                    down = self._repository.get(name, v).model.unavailable()
                    if down is not None:
                        entries.append(
                            {"name": name, "version": v, "state": "UNAVAILABLE", "reason": down}
                        )
                    elif self._repository.model_ready(name, v):
                        entries.append({"name": name, "version": v, "state": "READY", "reason": ""})
            elif not ready_only:
                reason = self._failures.get(name, "unloaded" if name in self._unloaded else "")
                state = "UNAVAILABLE" if reason else ""
                if name in loading:
                    state, reason = "LOADING", ""
                entries.append({"name": name, "version": "", "state": state, "reason": reason})
        return entries

    async def load(
        self, name: str, config: str | None, files: Mapping[str, bytes | UploadedFile]
    ) -> None:
        """The API's load: only in explicit mode."""
        self._check_explicit()
        _check_model_name(name)
        await self._load_model(name, config, files)

    async def unload(self, name: str, unload_dependents: bool) -> None:
        """The API's unload: only in explicit mode. With ``unload_dependents``, unloading
        an ensemble also unloads the models of its steps that no other ensemble uses."""
        self._check_explicit()
        composing = _composing_models(self._repository, name) if unload_dependents else set()
        await self._unload_model(name)
        still_used = set().union(
            *(_composing_models(self._repository, other) for other in self._repository.names())
        )
        for dependent in sorted(composing - still_used):
            await self._unload_model(dependent)

    def _check_explicit(self) -> None:
        if self._mode != "explicit":
            raise UnsupportedError(
                "explicit model load / unload is not allowed if polling is enabled or the "
                "model control mode is 'none'"
            )

    @contextlib.asynccontextmanager
    async def _exclusive(self, name: str) -> AsyncIterator[None]:
        """Hold ``name``'s lock: its loads and unloads one at a time."""
        lock, users = self._locks.get(name, (trio.Lock(), 0))
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    @trio.lowlevel.enable_ki_protection  # model code runs below: see _model_code
    async def _load_model(
        self, name: str, config: str | None, files: Mapping[str, bytes | UploadedFile]
    ) -> None:
        """Load (or reload) ``name``; an error says ``failed to load``, as Triton's does."""
        async with self._exclusive(name), self._load_slots:
            try:
                with self._repository.loading_model(name):
                    deadline = trio.current_time() + self._load_timeout_s
                    await self._load(name, config, files, deadline)
            except BaseException as exc:  # a bad config or model file, initialize failed
                reason = self._failure_reason(model_failure(exc, name, "while it loaded"))
                logger.error("failed to load '%s', %s", name, reason)
                self._failures[name] = reason = self._without_server_paths(reason)
                failed_upload = self._uploading.pop(name, None)
                if failed_upload is not None:
                    await _remove(failed_upload)
                raise InvalidArgumentError(f"failed to load '{name}', {reason}") from None
            self._failures.pop(name, None)
            self._unloaded.discard(name)
            await self._replace_upload(name)
            logger.info("loaded model '%s'", name)

    def _failure_reason(self, failure: Exception) -> str:
        if isinstance(failure, LoadTimeout):
            return (
                f"loading took longer than {self._load_timeout_s:g} s "
                "(--model-load-timeout-secs); an import or initialize still running is "
                "left behind in its thread, and what it does is ignored"
            )
        if isinstance(failure, ConfigError | InvalidArgumentError):  # says it all itself
            return str(failure)
        return failure_text(failure)

    async def _replace_upload(self, name: str) -> None:
        """``name`` now serves what its last load made: the files of the model it
        replaced go, and its own upload (if any) stays while it serves."""
        old = self._uploads.pop(name, None)
        new = self._uploading.pop(name, None)
        if new is not None:
            self._uploads[name] = new
        if old is not None:
            await _remove(old)

    def _without_server_paths(self, reason: str) -> str:
        """A load failure as clients see it (the log has it whole): files named from
        their repository folder, never by where the server keeps them."""
        roots = {str(root) for root in self._folders}
        roots |= {str(root.resolve()) for root in self._folders}
        roots |= {upload.name for upload in [*self._uploads.values(), *self._uploading.values()]}
        for root in sorted(roots, key=len, reverse=True):
            reason = reason.replace(root.rstrip(os.sep) + os.sep, "")
        return reason

    async def _load(
        self,
        name: str,
        config: str | None,
        files: Mapping[str, bytes | UploadedFile],
        deadline: float,
    ) -> None:
        if files:
            if config is None:
                raise ConfigError("file: parameters need a 'config' parameter beside them")
            folder = await self._upload(name, files)
        elif name in self._builtin:
            await self._install(name, [_overridden(self._builtin[name], config)], deadline)
            return
        else:
            scanned = self._scanned if self._scanned is not None else await self._scan()
            found = scanned.get(name)
            if found is None:
                raise ConfigError("failed to poll from model repository")
            folder = found
            self._signatures[name] = await trio.to_thread.run_sync(_signature, folder)
        with trio.CancelScope(deadline=deadline) as reading:
            # The model's import runs here: past the deadline, the thread is left behind
            # (a limiter of its own, so that it holds none of the threads others need).
            models = await trio.to_thread.run_sync(
                lambda: read_model(
                    folder,
                    self._repository,
                    override=config,
                    strict=self._strict,
                    metrics=self._metrics,
                    checkpoint_loader=self._checkpoint_loader,
                    python=self._python,
                ),
                abandon_on_cancel=True,
                limiter=trio.CapacityLimiter(1),
            )
        if reading.cancelled_caught:
            raise LoadTimeout(name)
        await self._install(name, models, deadline)

    async def _install(self, name: str, models: Sequence[Model], deadline: float) -> None:
        """Serve ``models`` as ``name``."""
        runners = self._make_runners(models)
        await self._repository.install(name, runners, deadline)

    async def _upload(self, name: str, files: Mapping[str, bytes | UploadedFile]) -> Path:
        """Write the load request's files into a fresh folder that stands for the model
        (in a worker thread: they may be large)."""
        for path in files:
            parts = Path(path).parts
            if Path(path).is_absolute() or ".." in parts or not parts:
                raise InvalidArgumentError(f"Invalid file path '{path}': must stay in the model")
            if any(len(part) > _NAME_MAX for part in parts):
                raise InvalidArgumentError(f"Invalid file path '{path[:64]}...': name too long")
        upload = tempfile.TemporaryDirectory(prefix="trioserve-model-")
        self._uploading[name] = upload
        folder = Path(upload.name) / name
        await trio.to_thread.run_sync(_write_files, folder, files)
        return folder

    async def _unload_model(self, name: str) -> None:
        """Stop serving ``name`` once its requests in flight finish."""
        async with self._exclusive(name):
            if not self._repository.has(name):
                if name not in self._builtin and name not in self._signatures:
                    raise NotFoundError(f"failed to unload '{name}', no such model")
                return
            await self._repository.remove(name)
            self._unloaded.add(name)
            upload = self._uploads.pop(name, None)
            if upload is not None:
                await _remove(upload)
            logger.info("unloaded model '%s'", name)


async def _remove(upload: tempfile.TemporaryDirectory[str]) -> None:
    """Delete an upload's folder in a worker thread (180 MiB of files take ~20 ms, which
    every other client would wait on the event loop), shielded: a load or unload
    cancelled meanwhile, or the server closing, still leaves no files behind."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(upload.cleanup)


def _check_model_name(name: str) -> None:
    """INVALID_ARG unless ``name`` can name one folder: an upload writes the model's files
    under it, so a slash or ``..`` would reach outside the server's folder for them."""
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # a lone surrogate: no file name
        size = -1
    if not name or name in (".", "..") or "/" in name or "\0" in name or size < 0:
        raise InvalidArgumentError(f"invalid model name '{name[:_NAME_MAX]}'")
    if size > _NAME_MAX:
        raise InvalidArgumentError(
            f"invalid model name '{name[:64]}...': longer than {_NAME_MAX} bytes"
        )


def _composing_models(repository: ModelRepository, name: str) -> set[str]:
    """The models the steps of ensemble ``name`` use (none for other models)."""
    if not repository.has(name):
        return set()
    models = [repository.get(name, version).model for version in repository.versions(name)]
    return {
        step.model_name
        for model in models
        if isinstance(model, EnsembleModel)
        for step in model.steps
    }


def _overridden(model: Model, config: str | None) -> Model:
    """A built-in model with the fields of a config override (max_batch_size,
    dynamic_batching, instance_group counts) applied."""
    if config is None:
        return model
    try:
        document = json.loads(config)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        changed = copy.copy(model)
        if "max_batch_size" in document:
            changed.max_batch_size = int(document["max_batch_size"])
        if "dynamic_batching" in document:
            batching = document["dynamic_batching"] or {}
            changed.dynamic_batching = DynamicBatching(
                preferred_batch_size=[int(x) for x in batching.get("preferred_batch_size", [])],
                max_queue_delay_microseconds=int(batching.get("max_queue_delay_microseconds", 0)),
            )
        if "instance_group" in document:
            changed.instance_count = sum(int(g.get("count", 1)) for g in document["instance_group"])
        changed.__post_init__()
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"the config override is not a valid ModelConfig: {exc}") from None
    return changed


def _write_files(folder: Path, files: Mapping[str, bytes | UploadedFile]) -> None:
    for path, content in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (folder / path).write_bytes(content)
        else:
            content.write_to(folder / path)


def _signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """What poll mode compares to tell that a model changed: its files' sizes and times."""
    return tuple(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    )
