"""The defects users reported, put back into the reference one at a time: the suite must fail on each.

    python -m tools.reported_defects [--list] [--defect KEY ...] [--world-size 1,2]

Each defect is a small edit of ``reference/`` that reintroduces what a report describes (a staging
buffer refilled while the write still reads it, completion before publication, a swallowed background
error, ...). It is applied to a scratch copy of the checkout (the working tree is never written), and
the tests named for it (a ``-k`` expression over one conformance file) run there against ``--impl
reference`` (with the fast paths off, ``SDC_REFERENCE_FAST_PATHS=0``, for a defect of the plain path).
A defect is *caught* when they fail. The exit status is 1 if any defect survives, so this is also a check of the suite, run by hand (a few
minutes) and not by ``make test``. Automatic mutants of the same modules: ``make mutation``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Defect:
    key: str
    report: str  #: the report(s) it answers, as SPEC's table names them
    file: str  #: relative to the checkout
    old: str  #: text of ``file`` replaced (exactly once)
    new: str
    tests: str  #: a pytest ``-k`` expression over ``test_file``
    test_file: str = "conformance/test_async_save.py"  #: relative to the checkout
    world_size: str = ""  #: the world sizes its tests need, when not those of ``--world-size``
    plain_path: bool = False  #: a defect of the plain path: its tests run with the fast paths off


DEFECTS: tuple[Defect, ...] = (
    Defect(
        "stateless-parameter-takes-the-flat-step", "the reference's own, fixed at ba37637 (SPEC OS-24)",
        "reference/fsdp/optim_keys.py",
        "                if len(entries) > 1:\n", "                if len(present) > 1:\n",
        "test_a_parameter_without_state_into_flat_parameters and adamw", test_file="conformance/test_optim_state.py",
    ),
    Defect(
        "materialized-momentum-product-one-step-on", "the reference's own (as torch's _init_optim_state), fixed at b67f59e (SPEC SD-20)",
        "reference/state_dict/optim_fqn.py",
        '_STEP_PRODUCTS = ("mu_product",)\n', "_STEP_PRODUCTS: tuple[str, ...] = ()\n",
        "test_get_never_changes_the_optimizers_future and nadam", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "materialized-state-starts-from-a-zero-lr", "the reference's own (as torch's _init_optim_state), fixed at b78da8b (SPEC SD-20)",
        "reference/state_dict/optim_fqn.py",
        '_INERT_HYPERPARAMETERS = ("weight_decay", "lambd")\n', '_INERT_HYPERPARAMETERS = ("lr", "weight_decay")\n',
        "test_get_never_changes_the_optimizers_future and (rprop or asgd)", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "caught-state-dict-taken-for-an-enclosing-wrapper", "the reference's own, fixed at 83b1358 (SPEC FP-12)",
        "reference/flat_param/prefix_hooks.py",
        "    if frames and _encloses(frames[-1], module, prefix):\n", "    if frames and prefix.startswith(frames[-1].inner):\n",
        "raised_inside_another", test_file="conformance/test_flat_param.py",
    ),
    Defect(
        "uniform-cast-misses-the-plan-cache-key", "pytorch/pytorch PR #147343, PR #148577 (SPEC ML-30)",
        "reference/checkpoint/plan_cache.py",
        "    return _digest((packed, list(paths.items())))\n", "    return _digest((packed[0], list(paths.items())))\n",
        "changes_one_property", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "stopped-writer-never-killed", "the reference's own, fixed at db3507c (SPEC AS-7)",
        "reference/checkpoint/writer_process.py",
        "        if self.process.is_alive():\n            self.process.kill()\n            self.process.join()\n", "",
        "does_not_answer", world_size="2",
    ),
    Defect(
        "job-group-named-after-a-subgroup", "the reference's own, fixed at f8d351f (SPEC AS-8)",
        "reference/checkpoint/async_save.py",
        "            group = _unregistered_gloo_group(ranks)\n",
        "            group = dist.new_group(list(ranks), backend=\"gloo\", timeout=ASYNC_GROUP_TIMEOUT, use_local_synchronization=True)\n",
        "over_a_subgroup_involves and reference", world_size="2",
    ),
    Defect(
        "overlapping-subgroups-named-by-counts", "the reference's own, fixed at 9069843 (SPEC AS-8)",
        "reference/checkpoint/async_save.py",
        "            group = _unregistered_gloo_group(ranks)\n",
        "            whole_job = len(ranks) == dist.get_world_size()\n"
        "            group = dist.new_group(list(ranks), backend=\"gloo\", timeout=ASYNC_GROUP_TIMEOUT, use_local_synchronization=not whole_job)\n",
        "overlapping_subgroups and reference", world_size="3",
    ),
    Defect(
        "empty-bytes-refused-beside-torch-types", "the reference's own, fixed at 6f265a5 (SPEC ML-1)",
        "reference/checkpoint/records.py",
        '_ALSO_ALLOWED: list[Any] = [io.BytesIO, (_bytes_called_empty, "builtins.bytes")]\n',
        "_ALSO_ALLOWED: list[Any] = [io.BytesIO]\n",
        "test_round_trip_restores_every_value and objects", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "plain-path-storage-header-found-while-reading", "the reference's own, fixed at acffbaf (SPEC ML-14)",
        "reference/checkpoint/records.py",
        "            _open_member(archive, info).close()\n", "            pass\n",
        "test_bad_checkpoint_fails_fast_naming_the_file and damaged-header", test_file="conformance/test_checkpoint.py",
        plain_path=True,
    ),
    Defect(
        "replicated-piece-copied", "the reference's own, fixed at 8f1df9f (SPEC ML-39)",
        "reference/checkpoint/planner.py",
        "            if local.is_contiguous() and local.numel() > 0 and not (local.is_conj() or local.is_neg()):\n"
        "                return torch.frombuffer(element_bytes(local), dtype=local.dtype, count=local.numel()).view(local.shape)\n",
        "", "from_their_own_memory and replicated", test_file="conformance/test_checkpoint.py", world_size="2",
    ),
    Defect(
        "writer-error-hides-the-os-error", "awslabs/awsome-distributed-ai PR #1225",
        "reference/checkpoint/writer_process.py",
        '            raise CheckpointError(f"{kind}: {message}")\n',
        '            raise CheckpointError(f"{path}: the checkpoint writer process failed")\n',
        "writer-disk-full", world_size="2",
    ),
    Defect(
        "load-not-restarted-after-a-publication", "the reference's own, fixed at 4d5a9c4 (SPEC ML-13.g)",
        "reference/checkpoint/api.py",
        "_LOADS_AFTER_A_PUBLICATION = 2\n", "_LOADS_AFTER_A_PUBLICATION = 0\n",
        "publishes_over", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "buffer-reused-while-written", "Megatron-LM PR #2288",
        "reference/checkpoint/async_save.py",
        "    with saver.lock:\n        saver.wait_in_flight()\n", "    with saver.lock:\n",
        "second_save_while_one_is_in_flight and new-path",
    ),
    Defect(
        "no-staging-copy", "pytorch/pytorch#144657, torchtitan #930",
        "reference/checkpoint/staging.py",
        "        tensors: list[tuple[_Path, torch.Tensor]] = []\n",
        "        return StagedState(state_dict, None, None)\n        tensors: list[tuple[_Path, torch.Tensor]] = []\n",
        "state_when_staging_completed",
    ),
    Defect(
        "completion-before-publication", "KempnerForge #102, Megatron-Bridge PR #4678",
        "reference/checkpoint/async_save.py",
        "            return run_save(state, checkpoint_id, collective, writer, planner, local_error=staging_error, write_data=write_data)\n",
        "            def announced(plan: Any, planner: Any) -> Any:\n"
        "                results = write_data(plan, planner) if write_data is not None else writer.write_data(plan, planner).value()\n"
        "                upload.set_result(None)\n"
        "                return results\n"
        "            return run_save(state, checkpoint_id, collective, writer, planner, local_error=staging_error, write_data=announced)\n",
        "completion_means",
    ),
    Defect(
        "background-error-swallowed", "google/orbax #605, VeOmni PR #1162",
        "reference/checkpoint/async_save.py",
        "    error = finished.exception()\n    if error is not None:\n",
        "    error = finished.exception()\n    if into.done():\n        return\n    if error is not None and False:\n",
        "background_failure_reaches_every_rank and (fsync or stateful)",
    ),
    Defect(
        "dead-writer-not-noticed", "SkyRL PR #1960",
        "reference/checkpoint/writer_process.py",
        "            ready = multiprocessing.connection.wait([self._connection, self.process.sentinel])\n"
        "            reply = self._connection.recv() if self._connection in ready else None\n"
        "        except (EOFError, OSError):\n"
        "            reply = None\n",
        "            reply = self._connection.recv()\n"
        "        except (EOFError, OSError):\n"
        "            import time\n"
        "            while True:  # waits for a reply that never comes\n"
        "                time.sleep(1)\n",
        "background_failure_reaches_every_rank and writer-dies",
    ),
    Defect(
        "collectives-on-the-callers-group", "KempnerForge #104",
        "reference/checkpoint/async_save.py",
        "        group = self.groups.get(key)\n",
        "        return process_group if process_group is not None else dist.group.WORLD\n        group = self.groups.get(key)\n",
        "training_collectives",
    ),
    Defect(
        "a-staged-copy-per-save-kept", "pytorch/pytorch#170163, allenai/OLMo-core#856",
        "reference/checkpoint/staging.py",
        "        if self._arena is None or layout != self._layout:\n            self.release()\n",
        "        if True:\n            self._kept = [*getattr(self, '_kept', []), self._arena]\n",
        "staged_copies_stay_bounded or shutdown_releases",
    ),
)


# Module state beyond parameters: extra state, a dtype change after wrapping, cpu_offload alone.
_MODULE_STATE = (
    Defect(
        "extra-state-detached-like-a-tensor", "pytorch/pytorch#122946, PR #125336",
        "reference/fsdp/model_state.py",
        "                out[names.clean_key(key)] = _copied(value, cpu_offload=cpu_offload)\n",
        "                value = value.detach()\n"
        "                out[names.clean_key(key)] = value.cpu().clone() if cpu_offload else value.clone()\n",
        "fsdp_model_state_dicts or sharded_model",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "extra-state-never-handed-to-the-module", "pytorch/pytorch#122946, PR #125336",
        "reference/fsdp/model_state.py",
        "                module.set_extra_state(rest[key])\n",
        "                _copied(module.get_extra_state(), cpu_offload=False)  # into what the get returned\n",
        "fsdp_model_state_dicts or sharded_model",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "extra-state-size-checked", "NVIDIA/TransformerEngine#1860",
        "reference/state_dict/api.py",
        "        if model_key is None or not isinstance(value, torch.Tensor) or _is_extra_state(fqn):\n",
        "        if model_key is None or not isinstance(value, torch.Tensor):\n",
        "plain_model",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "extra-state-bytesio-refused-by-the-loader", "NVIDIA/TransformerEngine#1860",
        "reference/checkpoint/records.py",
        "        if (module, name) == (\"_io\", \"BytesIO\"):\n            return io.BytesIO\n",
        "",
        "through_a_checkpoint",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "wrapped-root-extra-state-taken-as-the-wrappers", "pytorch/pytorch#122946",
        "reference/flat_param/prefix_hooks.py",
        "    if type(wrapper).get_extra_state is not nn.Module.get_extra_state:\n        names.add(\"_extra_state\")\n",
        "    names.add(\"_extra_state\")\n",
        "flat_param_wrapper",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "dtype-change-misses-flat-params", "pytorch/pytorch#138467",
        "reference/fsdp/unit.py",
        "        handle = self._handle\n        if handle is None:\n            super()._apply(fn, recurse)",
        "        handle = None\n        if handle is None:\n            super()._apply(fn, recurse)",
        "dtype_change_after_sharding",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "cpu-offload-rank0-only-sharded", "pytorch/pytorch PR #112837",
        "reference/state_dict/backend.py",
        "        if options.cpu_offload and not options.full_state_dict:\n            offloaded",
        "        if options.cpu_offload and not options.full_state_dict:\n"
        "            if not comm.is_coordinator(comm.default_group()):\n                return {}\n            offloaded",
        "cpu_offload_alone",
        test_file="conformance/test_module_state.py",
    ),
    Defect(
        "cpu-offload-rank0-only-plain", "pytorch/pytorch PR #112837",
        "reference/state_dict/backend.py",
        "        if options.full_state_dict and not comm.is_coordinator(comm.default_group()):\n",
        "        if not comm.is_coordinator(comm.default_group()):\n",
        "cpu_offload_alone",
        test_file="conformance/test_module_state.py",
    ),
)
DEFECTS = DEFECTS + _MODULE_STATE

#: Loading and publication of checkpoints (ML-27, ML-29, ML-30): a wider allow-list than torch's for
#: records and for the metadata, a metadata written in place, a plan-cache key blind to dtypes.
_CHECKPOINT_LOADING = (
    Defect(
        "builtins-in-the-record-allow-list", "google/orbax PR #3014, pytorch/pytorch#189308",
        "reference/checkpoint/records.py",
        '        if (module, name) == ("_io", "BytesIO"):\n            return io.BytesIO\n',
        '        if module == "builtins" and name != "bytes":  # any builtins global: wider than torch.load(weights_only=True)\n'
        '            import builtins\n'
        '            return getattr(builtins, name)\n'
        '        if (module, name) == ("_io", "BytesIO"):\n            return io.BytesIO\n',
        "crafted and object", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "builtins-in-the-metadata-allow-list", "pytorch/pytorch#189308, PR #191326",
        "reference/checkpoint/metadata_io.py",
        "        allowed = _ALLOWED.get((module, name))\n        if allowed is not None:\n            return allowed\n",
        "        allowed = _ALLOWED.get((module, name))\n        if allowed is not None:\n            return allowed\n"
        "        if module == \"builtins\":  # any builtins global\n"
        "            import builtins\n"
        "            return getattr(builtins, name)\n",
        "crafted and metadata", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "metadata-written-in-place", "pytorch/torchtitan PR #315, google/flax PR #1200",
        "reference/checkpoint/storage.py",
        '        tmp = self.path / f"{METADATA_FILE}.{self._tag}.tmp"\n',
        "        tmp = self.path / METADATA_FILE  # written in place: truncated, then written\n",
        "killed and (metadata or renamed or removed)", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "dtype-blind-plan-cache-key", "pytorch/pytorch PR #148577, PR #147343",
        "reference/checkpoint/plan_cache.py",
        "    return _digest((packed, list(paths.items())))\n",
        "    rows, _ = packed  # the tensor properties (dtypes) left out of the key\n"
        "    return _digest(([row[:6] + row[7:] for row in rows], list(paths.items())))\n",
        "one_property", test_file="conformance/test_checkpoint.py",
    ),
    Defect(
        "lying-member-names-resolved", "promptfoo/modelaudit PR #1408, protectai/modelscan #354",
        "reference/checkpoint/records.py",
        '    if not short or top != folder or short in seen or any(part in ("", ".", "..") for part in short.split("/")) or "\\\\" in name:\n',
        "    if False:  # member names trusted: the last member of a name wins\n",
        "crafted and (duplicate or dot)", test_file="conformance/test_checkpoint.py",
    ),
)
DEFECTS = DEFECTS + _CHECKPOINT_LOADING

#: Optimizer-state rules (SPEC SD-25, SD-32, SD-33, OS-16): what a set makes of the dict it is given.
_OPTIMIZER_STATE = (
    Defect(
        "optimizer-own-dict-refused", "pytorch/pytorch#124942",
        "reference/state_dict/api.py",
        "        if _optim.is_id_keyed(osd):\n", "        if False:\n",
        "own_state_dict", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "missing-state-dropped-silently", "pytorch/pytorch#192224",
        "reference/state_dict/optim_fqn.py",
        "            if p in stateful:\n", "            if False:\n",
        "missing_state or optim-state-missing", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "missing-state-judged-by-the-targets-hyperparameters", "pytorch/pytorch#192225",
        "reference/state_dict/optim_fqn.py",
        "            home[p].update({k: v for k, v in hyper_of[p].items() if k != PARAMS})\n", "            pass\n",
        "missing_state", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "empty-groups-paired-by-position", "pytorch/pytorch#143828",
        "reference/state_dict/optim_fqn.py",
        "    return dict(zip(local, saved))\n", "    return {(oi, gi): gi for oi, gi in local if gi < len(loaded_groups)}\n",
        "without_parameters", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "ranks-keep-their-own-hyperparameters", "horovod/horovod#526",
        "reference/fsdp/optim_keys.py",
        '        loaded = copy.deepcopy({k: v for k, v in saved_groups[home].items() if k != "params"})\n',
        '        loaded = copy.deepcopy({k: v for k, v in (saved_groups[home] if dist.get_rank() == 0 else group).items() if k != "params"})\n',
        "rank0s_hyperparameters", test_file="conformance/test_state_dict.py",
    ),
    Defect(  # its test needs a rank outside the group: run with --world-size 4
        "coordinator-is-global-rank-0", "pytorch/pytorch#63213",
        "reference/comm.py",
        "    return group_rank(group) == 0\n", "    return group is None or dist.get_rank() == 0\n",
        "subgroup_without", test_file="conformance/test_state_dict.py", world_size="4",
    ),
    Defect(
        "int-keys-loaded-as-text", "pytorch/pytorch#153842",
        "reference/checkpoint/flatten.py",
        "    container[native_path[-1]] = value\n",
        "    container[native_path[-1] if isinstance(container, list) else str(native_path[-1])] = value\n",
        "counter", test_file="conformance/test_training_states.py",
    ),
    Defect(
        "state-shape-checked-by-numel", "pytorch/pytorch#113673",
        "reference/fsdp/optim_keys.py",
        "        if _is_positional(value) and tuple(value.shape) != tuple(shape if shape is not None else full_shape(fqn)):\n",
        "        if _is_positional(value) and value.numel() != torch.Size(shape if shape is not None else full_shape(fqn)).numel():\n",
        "same-numel", test_file="conformance/test_optim_state.py",
    ),
    Defect(
        "sharded-state-shape-checked-by-numel", "pytorch/pytorch#113673",
        "reference/fsdp/optim_keys.py",
        "        if value.dim() > 0 and tuple(value.shape) != tuple(shapes[fqn]):\n",
        "        if value.dim() > 0 and value.numel() != shapes[fqn].numel():\n",
        "same-numel and sharded", test_file="conformance/test_optim_state.py",
    ),
)

DEFECTS = DEFECTS + _OPTIMIZER_STATE


#: pytest's exit status when tests ran and some failed (``pytest.ExitCode.TESTS_FAILED``).
TESTS_FAILED = 1


def _run(defect: Defect, world_sizes: str, timeout: float) -> tuple[str, str]:
    scratch = Path(tempfile.mkdtemp(prefix=f"defect-{defect.key}-"))
    try:
        shutil.copytree(REPO_ROOT, scratch / "repo", ignore=shutil.ignore_patterns(".venv*", ".git", ".asv", ".mutation", ".matrix", ".stress", "__pycache__"))
        target = scratch / "repo" / defect.file
        text = target.read_text()
        if text.count(defect.old) != 1:
            return "error", f"the text to replace occurs {text.count(defect.old)} times in {defect.file}"
        target.write_text(text.replace(defect.old, defect.new))
        command = [sys.executable, "-m", "pytest", defect.test_file, "--impl", "reference", "--world-size", defect.world_size or world_sizes,
                   "-k", defect.tests, "-q", "-x", "-p", "no:cacheprovider", "--rank-timeout", "60"]
        try:
            environment = {**os.environ, **({"SDC_REFERENCE_FAST_PATHS": "0"} if defect.plain_path else {})}
            done = subprocess.run(command, cwd=scratch / "repo", capture_output=True, text=True, timeout=timeout, env=environment)
        except subprocess.TimeoutExpired:
            return "caught", f"the run outlived {timeout:.0f} s"  # a hang the rank timeout did not cut
        lines = done.stdout.strip().splitlines() or [""]
        got = next((line.strip() for line in lines if line.strip().startswith(("got:", "E ", "Failed:"))), "")
        detail = f"{lines[-1]}; {got[:160]}".strip("; ")
        if done.returncode not in (0, TESTS_FAILED):  # no test selected, a usage or collection error
            return "error", f"pytest exit status {done.returncode}: {detail}"
        return ("caught" if done.returncode else "survived"), detail
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the defects and exit")
    parser.add_argument("--defect", action="append", default=[], help="run only this defect (repeatable)")
    parser.add_argument("--world-size", default="1,2")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per defect")
    args = parser.parse_args(argv)
    chosen = [d for d in DEFECTS if not args.defect or d.key in args.defect]
    if args.list:
        for defect in chosen:
            print(f"{defect.key:36} {defect.report:48} {defect.test_file} -k {defect.tests!r}")
        return 0
    survived = 0
    for defect in chosen:
        status, detail = _run(defect, args.world_size, args.timeout)
        survived += status != "caught"
        print(f"| {defect.key} | {defect.report} | {status} | {detail} |", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
