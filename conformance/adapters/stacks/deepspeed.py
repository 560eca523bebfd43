"""DeepSpeed's ZeRO (deepspeed 0.19.8, stages 1-3, CPU accelerator, gloo) under the suite's OS section.

What is checked is the path a DeepSpeed training job takes: the model and the optimizer the user built
over its parameters go to ``deepspeed.initialize(model=..., optimizer=...)``, which returns the engine
and DeepSpeed's ZeRO optimizer; the job then calls the engine as its model, ``loss.backward()`` (which
DeepSpeed 0.19 supports directly for ZeRO stages 1-3) and the ZeRO optimizer's ``step()``. FQN-keyed
state of a live engine goes through DeepSpeed's public tensor-fragment API (``deepspeed.utils``:
``safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``) and, for the model,
``deepspeed.zero.GatheredParameters`` and ``DeepSpeedEngine.load_module_state_dict`` followed by the
ZeRO optimizer's ``refresh_fp32_params()`` (what ``load_checkpoint(load_module_only=True)`` does).

How the protocol maps onto DeepSpeed:

- **Strategies are ZeRO stages**: FULL_SHARD is stage 3 (parameters, gradients and optimizer state
  partitioned), SHARD_GRAD_OP stage 2 (gradients and optimizer state), NO_SHARD stage 1 (parameters and
  gradients whole on every rank as under NO_SHARD; only the optimizer state is partitioned). Stage 0,
  DeepSpeed's unsharded data parallel, would be NO_SHARD's closest match, but it refuses the
  ``loss.backward()`` the suite's train step calls ("Direct calls to tensor.backward() are not supported
  ... using ZeRO stage 0"), and the OS requirements compare FQN-keyed dicts, which do not depend on how
  the optimizer state is laid out. HYBRID_SHARD is :class:`Unsupported`: its analogue is MiCS
  (``mics_shard_size``), which partitions within groups and replicates across them, but MiCS needs
  ``deepspeed.zero.MiCS_Init`` around model construction (the suite builds the model before sharding),
  and ZeRO++ hpZ (``zero_hpz_partition_size``) only adds a secondary copy of the parameters: optimizer
  state stays partitioned over the whole world.
- **use_orig_params=False is Unsupported**: the optimizer a DeepSpeed user builds is over the module's
  own parameters; ZeRO flattens per param group, inside its optimizer, never into parameters the user
  sees. Units (``ShardingPlan.units``) have no DeepSpeed counterpart and are ignored: ZeRO has no
  wrapping units. A ``mesh`` is accepted only when it is the 1-D mesh of the whole world (ZeRO's data
  parallel group is the default one).
- **The engine is built when the optimizer is known.** ``sharding().shard()`` returns a
  :class:`DeepSpeedModel`, a module holding the user's model under ``module`` (as DeepSpeed's engine
  does); :meth:`DeepSpeedOptimStateOps.attach_optimizer` then calls ``deepspeed.initialize`` with the
  optimizer the test built over :meth:`~DeepSpeedOptimStateOps.optimizer_params` and returns DeepSpeed's
  ZeRO optimizer, which the test steps from then on (the protocol's optional ``attach_optimizer``: the
  suite attaches every optimizer it builds over a sharded model). A model whose optimizer was never
  attached raises :class:`Unsupported` from its forward and from every state-dict op, so nothing passes
  on a model DeepSpeed never touched.
- **Optimizer state dicts are full only.** ZeRO's partitions are slices of each param group's flat fp32
  buffer, not ``torch.chunk`` pieces of each parameter: there is no DTensor-valued (sharded) optimizer or
  model state dict, and no per-unit flat parameter to map FQNs to (``fqn_to_param_info``). DeepSpeed
  keeps one ``step`` per param group; the full dict gives it to every FQN of the group, and a load whose
  FQNs of one group carry different steps is a ValueError naming the FQN.
- **checkpoint() is Unsupported**: ``DeepSpeedEngine.save_checkpoint``/``load_checkpoint`` save and
  restore an engine (module, ZeRO partitions, client state) in DeepSpeed's own format, not an arbitrary
  state dict into a directory, which is what ``CheckpointOps.save``/``load`` are.

DeepSpeed is imported only inside the capability methods: without it installed they raise
:class:`Unsupported` naming the import error. Install and findings: docs/stacks/deepspeed.md.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from conformance.adapters.base import Adapter, Unsupported
from conformance.fqn import canonical_fqn

if TYPE_CHECKING:
    from conformance.adapters.checkpoint import CheckpointOps
    from conformance.adapters.optim_state import OptimStateOps
    from conformance.adapters.sharding import ShardingOps, ShardingPlan

_T = TypeVar("_T")

__all__ = ["PIP_INSTALLS", "ENVIRONMENT", "DeepSpeedAdapter", "DeepSpeedModel", "DeepSpeedShardingOps", "DeepSpeedOptimStateOps"]

#: pip argument lists, run in order in a venv that already has the pinned torch and this project
PIP_INSTALLS: tuple[tuple[str, ...], ...] = (("deepspeed==0.19.8",),)
#: environment variables the suite runs this stack under. DS_ACCELERATOR=cpu: without a GPU DeepSpeed
#: would guess one and warn. TORCH_EXTENSIONS_DIR must point into the venv: every engine start-up
#: JIT-compiles ``deepspeed_shm_comm`` (about 60 s the first time), cached there instead of the home
#: directory, so that the venv carries its build and removing the venv removes it.
ENVIRONMENT: dict[str, str] = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": "{venv}/torch_extensions"}

#: ShardingPlan strategy -> ZeRO stage (module docstring: why NO_SHARD is stage 1).
ZERO_STAGES: dict[str, int] = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 1}

_NOT_ATTACHED = (
    "DeepSpeed builds its engine around the optimizer (deepspeed.initialize(model=..., optimizer=...)) and "
    "the engine then steps it; the suite built a torch.optim optimizer after sharding and never handed it "
    "over (DeepSpeedOptimStateOps.attach_optimizer(model, optimizer) was not called)"
)


def _import_deepspeed() -> Any:
    """``deepspeed``, or :class:`Unsupported` naming why it cannot be imported."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read at import: without it DeepSpeed probes for a GPU
    try:
        import deepspeed
    except ImportError as exc:
        raise Unsupported(f"deepspeed is not installed: {exc}") from exc
    return deepspeed


class DeepSpeedModel(nn.Module):
    """A model sharded by :class:`DeepSpeedShardingOps`: the user's model under ``module`` (the name
    DeepSpeed's engine gives it), the ZeRO stage, and once :meth:`DeepSpeedOptimStateOps.attach_optimizer`
    has run, the engine and its ZeRO optimizer. The engine is kept outside the module tree (it holds
    ``module`` itself), so that parameters and buffers are listed once, under ``module.``."""

    def __init__(self, module: nn.Module, stage: int) -> None:
        super().__init__()
        self.module = module
        self.zero_stage = stage
        #: set by attach_optimizer: the engine, its ZeRO optimizer, and each param group's FQNs in order
        self.ds: dict[str, Any] = {"engine": None, "optimizer": None, "group_fqns": None}

    def engine(self) -> Any:
        """The DeepSpeed engine, or :class:`Unsupported` when no optimizer was attached yet."""
        if self.ds["engine"] is None:
            raise Unsupported(_NOT_ATTACHED)
        return self.ds["engine"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The engine's forward registers the hooks that let loss.backward() reduce and partition gradients.
        return self.engine()(*args, **kwargs)


def _deepspeed_model(model: nn.Module) -> DeepSpeedModel:
    if not isinstance(model, DeepSpeedModel):
        raise Unsupported(f"{type(model).__name__} was not sharded by DeepSpeedShardingOps")
    return model


def _named_parameters(model: DeepSpeedModel) -> dict[str, nn.Parameter]:
    """Clean FQN -> parameter of the user's model (a tied parameter under its first name)."""
    return {canonical_fqn(name): param for name, param in model.module.named_parameters()}


def _full_shape(param: torch.Tensor) -> torch.Size:
    # A ZeRO-3 parameter is partitioned: its data is empty and ds_shape is the parameter's shape.
    return getattr(param, "ds_shape", param.shape)


class DeepSpeedShardingOps:
    """A ZeRO stage per strategy (:data:`ZERO_STAGES`); the engine itself is built by
    :meth:`DeepSpeedOptimStateOps.attach_optimizer`, when the optimizer exists."""

    def unsupported(self, plan: ShardingPlan) -> str | None:
        if plan.strategy == "HYBRID_SHARD":
            return ("DeepSpeed's sharding within groups and replication across them is MiCS (mics_shard_size), "
                    "which needs deepspeed.zero.MiCS_Init around model construction; ZeRO++ hpZ "
                    "(zero_hpz_partition_size) keeps optimizer state partitioned over the whole world")
        if plan.use_orig_params is False:
            return ("DeepSpeed's optimizer is built over the module's own parameters: ZeRO flattens per param "
                    "group inside its optimizer, never into flat parameters (use_orig_params=False)")
        if plan.device is not None and plan.device.type != "cpu":
            return f"this adapter runs DeepSpeed's CPU accelerator only (DS_ACCELERATOR=cpu); the plan asks for {plan.device}"
        if plan.mesh is not None:
            import torch.distributed as dist

            if plan.mesh.ndim != 1 or plan.mesh.size() != dist.get_world_size():
                return f"ZeRO's data parallel group is the default one: a mesh of shape {tuple(plan.mesh.shape)} has no equivalent"
        return None

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        """``model`` in a :class:`DeepSpeedModel` for ``plan``'s ZeRO stage. Not collective by itself: the
        collective part, ``deepspeed.initialize``, runs in ``attach_optimizer``."""
        reason = self.unsupported(plan)
        if reason:
            raise Unsupported(reason)
        _import_deepspeed()
        return DeepSpeedModel(model, ZERO_STAGES[plan.strategy])


def _config(stage: int) -> dict[str, Any]:
    return {
        # Batch sizes only feed DeepSpeed's sample counting here: the test slices the global batch itself.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # torch.optim.SGD is not on ZeRO's list of tested optimizers; any torch.optim optimizer works.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _set_distributed_environment() -> None:
    """DeepSpeed takes over an initialized default process group (``init_distributed`` short-circuits on
    it) but still reads the rank and world size from the launcher's environment variables: set them from
    the group where they are missing (the suite's ranks join with a FileStore, not env://)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise Unsupported("DeepSpeed's engine needs an initialized process group")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_SIZE", str(dist.get_world_size()))


class DeepSpeedOptimStateOps:
    """FQN-keyed model and optimizer state of a live DeepSpeed engine (full only; module docstring)."""

    def attach_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """Build the engine around ``optimizer`` (built over :meth:`optimizer_params` of ``model``) and
        return DeepSpeed's ZeRO optimizer, which the caller steps from then on (``zero_grad()``,
        ``loss.backward()`` on the model's output, ``step()``). Collective. Once per model: DeepSpeed's
        engine owns one optimizer."""
        ds_model = _deepspeed_model(model)
        if ds_model.ds["engine"] is not None:
            raise Unsupported("DeepSpeed's engine owns one optimizer, handed to deepspeed.initialize: a second "
                              "optimizer over the same model cannot be attached")
        deepspeed = _import_deepspeed()
        _set_distributed_environment()
        names = {id(p): fqn for fqn, p in reversed(list(_named_parameters(ds_model).items()))}
        group_fqns = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=ds_model.module, optimizer=optimizer, config=_config(ds_model.zero_stage), dist_init_required=False
        )
        ds_model.ds.update(engine=engine, optimizer=ds_optimizer, group_fqns=group_fqns)
        return ds_optimizer

    # -- parameters ---------------------------------------------------------------------------------

    def optimizer_params(self, model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
        """The user's model's parameters under their clean FQNs: what a DeepSpeed user builds the
        optimizer over before ``deepspeed.initialize`` (ZeRO-3 partitions them in place afterwards)."""
        return [((fqn,), param) for fqn, param in _named_parameters(_deepspeed_model(model)).items()]

    def fqn_to_param_info(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        raise Unsupported("ZeRO has no per-unit flat parameters: it flattens each param group inside its optimizer")

    # -- optimizer state ------------------------------------------------------------------------------

    def _live(self, model: nn.Module, optim: Any) -> tuple[DeepSpeedModel, Any]:
        ds_model = _deepspeed_model(model)
        ds_model.engine()
        if optim is not ds_model.ds["optimizer"]:
            raise Unsupported("the optimizer is not the ZeRO optimizer attach_optimizer returned for this model")
        return ds_model, optim

    @staticmethod
    def _group_state(ds_optim: Any, index: int) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any], list[dict[str, Any]]]:
        """Param group ``index`` of ZeRO's inner torch optimizer, its first flat fp32 partition, that
        partition's state, and the states of all its partitions. ZeRO hands its inner optimizer flat
        partitions only: one per param group in stages 1-2 (``single_partition_of_fp32_groups``), one
        per sub-group in stage 3 (``fp32_partitioned_groups_flat``, swapped into the group for each
        step), so the group itself is no way to them. The state's names and scalar entries are read
        here; positional values only through ``safe_get/set_full_optimizer_state``."""
        if hasattr(ds_optim, "fp32_partitioned_groups_flat"):
            flats = [f for s, f in enumerate(ds_optim.fp32_partitioned_groups_flat) if ds_optim.sub_group_to_group_id[s] == index]
        else:
            flats = [ds_optim.single_partition_of_fp32_groups[index]]
        states = [ds_optim.optimizer.state[f] for f in flats]  # a defaultdict: a state for each
        return ds_optim.optimizer.param_groups[index], flats[0], states[0], states

    def optim_state_dict(
        self, model: nn.Module, optim: Any, *, rank0_only: bool = False, cpu_offload: bool = False, sharded: bool = False
    ) -> dict[str, Any]:
        """The full FQN-keyed optimizer state dict: each positional state assembled by
        ``safe_get_full_optimizer_state`` (collective), scalar state (``step``) of the FQN's group as is."""
        if sharded:
            raise Unsupported("ZeRO's optimizer state partitions are slices of each param group's flat fp32 buffer, "
                              "not DTensors: DeepSpeed has no sharded FQN-keyed optimizer state dict")
        from deepspeed.utils import safe_get_full_optimizer_state

        ds_model, ds_optim = self._live(model, optim)
        params = _named_parameters(ds_model)
        state: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        for index, fqns in enumerate(ds_model.ds["group_fqns"]):
            group, flat, flat_state, _ = self._group_state(ds_optim, index)
            for fqn in fqns:
                if not flat_state:
                    continue
                entry: dict[str, Any] = {}
                for name, value in flat_state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == flat.shape:
                        entry[name] = safe_get_full_optimizer_state(params[fqn], name).detach().clone()
                    else:
                        entry[name] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                state[fqn] = entry
            groups.append({**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}, "params": list(fqns)})
        import torch.distributed as dist

        if rank0_only and dist.get_rank() != 0:
            return {}
        if cpu_offload:
            state = {f: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in e.items()} for f, e in state.items()}
        return {"state": state, "param_groups": groups}

    def load_optim_state_dict(self, model: nn.Module, optim: Any, osd: dict[str, Any]) -> None:
        """Load a full FQN-keyed optimizer state dict: every check first, agreed by every rank (unknown
        FQN, group mismatch, shapes, one step per group), so that a bad dict changes nothing; then
        hyperparameters per group, positional state by ``safe_set_full_optimizer_state``, scalar state
        into the group's flat partitions' state. DeepSpeed has no FQN-keyed load and its per-parameter
        ``safe_set_full_optimizer_state`` checks nothing (a value with enough elements loads whatever its
        shape: docs/stacks/deepspeed.md), so the checks are this adapter's. Collective."""
        from torch.distributed.tensor import DTensor

        if any(isinstance(v, DTensor) for entry in osd.get("state", {}).values() for v in entry.values()):
            raise Unsupported("DeepSpeed has no sharded (DTensor-valued) optimizer state dict to load")
        from deepspeed.utils import safe_set_full_optimizer_state

        ds_model, ds_optim = self._live(model, optim)
        params = _named_parameters(ds_model)
        live_groups: list[list[str]] = ds_model.ds["group_fqns"]
        homes: list[int] = _agreed(lambda: self._check_osd(ds_optim, params, live_groups, osd))
        for index, fqns in enumerate(live_groups):
            group, flat, _, flat_states = self._group_state(ds_optim, index)
            group.update({k: copy.deepcopy(v) for k, v in osd["param_groups"][homes[index]].items() if k != "params"})
            for fqn in fqns:
                for name, value in osd["state"].get(fqn, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        safe_set_full_optimizer_state(params[fqn], value.detach().to(flat.dtype), name)
                    else:  # one per param group (checked), in each of its partitions' states
                        for flat_state in flat_states:
                            flat_state[name] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)

    def _check_osd(self, ds_optim: Any, params: dict[str, nn.Parameter], live_groups: list[list[str]], osd: dict[str, Any]) -> list[int]:
        """ValueError naming the FQN for a dict that does not fit; else, per live param group, the index
        of the saved group that lists its FQNs. Changes nothing."""
        known = {fqn for fqns in live_groups for fqn in fqns}
        for fqn in osd["state"]:
            if fqn not in known:
                raise ValueError(f"optimizer state dict: state for {fqn!r}, which the optimizer does not hold")
        saved_group_of: dict[str, int] = {}
        for index, group in enumerate(osd["param_groups"]):
            for fqn in group["params"]:
                if fqn not in known:
                    raise ValueError(f"optimizer state dict: param group {index} lists {fqn!r}, which the optimizer does not hold")
                saved_group_of[fqn] = index
        homes: list[int] = []
        for fqns in live_groups:
            for fqn in fqns:
                if fqn not in saved_group_of:
                    raise ValueError(f"optimizer state dict: no saved param group lists {fqn!r}")
                if saved_group_of[fqn] != saved_group_of[fqns[0]]:
                    raise ValueError(f"optimizer state dict: {fqn!r} is in another saved param group than {fqns[0]!r}, "
                                     "but in one group with it in the optimizer")
            homes.append(saved_group_of[fqns[0]])
        for index, fqns in enumerate(live_groups):
            _, _, flat_state, _ = self._group_state(ds_optim, index)
            scalars: dict[str, Any] = {}
            for fqn in fqns:
                for name, value in osd["state"].get(fqn, {}).items():
                    positional = isinstance(value, torch.Tensor) and value.dim() > 0
                    if positional and tuple(value.shape) != tuple(_full_shape(params[fqn])):
                        raise ValueError(f"optimizer state dict: state[{fqn!r}][{name!r}] has shape {tuple(value.shape)}, "
                                         f"the parameter {tuple(_full_shape(params[fqn]))}")
                    if positional and name not in flat_state:
                        raise ValueError(f"optimizer state dict: state[{fqn!r}][{name!r}] is a positional state the "
                                         "ZeRO optimizer does not keep (it links only the state its optimizer made)")
                    if not positional and name in scalars and not _same(scalars[name], value):
                        raise ValueError(f"optimizer state dict: state[{fqn!r}][{name!r}] differs from another FQN's of its "
                                         "param group; DeepSpeed keeps one per param group")
                    if not positional:
                        scalars[name] = value
        return homes

    # -- model state ------------------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The user's model's state dict, ZeRO-3 parameters gathered (``GatheredParameters``). Collective."""
        deepspeed = _import_deepspeed()
        ds_model = _deepspeed_model(model)
        ds_model.engine()
        with deepspeed.zero.GatheredParameters(list(ds_model.module.parameters())):
            return {canonical_fqn(k): v.detach().clone() for k, v in ds_model.module.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """``DeepSpeedEngine.load_module_state_dict`` (ZeRO-3 parameters fetched), then the ZeRO
        optimizer's ``refresh_fp32_params()``; keys and shapes are checked first. Collective."""
        ds_model = _deepspeed_model(model)
        engine = ds_model.engine()
        own = {canonical_fqn(k): v for k, v in ds_model.module.state_dict(keep_vars=True).items()}

        def check() -> None:
            # Before DeepSpeed's load, agreed by every rank: it loads inside GatheredParameters, whose
            # collectives a rank raising alone would leave (docs/stacks/deepspeed.md), and torch's
            # load_state_dict copies what fits before it raises.
            for key in own:
                if key not in state_dict:
                    raise ValueError(f"model state dict: missing key {key!r}")
            for key, value in state_dict.items():
                if key not in own:
                    raise ValueError(f"model state dict: unexpected key {key!r}")
                if tuple(value.shape) != tuple(_full_shape(own[key])):
                    raise ValueError(f"model state dict: {key!r} has shape {tuple(value.shape)}, the model {tuple(_full_shape(own[key]))}")

        _agreed(check)
        engine.load_module_state_dict({"module": dict(state_dict)}, strict=True, fetch_z3_params=True)
        ds_model.ds["optimizer"].refresh_fp32_params()

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        raise Unsupported("ZeRO-3 partitions are slices of each param group's flat buffer, not DTensors: "
                          "DeepSpeed has no sharded (DTensor-valued) model state dict")

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        raise Unsupported("DeepSpeed has no sharded (DTensor-valued) model state dict to load")

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        return model.state_dict()


def _agreed(check: Callable[[], _T]) -> _T:
    """Run ``check`` (the adapter's validation, which changes nothing) on every rank and raise its
    ValueError on every rank when it failed on any (the first failing rank's): a dict bad on one rank
    only must not leave the others going on into DeepSpeed's collectives. Collective."""
    import torch.distributed as dist

    result: Any = None
    try:
        result = check()
        mine = None
    except ValueError as exc:
        mine = str(exc)
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = next((m for m in every if m is not None), None)
    if first is not None:
        raise ValueError(first)
    return result


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)


class DeepSpeedAdapter(Adapter):
    """DeepSpeed ZeRO 1-3 on the CPU accelerator: sharding and full FQN-keyed optimizer state."""

    name = "deepspeed"
    xfails_file = "../../xfails/deepspeed.txt"
    checkpoint_format = "deepspeed"
    needs_process_group = True
    devices = ("cpu",)

    def sharding(self) -> ShardingOps:
        _import_deepspeed()
        return DeepSpeedShardingOps()

    def optim_state(self) -> OptimStateOps:
        _import_deepspeed()
        return DeepSpeedOptimStateOps()

    def checkpoint(self) -> CheckpointOps:
        raise Unsupported("DeepSpeedEngine.save_checkpoint/load_checkpoint save and restore an engine (module, ZeRO "
                          "partitions, client state) in DeepSpeed's own layout, not an arbitrary state dict into a "
                          "directory (CheckpointOps.save/load)")
