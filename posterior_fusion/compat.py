"""Every old spelling still accepted, in one place, until version :data:`REMOVED_IN`.

Each use prints one warning naming the new spelling. Delete this module's tables (and the lines
that read them) at :data:`REMOVED_IN`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

REMOVED_IN = "0.4"

# Fit settings (fit-local's options, the TOML's [fit] keys, Flower's run-config and node-config keys, with ``-``
# for ``_`` where those spell them so): old name -> (new name, type name).
RENAMED_FIT_SETTINGS: dict[str, tuple[str, str]] = {
    "private_model": ("local_model", "str"), "private_model_kwargs": ("local_model_kwargs", "str"),
    "private_epochs": ("local_model_epochs", "int"), "private_weight": ("local_model_weight", "float")}
# Command-line options: old flag -> (new flag, parameter, type name) per command.
RENAMED_OPTIONS: dict[str, dict[str, tuple[str, str, str]]] = {
    "init": {"--mixtures": ("--components", "components", "int"), "--seed": ("--init-seed", "init_seed", "int"),
             "--from": ("--base", "base_path", "str")},
    "fit-local": {"--mixtures": ("--components", "components", "int"), "--hessian": ("--structure", "structure", "str"),
                  "--seed": ("--train-seed", "train_seed", "int"),
                  **{"--" + old.replace("_", "-"): ("--" + new.replace("_", "-"), new, kind)
                     for old, (new, kind) in RENAMED_FIT_SETTINGS.items()}},
    "partition": {"--seed": ("--partition-seed", "partition_seed", "int"), "--from": ("--data", "source", "str")},
    "fuse": {"--seed": ("--sampling-seed", "sampling_seed", "int"), "--mode-index": ("--component", "component", "int")},
    "demo": {"--mixtures": ("--components", "components", "int"), "--hessian": ("--structure", "structure", "str")},
    "experiment": {"--work-dir": ("--out-dir", "out_dir", "str")},
}
# Required options renamed (the old flag rewritten in the arguments before they are parsed): command -> old -> new.
RENAMED_REQUIRED_OPTIONS: dict[str, dict[str, str]] = {"recapture": {"--from": "--artifact"}}
# Commands that became others: (old command, the flag that marks the old use) -> the new command.
RENAMED_COMMANDS: dict[tuple[str, str], str] = {("recapture", "--at"): "refresh"}


def renamed_command(args: list[str], warn: Callable[[str], None]) -> list[str]:
    """``args`` (a command and its arguments) with an old command spelling (:data:`RENAMED_COMMANDS`) and old
    required flags (:data:`RENAMED_REQUIRED_OPTIONS`) rewritten, warning once for each."""
    if not args:
        return args
    command, rest = args[0], list(args[1:])
    flags = {a.split("=", 1)[0] for a in rest}
    for (old, marker), new in RENAMED_COMMANDS.items():
        if command == old and marker in flags:
            warn(f"warning: `{old} {marker}` is deprecated and will be removed in {REMOVED_IN}; use `pfuse {new}`")
            renames = RENAMED_REQUIRED_OPTIONS.get(old, {})
            rest = [renames.get(a.split("=", 1)[0], a.split("=", 1)[0]) + a[len(a.split("=", 1)[0]):] for a in rest]
            return [new, *rest]
    for old, new in RENAMED_REQUIRED_OPTIONS.get(command, {}).items():
        if old in flags:
            warn(f"warning: {old} is deprecated and will be removed in {REMOVED_IN}; use {new}")
            rest = [new + a[len(old):] if a.split("=", 1)[0] == old else a for a in rest]
    return [command, *rest]
# fuse options that became method settings (``--set KEY=VALUE``): old flag -> (setting, type name).
FUSE_FLAGS_TO_SETTINGS: dict[str, tuple[str, str]] = {
    "--steps": ("steps", "int"), "--lr": ("adam_lr", "float"), "--clip": ("clip", "float"),
    "--val-every": ("val_every", "int"), "--modes": ("modes", "int"), "--num-samples": ("num_samples", "int"),
    "--regmean-alpha": ("alpha", "float"), "--lowrank-tol": ("spectral_cutoff", "float")}
# Keys of the experiment TOML and of the Flower run config: old -> new.
RENAMED_TOML_KEYS = {"mixtures": "components"}
RENAMED_RUN_CONFIG_KEYS = {"mixtures": "components", "seed": "train-seed"}
# Method settings (``--set``): old name -> its name now. Not accepted: a configuration that uses an
# old name is refused in one line that gives the new one (where the method has the new name).
RENAMED_METHOD_SETTINGS = {"damping": "prior_scale", "tune_damping": "tune_prior_scale",
                           "lowrank_tol": "spectral_cutoff"}


def rename_keys(values: Mapping[str, Any], table: Mapping[str, str], where: str,
                warn: Callable[[str], None]) -> dict[str, Any]:
    """``values`` with every old key of ``table`` renamed (a new key given too wins), warning once per key."""
    out = dict(values)
    for old, new in table.items():
        if old in out:
            warn(f"warning: {where}: key {old!r} is deprecated and will be removed in {REMOVED_IN}; use {new!r}")
            value = out.pop(old)
            out.setdefault(new, value)
    return out
