"""Typed ``get_config(arg)`` options and durations for config files.

``--config=configs/pretrain.py:position=tupe_r,size=base,runlocal`` hands ``"position=tupe_r,size=base,
runlocal"`` to ``get_config``; :func:`parse_arg` turns it into typed options with defaults (a bare name is a
boolean flag), and an unknown name is an error that lists the known ones. :func:`check_ranges` checks the
numbers of a whole config against declared rules, so a run refuses ``batch_size=0`` or a negative learning
rate before it writes anything.
"""

from __future__ import annotations

import math
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
OPEN_FRACTION: Rule = ("in (0, 1)", lambda v: 0 < v < 1)


def at_least(minimum: float) -> Rule:
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
