"""torchtitan's ``CheckpointManager`` (torchtitan 0.3.0) under the suite's ML and AS sections.

What is checked is the checkpoint path a torchtitan training job takes: ``CheckpointManager.save`` and
``CheckpointManager.load`` (``torchtitan.components.checkpoint``) with ``async_mode="disabled"`` for the
``checkpoint()`` ops and ``async_mode="async"`` for ``async_checkpoint()``; the model is sharded by
``fully_shard`` (what torchtitan's ``parallelize`` functions apply; the torch-fsdp2 adapter's sharding),
and the sharded state dicts are those torchtitan's ``ModelWrapper`` and ``OptimizersContainer`` give DCP.

How the protocol maps onto torchtitan:

- **checkpoint_id is the manager's checkpoint folder**, and each save is the next step in it: the
  manager is built with ``folder=checkpoint_id`` and a save writes ``<checkpoint_id>/step-<N>``, N one
  past the highest ``step-<N>`` folder already there (agreed by every rank with an all-reduce before
  any rank writes: a trainer passes its training step, which its ranks agree on by construction). A
  load is ``CheckpointManager.load(step=-1)``, what a resumed job calls: the highest step whose folder
  holds a ``.metadata``, or, where ``checkpoint_id`` holds no step folder but DCP's files of its own
  (another implementation's checkpoint), that checkpoint through ``initial_load_path`` (every state,
  ``initial_load_model_only=False``), as a job starting from another tool's checkpoint does. The DCP
  files torchtitan writes are therefore one level below ``checkpoint_id``, in the step folder (the
  suite's file-level checks find them there: ``conformance.dcp_files.dcp_directory``);
  ``CheckpointManager.load`` returning False (no step folder with a ``.metadata``: torchtitan's
  "fresh start") is raised here as ``FileNotFoundError``, since the protocol's ``load`` has no "nothing
  loaded" answer.
- **The state dict is the manager's ``states``**: its top-level entries are handed to the manager as
  ``states=`` (a shallow copy: the manager adds its own entries to the dict it is given). The manager
  saves ``states`` beside four components of its own, ``model`` (its ``ModelWrapper`` of
  ``model_parts``, saved flattened at the top level), ``optimizer``, ``lr_scheduler`` and ``dataloader``.
  A state dict's top-level ``optimizer``, ``lr_scheduler`` or ``dataloader`` entry is passed as that
  constructor argument (the manager stores it under the same key, unchanged); one it lacks is passed as
  None, which the manager saves as a ``None`` entry, and is excluded from loading
  (``exclude_from_loading``), as a job without that component configures it. A top-level ``model``
  entry, a mapping of tensors, is the model: the adapter hands the manager one model part whose state
  dict is exactly those tensors (the same objects; registered as parameters or buffers of a module tree
  under a child named ``model``, so its keys are ``model.<key>``), which the manager saves through its
  ``ModelWrapper`` and loads with ``model.load_state_dict(strict=False)``; a non-tensor value in it has no
  equivalent (:class:`Unsupported`).
- **Options without an equivalent** raise :class:`Unsupported` naming them: ``strict=False`` and
  ``allow_unexpected=False`` of ``load`` (the manager calls ``dcp.load`` with its default planner), a
  ``process_group`` other than the default group's ranks (the manager saves and loads on the default
  group; in async mode on a gloo group of its own over every rank).
- **Async saves** (``async_mode="async"``): ``dcp.async_save`` with its thread executor on the manager's
  own gloo group, so the executor is ``"thread"``. ``"process"`` is ``async_mode="async_with_pinned_mem"``
  (DCP's process executor with a pinned, shared-memory ``DefaultStager``), declared only where an
  accelerator is available: on a CPU-only machine DCP's stager refuses it ("Non-blocking copy requires
  that the current accelerator is available"). A second save while one is in flight waits for it:
  ``CheckpointManager.save`` calls ``maybe_wait_for_saving()`` first (``concurrent_saves = "wait"``),
  which holds for saves through one manager, and a job has one: one manager per process, default group
  and mode is kept in a module-level cache (:data:`_ASYNC_MANAGERS`, emptied with the default group),
  its ``folder`` set to each call's ``checkpoint_id`` and its ``states`` dict refilled with each call's
  entries, as a trainer's states change between saves. ``staging_completion`` is resolved when the call
  returns (the ``async`` mode stages before ``dcp.async_save`` returns); ``upload_completion`` is the
  manager's ``save_future``. ``shutdown()`` waits for the save in flight and calls ``close()``, what a
  trainer does at the end, and drops the manager (the next save builds a new one).
- **Sharded state dicts**: the model's is ``ModelWrapper([model]).state_dict()`` (``model.state_dict()``,
  DTensor-valued under ``fully_shard``), loaded by ``ModelWrapper.load_state_dict`` (``strict=False``, as
  torchtitan does); the optimizer's is ``OptimizersContainer.state_dict``'s per-optimizer path,
  ``init_optim_state`` then ``get_flat_optim_state_dict`` (flat keys ``state.<fqn>.<name>`` and
  ``param_groups.<fqn>.<key>``), loaded by ``init_optim_state`` then ``load_flat_optim_state_dict``.
  torchtitan builds its optimizers from ``(name, parameter)`` pairs, so their param groups carry
  ``param_names``; the suite's optimizers are built from parameters, so each group is lent the names
  of its parameters (from ``model.named_parameters()``) for the call and they are taken back after.

torchtitan is imported only inside the capability methods: without it installed they raise
:class:`Unsupported` naming the import error. Install and findings: docs/stacks/torchtitan.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from conformance.adapters.base import Adapter, Unsupported
from conformance.rank_context import per_group_cache

if TYPE_CHECKING:
    from conformance.adapters.async_checkpoint import AsyncCheckpointOps, AsyncSave, Executor
    from conformance.adapters.checkpoint import CheckpointOps
    from conformance.adapters.flat_param import FlatParamOps
    from conformance.adapters.optim_state import OptimStateOps
    from conformance.adapters.sharding import ShardingOps
    from conformance.adapters.state_dict import StateDictOps

__all__ = ["PIP_INSTALLS", "ENVIRONMENT", "TorchtitanAdapter", "TorchtitanCheckpointOps", "TorchtitanAsyncCheckpointOps"]

#: pip argument lists, run in order in a venv that already has the pinned torch and this project
PIP_INSTALLS: tuple[tuple[str, ...], ...] = (("torchtitan==0.3.0",),)
#: environment variables the suite runs this stack under
ENVIRONMENT: dict[str, str] = {}

#: Top-level keys the manager fills from constructor arguments other than ``states``.
_COMPONENTS = ("optimizer", "lr_scheduler", "dataloader")
#: The top-level key of the manager's ``ModelWrapper`` (saved flattened, so no state dict entry maps to it).
_MODEL = "model"
_STEP = re.compile(r"step-(\d+)")


def _import_checkpoint() -> Any:
    """``torchtitan.components.checkpoint``, or :class:`Unsupported` naming why it does not import."""
    try:
        from torchtitan.components import checkpoint
    except ImportError as exc:
        raise Unsupported(f"torchtitan is not installed: {exc}") from exc
    return checkpoint


def _import_optim_utils() -> Any:
    try:
        from torchtitan.components.optimizer import utils
    except ImportError as exc:
        raise Unsupported(f"torchtitan is not installed: {exc}") from exc
    return utils


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _check_group(process_group: Any, *, mode: str) -> None:
    """Unsupported unless ``process_group`` is None or spans the default group's ranks: the manager takes no
    process group (it saves on the default group; in async mode on a gloo group of its own over every rank)."""
    if process_group is None or not _dist_ready():
        return
    import torch.distributed as dist

    if process_group is dist.group.WORLD or dist.get_world_size(process_group) == dist.get_world_size():
        return
    raise Unsupported(f"CheckpointManager ({mode}) takes no process group: it runs on every rank of the default group, "
                      "not on a subgroup")


class _ModelOf(nn.Module):
    """A model whose state dict is a given mapping of tensors: each tensor registered as it is (the same
    object), a Parameter as a parameter, any other tensor as a persistent buffer, a nested mapping as a
    child module. Under a root with one child named ``model`` its state dict's keys are ``model.<key>``."""

    def __init__(self, values: Mapping[str, Any], where: str) -> None:
        super().__init__()
        for key, value in values.items():
            name = f"{where}.{key}"
            if not isinstance(key, str) or not key or "." in key or hasattr(nn.Module, key):
                raise Unsupported(f"a top-level 'model' entry is handed to CheckpointManager as a model part, and "
                                  f"{name!r} cannot be a module attribute name")
            if isinstance(value, nn.Parameter):
                self.register_parameter(key, value)
            elif isinstance(value, torch.Tensor):
                self.register_buffer(key, value)
            elif isinstance(value, Mapping):
                self.add_module(key, _ModelOf(value, name))
            else:
                raise Unsupported(f"a top-level 'model' entry is handed to CheckpointManager as a model part, whose "
                                  f"state dict holds tensors only: {name} is a {type(value).__name__}")


def _model_parts(state_dict: Mapping[str, Any]) -> list[nn.Module]:
    """The manager's ``model_parts`` for a state dict: none, or for a top-level ``model`` mapping of tensors
    one model whose state dict holds exactly those tensors under ``model.<key>``."""
    if _MODEL not in state_dict:
        return []
    entry = state_dict[_MODEL]
    if not isinstance(entry, Mapping):
        raise Unsupported("CheckpointManager reserves the top-level key 'model' for its ModelWrapper of model_parts: "
                          f"a top-level 'model' entry that is a {type(entry).__name__}, not a mapping of tensors, has "
                          "no equivalent")
    root = nn.Module()
    root.add_module(_MODEL, _ModelOf(entry, _MODEL))
    return [root]


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[nn.Module]]:
    """``(states, components, model_parts)``: the entries handed over as ``states=``, those passed as the
    manager's ``optimizers=``/``lr_schedulers=``/``dataloader=`` arguments, and the model of a top-level
    ``model`` entry (:func:`_model_parts`)."""
    model_parts = _model_parts(state_dict)
    states = {k: v for k, v in state_dict.items() if k not in _COMPONENTS and k != _MODEL}
    components = {k: state_dict[k] for k in _COMPONENTS if k in state_dict}
    return states, components, model_parts


def _local_last_step(folder: str) -> int:
    """The highest N of a ``step-N`` entry of ``folder`` (a step folder with or without ``.metadata``: a
    save that did not finish keeps its number), or 0."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    steps = [int(m.group(1)) for m in map(_STEP.fullmatch, names) if m]
    return max(steps, default=0)


def _next_step(folder: str, process_group: Any) -> int:
    """The step the next save into ``folder`` gets: one past the highest there, the same on every rank (an
    all-reduce of what each rank listed, before any rank writes)."""
    last = _local_last_step(folder)
    if _dist_ready():
        import torch.distributed as dist

        agreed = torch.tensor([last], dtype=torch.int64)
        if dist.get_backend(process_group) == "nccl":
            agreed = agreed.cuda()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
        last = int(agreed.item())
    return last + 1


def _manager(checkpoint: Any, folder: str, states: dict[str, Any], components: dict[str, Any],
             model_parts: list[nn.Module], mode: str, initial_load_path: str | None = None) -> Any:
    """A ``CheckpointManager`` over ``folder`` (``keep_latest_k=0``: no purge thread, every step kept;
    ``interval=1``: every step saves), the components the state dict lacks passed as None and excluded from
    loading; ``initial_load_path``: the DCP checkpoint a load without a step folder reads (every state,
    not the model only), as a job starting from another tool's checkpoint configures it."""
    config = checkpoint.CheckpointManager.Config(
        enable=True, folder=folder, interval=1, async_mode=mode, keep_latest_k=0, initial_load_model_only=False,
        exclude_from_loading=[k for k in _COMPONENTS if k not in components], initial_load_path=initial_load_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.CheckpointManager(
            config, dataloader=components.get("dataloader"), model_parts=model_parts,
            optimizers=components.get("optimizer"), lr_schedulers=components.get("lr_scheduler"),
            states=dict(states), sd_adapter=None, base_folder="",
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every save without a process group and on overwrites; torchtitan logs each step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Lend each param group of ``optimizer`` the ``param_names`` torchtitan's flat optimizer state dicts key
    by (an optimizer built from ``(name, parameter)`` pairs has them; the suite's are built from parameters),
    and take them back after. A group that already has names keeps them."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied parameter by its first name, as torchtitan's named_parameters() lists it
    lent = [i for i, group in enumerate(optimizer.param_groups) if "param_names" not in group]
    for i in lent:
        group = optimizer.param_groups[i]
        group["param_names"] = [names[id(p)] for p in group["params"]]
    try:
        yield
    finally:
        # By position: Optimizer.load_state_dict replaces the group dicts and carries param_names over.
        for i in lent:
            if i < len(optimizer.param_groups):
                optimizer.param_groups[i].pop("param_names", None)


class TorchtitanCheckpointOps:
    """``CheckpointManager`` with ``async_mode="disabled"``: ``checkpoint_id`` is its folder, a save the next
    ``step-N`` in it, a load ``load(step=-1)`` (the module docstring has the whole mapping)."""

    name = "torchtitan"

    def save(self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None) -> None:
        """Save ``state_dict`` as the next step of the folder ``checkpoint_id``; collective."""
        checkpoint = _import_checkpoint()
        _check_group(process_group, mode="disabled")
        states, components, model_parts = _split(state_dict)
        folder = os.fspath(checkpoint_id)
        step = _next_step(folder, process_group)
        manager = _manager(checkpoint, folder, states, components, model_parts, "disabled")
        try:
            with _quiet():
                manager.save(step)
        finally:
            manager.close()

    def load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | os.PathLike[str],
        *,
        process_group: Any = None,
        strict: bool = True,
        allow_unexpected: bool = True,
    ) -> None:
        """Load the latest step of the folder ``checkpoint_id`` into ``state_dict`` (tensors in place; the
        manager's ``states`` are a copy of its top level), or, with no step folder, the DCP checkpoint at
        ``checkpoint_id`` itself (``initial_load_path``); FileNotFoundError when there is neither."""
        checkpoint = _import_checkpoint()
        if not strict:
            raise Unsupported("CheckpointManager.load has no non-strict option (strict=False): it calls dcp.load with "
                              "the default planner; exclude_from_loading leaves out whole top-level entries only")
        if not allow_unexpected:
            raise Unsupported("CheckpointManager.load has no option to reject keys of the checkpoint the state dict "
                              "does not ask for (allow_unexpected=False)")
        _check_group(process_group, mode="disabled")
        states, components, model_parts = _split(state_dict)
        folder = os.fspath(checkpoint_id)
        # A checkpoint another implementation wrote at checkpoint_id (DCP's files there, no step folder) is
        # what a torchtitan job starts from with initial_load_path; a step folder, when there is one, wins.
        initial = os.path.abspath(folder) if os.path.exists(os.path.join(folder, ".metadata")) else None
        manager = _manager(checkpoint, folder, states, components, model_parts, "disabled", initial)
        try:
            with _quiet():
                loaded = manager.load(step=-1)
        finally:
            manager.close()
        if not loaded:
            raise FileNotFoundError(f"CheckpointManager.load found no checkpoint in {folder}: no step-N folder with "
                                    "a .metadata (torchtitan's fresh start)")

    def get_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """``ModelWrapper([model]).state_dict()`` and the flat FQN-keyed optimizer state dict of
        ``OptimizersContainer.state_dict`` (``init_optim_state``, then ``get_flat_optim_state_dict``)."""
        checkpoint = _import_checkpoint()
        utils = _import_optim_utils()
        model_sd = checkpoint.ModelWrapper([model]).state_dict()
        with _param_names(model, optimizer):
            utils.init_optim_state(optimizer)
            optim_sd = utils.get_flat_optim_state_dict(optimizer)
        return dict(model_sd), optim_sd

    def set_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        """``ModelWrapper.load_state_dict`` (``strict=False``) and ``OptimizersContainer.load_state_dict``'s
        per-optimizer path (``init_optim_state``, then ``load_flat_optim_state_dict``)."""
        checkpoint = _import_checkpoint()
        utils = _import_optim_utils()
        checkpoint.ModelWrapper([model]).load_state_dict(model_sd)
        with _param_names(model, optimizer):
            utils.init_optim_state(optimizer)
            utils.load_flat_optim_state_dict(optimizer, optim_sd)


@dataclass(frozen=True)
class _Response:
    staging_completion: Future[Any]
    upload_completion: Future[Any]


#: One async CheckpointManager per (default process group, mode) of this process: a job's manager, so that
#: a second save waits for the first (CheckpointManager.save's maybe_wait_for_saving) and the manager's
#: gloo group is made once. Emptied when the default group is replaced; shutdown() drops its entries.
_ASYNC_MANAGERS: dict[str, Any] = per_group_cache()
#: The top-level keys each cached manager's ``states`` holds for the last call (replaced by the next).
_ASYNC_KEYS: dict[str, set[str]] = per_group_cache()

_MODES: dict[str, str] = {"thread": "async", "process": "async_with_pinned_mem"}


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


class TorchtitanAsyncCheckpointOps:
    """``CheckpointManager`` with ``async_mode="async"`` (executor ``thread``) and, where an accelerator is
    available, ``"async_with_pinned_mem"`` (executor ``process``); a second save waits for the first."""

    name = "torchtitan"
    concurrent_saves: Literal["wait", "refuse"] = "wait"

    def __init__(self) -> None:
        # async_with_pinned_mem stages with non-blocking copies into pinned memory: DCP refuses it without
        # an accelerator, so the process executor is declared only where one is available.
        self.executors: tuple[str, ...] = ("thread", "process") if _accelerator_available() else ("thread",)

    def async_save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None,
        executor: Executor = "thread",
    ) -> AsyncSave:
        """``CheckpointManager.save`` of the next step of ``checkpoint_id`` in the executor's mode; collective."""
        checkpoint = _import_checkpoint()
        if executor not in self.executors:
            raise Unsupported(f"no {executor} executor for async saves (provided: {', '.join(self.executors)}; "
                              "'process' is async_mode='async_with_pinned_mem', which needs an accelerator)")
        if not _dist_ready():
            raise Unsupported("CheckpointManager's async modes make a gloo group in its __init__ "
                              "(dist.new_group): they need an initialized default process group")
        mode = _MODES[executor]
        _check_group(process_group, mode=mode)
        states, components, model_parts = _split(state_dict)
        folder = os.fspath(checkpoint_id)
        step = _next_step(folder, process_group)
        manager = _ASYNC_MANAGERS.get(mode)
        if manager is None:
            manager = _manager(checkpoint, folder, {}, {}, [], mode)
            _ASYNC_MANAGERS[mode] = manager
        # The job's manager saves what its states hold now: this call's entries replace the last call's.
        manager.folder = folder
        for key in _ASYNC_KEYS.pop(mode, set()):
            manager.states.pop(key, None)
        manager.states.update(states)
        for key in _COMPONENTS:
            manager.states[key] = components.get(key)
        # A fresh ModelWrapper: one kept from the last call would copy this call's values into the last
        # call's tensors (its state_dict() refreshes its cache in place).
        manager.states[_MODEL] = checkpoint.ModelWrapper(model_parts)
        _ASYNC_KEYS[mode] = set(states)
        with _quiet():
            manager.save(step)
        staged: Future[Any] = Future()
        staging = getattr(manager, "staging_future", None)
        if staging is None:
            staged.set_result(None)  # the async mode stages before dcp.async_save returns
        else:
            staged = staging
        upload = manager.save_future
        if upload is None:  # pragma: no cover - the async modes always leave one
            upload = Future()
            upload.set_result(None)
        return _Response(staged, upload)

    def shutdown(self) -> None:
        """Wait for the save in flight (its error is the save's, already on its future) and ``close()`` each
        manager of this process, as a trainer does when it ends; the next save builds a new one."""
        for mode in list(_ASYNC_MANAGERS):
            manager = _ASYNC_MANAGERS.pop(mode)
            _ASYNC_KEYS.pop(mode, None)
            with contextlib.suppress(BaseException):
                manager.maybe_wait_for_saving()
            manager.close()


class TorchtitanAdapter(Adapter):
    """torchtitan's ``CheckpointManager`` (sync and async modes) on ``fully_shard`` models."""

    name = "torchtitan"
    xfails_file = "../../xfails/torchtitan.txt"
    checkpoint_format = "dcp"  # each step folder is a DCP checkpoint (.metadata and __<rank>_0.distcp)
    needs_process_group = False  # the disabled mode runs dcp.save/load, which work without a group
    devices = ("cpu", "cuda")

    def flat_param(self) -> FlatParamOps:
        raise Unsupported("torchtitan shards with fully_shard (per-parameter DTensors); it has no FlatParameter")

    def state_dict(self) -> StateDictOps:
        raise Unsupported("torchtitan has no submodule state_dict API; its model state is ModelWrapper's, checked "
                          "through checkpoint()")

    def optim_state(self) -> OptimStateOps:
        raise Unsupported("torchtitan's optimizer state is OptimizersContainer's flat FQN-keyed dict, checked through "
                          "checkpoint(); it has no FSDP optim_state_dict API")

    def checkpoint(self) -> CheckpointOps:
        _import_checkpoint()
        return TorchtitanCheckpointOps()

    def async_checkpoint(self) -> AsyncCheckpointOps:
        _import_checkpoint()
        return TorchtitanAsyncCheckpointOps()

    def sharding(self) -> ShardingOps:
        # torchtitan's parallelize functions apply fully_shard: the torch-fsdp2 adapter's sharding is theirs.
        from conformance.adapters.sharding import TorchFSDP2ShardingOps

        return TorchFSDP2ShardingOps()
