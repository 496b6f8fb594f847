"""Named hybrid attention layouts: which layers are local (a sliding window or aligned chunks), which are global, which
carry the position method and which none, and which scale their queries, as the 2025-26 long-context decoders mix them.

A layout is :class:`posjax.models.TransformerConfig`'s ``layout`` (with ``layout_options``): it sets the per-layer
fields (``position_schedule``, ``layer_windows``, ``layer_chunks``, ``schedule_options``, ``query_temperature``,
``temperature_layers``) from its options, over the config's own ``position`` (``p`` below), so one layout crosses with
every position method. A pattern repeats over the depth. The layouts (defaults in :data:`LAYOUTS`):

- ``full``: every layer global with ``p`` (the baseline row: "all RoPE" with ``position="rope"``).
- ``irope`` (Llama 4's text layers, Meta 2025; Hugging Face ``Llama4TextConfig``): of every ``every`` layers the
  last is global NoPE with Llama 4's query temperature (``floor_scale``, ``attn_scale``; ``temperature=False``:
  none), the others ``p`` in aligned chunks of ``chunk`` tokens.
- ``rnope_swa`` (Yang et al. 2025, "Rope to Nope and Back Again", Cohere's Command A): of every ``every`` layers the
  last is global NoPE, the others ``p`` in a sliding window of ``window``.
- ``swan`` (Puvvada et al. 2025, SWAN-GPT): the same mix with the NoPE layer first in each group and a window of 512;
  the paper scales the NoPE layers' logits at inference with a formula its text gives and no official code pins
  down, so ``temperature`` takes any ``query_temperature`` for them (default none; e.g. ``{"kind": "ministral",
  ...}`` for a log scaling).
- ``gpt_oss`` (OpenAI 2025; Hugging Face ``GptOssConfig``): windowed layers of 128 and global ones in turn, every
  layer with ``p`` and (``sinks=True``) a learned sink logit per head (``attention_sinks``).
- ``gemma3`` (Gemma Team 2025): of every ``every`` layers the last global with ``p`` at the config's options, the
  others in a window of ``window`` with ``p`` at ``max_timescale=local_base`` and no scaling (Gemma 3's local layers;
  a method without ``max_timescale`` there takes its own options, as every method does with ``local_base=0``).

Which layer of a group is global, and SWAN's scaling, are this module's choices where the sources leave them open; the
options name them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from posjax import positions

# name -> (its options' defaults, a line for tables)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    "full": ({}, "every layer global"),
    "irope": (dict(every=4, chunk=8192, temperature=True, floor_scale=8192.0, attn_scale=0.1),
              "chunked layers with the method, one in every {every} global NoPE with a query temperature"),
    "rnope_swa": (dict(every=4, window=4096), "windowed layers with the method, one in every {every} global NoPE"),
    "swan": (dict(every=4, window=512, temperature={}), "the first in every {every} layers global NoPE, the others "
             "windowed with the method"),
    "gemma3": (dict(every=6, window=1024, local_base=10_000.0),
               "one in every {every} layers global, the others windowed at their own RoPE base"),
    "gpt_oss": (dict(every=2, window=128, sinks=True),
                "one in every {every} layers global, the others windowed, with a learned sink per head"),
}


def names() -> list[str]:
  """The layouts' names, in :data:`LAYOUTS`' order."""
  return list(LAYOUTS)


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


# Each option's check and what it must be, for the one-line error.
CHECKS = {
    "every": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 2, "an int >= 2"),
    "window": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an int >= 1"),
    "chunk": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an int >= 1"),
    "floor_scale": (lambda x: _number(x) and x > 0, "a number > 0"),
    "attn_scale": (lambda x: _number(x) and x >= 0, "a number >= 0"),
    "local_base": (lambda x: _number(x) and x >= 0, "a number >= 0 (0: the method's own options)"),
    "sinks": (lambda x: isinstance(x, bool), "True or False"),
}
TEMPERATURE = {  # irope's is a switch (Llama 4's own temperature); swan's any query_temperature, {} for none
    "irope": (lambda x: isinstance(x, bool), "True or False"),
    "swan": (lambda x: isinstance(x, Mapping), "a query_temperature dict ({} for none)"),
}


def options(name: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """``name``'s options: its defaults updated by ``given`` (an unknown name or option, or a value of another type or
  range, is a one-line error)."""
  if name not in LAYOUTS:
    raise ValueError(f"unknown layout {name!r}; allowed: {names()}")
  defaults, _ = LAYOUTS[name]
  stray = sorted(set(given or {}) - set(defaults))
  if stray:
    raise ValueError(f"layout {name!r} has no option {stray}; its options: {sorted(defaults) or 'none'}")
  found = {**defaults, **dict(given or {})}
  for key, value in found.items():
    check, wanted = TEMPERATURE[name] if key == "temperature" else CHECKS[key]
    if not check(value):
      raise ValueError(f"layout {name!r}: {key}={value!r} must be {wanted}")
  return found


def scaled(name: str, train_len: int, num_layers: int) -> dict[str, Any]:
  """``name``'s options for a study at ``train_len`` with ``num_layers`` layers (the harnesses' defaults): each
  window and chunk a quarter of the training length (Llama 4's ``floor_scale`` the chunk), so that the local layers
  are local where the model trains, and groups no larger than the model (2 layers: one local, one global)."""
  defaults = options(name)  # an unknown layout is an error here
  local = max(1, train_len // 4)
  found = {key: local for key in ("window", "chunk") if key in defaults}
  if "floor_scale" in defaults:
    found["floor_scale"] = float(local)
  if "every" in defaults and defaults["every"] > num_layers:
    found["every"] = max(2, num_layers)
  return found


def describe(name: str, given: Mapping[str, Any] | None = None) -> str:
  """One line: the layout and its options, for a table's notes."""
  found = options(name, given)
  shown = ", ".join(f"{k}={v}" for k, v in found.items())
  return f"{LAYOUTS[name][1].format(**found)}" + (f" ({shown})" if shown else "")


def fields(name: str, given: Mapping[str, Any] | None, position: str,
           position_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The config fields ``name`` sets over the method ``position`` (with its ``position_options``)."""
  o = options(name, given)
  if name == "full":
    return {}
  local = o["every"] - 1  # a group's local layers, then (or, first=True, before them) its global one

  def pattern(local_value, global_value, global_first=False) -> str:
    values = [str(local_value)] * local
    return ",".join([str(global_value)] + values if global_first else values + [str(global_value)])

  if name == "irope":
    found = dict(position_schedule=pattern(position, "none"), layer_chunks=pattern(o["chunk"], 0))
    if o["temperature"]:
      found.update(query_temperature={"kind": "llama4", "floor_scale": float(o["floor_scale"]),
                                      "attn_scale": float(o["attn_scale"])}, temperature_layers=pattern(0, 1))
    return found
  if name in ("rnope_swa", "swan"):
    first = name == "swan"
    found = dict(position_schedule=pattern(position, "none", first), layer_windows=pattern(o["window"], 0, first))
    if name == "swan" and o["temperature"]:
      found.update(query_temperature=dict(o["temperature"]), temperature_layers=pattern(0, 1, first))
    return found
  if name == "gpt_oss":
    return dict(layer_windows=pattern(o["window"], 0), **({"attention_sinks": True} if o["sinks"] else {}))
  tagged = f"{position}@local"
  found = dict(position_schedule=pattern(tagged, position), layer_windows=pattern(o["window"], 0))
  rotary = "max_timescale" in {f.name for f in dataclasses.fields(positions.get(position).options)}
  if o["local_base"] and rotary:  # Gemma 3's local layers: their own base, no scaling
    found["schedule_options"] = {tagged: {"max_timescale": float(o["local_base"])}}
  elif o["local_base"] and "local_base" in (given or {}):
    raise ValueError(f"layout 'gemma3': local_base={o['local_base']!r} sets a RoPE base, and position "
                     f"{position!r} has none (max_timescale); set local_base=0 for its own options")
  else:  # the method's own options in the local layers too
    found["schedule_options"] = {tagged: dict(position_options or {})}
  return found
