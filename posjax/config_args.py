"""Typed ``get_config(arg)`` options and durations for config files.

``--config=configs/pretrain.py:position=tupe_r,size=base,runlocal`` hands ``"position=tupe_r,size=base,
runlocal"`` to ``get_config``; :func:`parse_arg` turns it into typed options with defaults (a bare name is a
boolean flag), and an unknown name is an error that lists the known ones. :func:`check_ranges` checks the
numbers of a whole config against declared rules, so a run refuses ``batch_size=0`` or a negative learning
rate before it writes anything. :func:`load_config` loads a config file by path, as ``--config`` does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import typing
from typing import Callable

import ml_collections


def _convert(name: str, text: str, default):
  if isinstance(default, bool):
    if text.lower() in ("1", "true", "yes", ""):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"config option {name}={text!r} is not a boolean")
  if isinstance(default, int):
    return int(text)
  if isinstance(default, float):
    return float(text)
  return text


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """``"a=1,b,c=x"`` -> ConfigDict(a=1, b=True, c="x") typed like ``defaults``; unknown names raise."""
  options = dict(defaults)
  for item in filter(None, (part.strip() for part in (arg or "").split(","))):
    name, has_value, text = item.partition("=")
    if name not in defaults:
      raise ValueError(f"unknown config option {name!r}; known options: {sorted(defaults)}")
    if not has_value and not isinstance(defaults[name], bool):
      raise ValueError(f"config option {name!r} needs a value ({name}=...)")
    options[name] = _convert(name, text, defaults[name])
  return ml_collections.ConfigDict(options)


def named(arg: str | None) -> frozenset[str]:
  """The options ``arg`` names (``"a=1,b"`` -> {"a", "b"}). A preset such as ``runlocal`` leaves these as given:
  an option the user names wins over every preset."""
  return frozenset(part.partition("=")[0].strip() for part in (arg or "").split(",") if part.strip())


def unless_preset(arg: str | None, parsed: ml_collections.ConfigDict, name: str, preset: str = "runlocal"):
  """``parsed[name]`` where the user named it in ``arg`` or ``preset`` is off; else None: the preset's own value
  (a table's ``size`` under ``runlocal``: the tiny model, unless ``size=`` was given)."""
  return parsed[name] if name in named(arg) or not parsed[preset] else None


def steps(name: str, config, *, examples_per_step: int, examples_per_epoch: int | None = None) -> int:
  """Resolves ``config.<name>_steps`` / ``_epochs`` / ``_examples`` (exactly one set) into steps."""
  given = {unit: config.get(f"{name}_{unit}") for unit in ("steps", "epochs", "examples")}
  given = {unit: value for unit, value in given.items() if value is not None}
  if len(given) != 1:
    raise ValueError(f"give exactly one of {name}_steps, {name}_epochs, {name}_examples; got {given or 'none'}")
  (unit, value), = given.items()
  if unit == "steps":
    return int(value)
  if unit == "examples":
    return -(-int(value) // examples_per_step)
  if examples_per_epoch is None:
    raise ValueError(f"{name}_epochs needs the size of an epoch (data.examples_per_epoch, in examples)")
  return -(-int(value * examples_per_epoch) // examples_per_step)


Rule = tuple[str, Callable[[float], bool]]
POSITIVE: Rule = ("> 0", lambda v: v > 0)
NON_NEGATIVE: Rule = (">= 0", lambda v: v >= 0)
FRACTION: Rule = ("in [0, 1)", lambda v: 0 <= v < 1)


def at_least(minimum: float) -> Rule:
  """The rule ``>= minimum``: for a number with a floor other than 0 (e.g. ``max_len``)."""
  return (f">= {minimum}", lambda v: v >= minimum)


def check_ranges(config, rules: dict[str, Rule]) -> None:
  """Raises for the first field (a dotted path) whose number breaks its rule; unset (None) fields pass."""
  for field, (allowed, ok) in rules.items():
    value = config
    for part in field.split("."):
      value = value.get(part) if value is not None else None
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
      raise ValueError(f"config.{field}={value!r} is out of range: it must be a number {allowed}")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: configs/ lives here

def config_path(path: str) -> str:
  """The file of a ``--config`` path (relative to the working directory, else to the checkout); a missing one is
  an error."""
  for candidate in (path, os.path.join(ROOT, path)):
    if os.path.isfile(candidate):
      return candidate
  raise FileNotFoundError(f"config file {path} does not exist")


def load_config(spec: str) -> ml_collections.ConfigDict:
  """``path/to/config.py[:options]`` -> ``get_config(options)``, as ``--config`` loads it."""
  path, _, options = spec.partition(":")
  full = config_path(path)
  name = "posjax_config_" + re.sub(r"\W+", "_", os.path.splitext(path)[0])
  module_spec = importlib.util.spec_from_file_location(name, full)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(options or None)


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """``config`` with dotted fields set (as ``--config.a.b=value``); an unknown field is an error."""
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    if leaf not in target:
      raise ValueError(f"unknown config field {key!r} (in an override or --grid)")
    target[leaf] = value
  return config


def overridable(options) -> dict:
  """A dataclass of options as config values that the command line can set, a None default included: such a field
  becomes a ``placeholder`` of its annotated type (``int | None`` -> int; a tuple or list -> tuple), which
  ``--config.<path>=VALUE`` sets and which stays None otherwise (ml_collections refuses to override a plain None)."""
  hints = typing.get_type_hints(type(options))
  values = {}
  for field in dataclasses.fields(options):
    value = getattr(options, field.name)
    if value is None:
      kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)] or [hints[field.name]]
      kind = typing.get_origin(kinds[0]) or kinds[0]
      kind = tuple if kind in (list, tuple) else kind
      value = ml_collections.config_dict.placeholder(kind)
    values[field.name] = value
  return values

