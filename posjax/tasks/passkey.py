"""Passkey retrieval for decoders (evaluators of kind ``passkey`` of the ``clm`` task): can the model find a key
hidden in filler text, at any depth, at lengths it was not trained at? The test Mohtashami & Jaggi 2023 ("Landmark
Attention: Random-Access Infinite Context Length for Transformers") made popular for long-context models.

A row of exactly ``L`` tokens (:func:`prompt`) follows their prompt, a line per piece, each line ending in ``[SEP]``
as the packed corpus ends its sentences (:mod:`posjax.data.mlm`):

  ``[CLS] intro [SEP] filler[:p] [SEP] key line [SEP] filler[:F - p] [SEP] question key``

``filler`` is the filler text's tokens repeated, cut (as their code cuts it, from its start) to ``p`` tokens before
the key line and ``F - p`` after it, ``F`` being whatever the row has room for; the depth ``p`` is drawn uniformly
from ``0..F``. The key is ``digits`` symbols drawn uniformly (each symbol one token: by default the digits 0-9 as
separate tokens; Landmark's key is a number below 50,000, as many tokens as its tokenizer makes of it), written twice
in the key line (``{key}`` in ``key_line``) and once after the question, where it is scored: the model predicts
each key token from the tokens before it (the true ones: teacher forcing), so a row whose every key token is its
argmax is exactly a row that greedy decoding completes with the key. ``accuracy``: the fraction of rows retrieved
whole; ``digit_accuracy``: of key tokens.

Spec options (``config.evals.<name>``, beside ``kind="passkey"``): ``batches`` (global evaluation batches of rows),
``length_multiple`` or ``max_len`` (the row length, as the corpus evaluators'), ``digits``, ``symbols`` (the key's
symbols, space-separated), ``intro``, ``filler``, ``key_line`` and ``question`` (texts; Landmark's by default).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from posjax.data import features
from posjax.data.tokenizer import Tokenizer
from posjax.train.task import Evaluator

# Mohtashami & Jaggi's prompt (their passkey script), and a five-symbol key.
DEFAULTS = {
    "batches": 1, "length_multiple": 1, "max_len": 0, "digits": 5, "symbols": "0 1 2 3 4 5 6 7 8 9",
    "intro": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
             "I will quiz you about the important information there.",
    "filler": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "key_line": "The pass key is {key}. Remember it. {key} is the pass key.",
    "question": "What is the pass key? The pass key is",
}
METRICS = ("accuracy", "digit_accuracy")


class Template(NamedTuple):
  """A prompt's pieces as token ids (``key_line``: the pieces around each ``{key}``)."""
  intro: list[int]
  filler: list[int]
  key_line: list[list[int]]
  question: list[int]
  cls_id: int
  sep_id: int


def fixed_tokens(template: Template, digits: int) -> int:
  """The tokens of a row that are not filler: [CLS], the intro, the key line, the question, the key, four [SEP]."""
  key_line = sum(map(len, template.key_line)) + digits * (len(template.key_line) - 1)
  return 1 + len(template.intro) + key_line + len(template.question) + digits + 4


def prompt(template: Template, key: list[int], depth: int, length: int) -> list[int]:
  """The row of ``length`` tokens hiding ``key`` after ``depth`` filler tokens (layout: the module docstring)."""
  room = length - fixed_tokens(template, len(key))
  if room < 0:
    raise ValueError(f"a passkey row needs at least {length - room} tokens, got {length}")
  if not 0 <= depth <= room:
    raise ValueError(f"passkey depth {depth} must be within the row's {room} filler tokens")
  if room and not template.filler:
    raise ValueError("the passkey filler text has no tokens")
  stream = (template.filler * math.ceil(room / max(len(template.filler), 1)))[:room]
  line = list(template.key_line[0])
  for part in template.key_line[1:]:
    line += list(key) + part
  sep = [template.sep_id]
  return ([template.cls_id] + template.intro + sep + stream[:depth] + sep + line + sep + stream[:room - depth] + sep
          + template.question + list(key))


def template(tokenizer: Tokenizer, spec: dict) -> tuple[Template, list[int]]:
  """The spec's texts as a :class:`Template`, and the key's symbol ids (each must be one known token)."""
  symbols = []
  for symbol in spec["symbols"].split():
    ids = tokenizer.encode(symbol)
    if len(ids) != 1 or ids[0] == tokenizer.unk_id:
      raise ValueError(f"passkey symbol {symbol!r} is {ids} in this vocabulary; each symbol must be one known token "
                       "(set the evaluator's symbols)")
    symbols.append(ids[0])
  if len(symbols) < 2:
    raise ValueError(f"passkey symbols={spec['symbols']!r}: give at least two, space-separated")
  parts = spec["key_line"].split("{key}")
  if len(parts) < 2:
    raise ValueError(f"passkey key_line={spec['key_line']!r} has no {{key}}")
  return Template(tokenizer.encode(spec["intro"]), tokenizer.encode(spec["filler"]),
                  [tokenizer.encode(p) for p in parts], tokenizer.encode(spec["question"]), tokenizer.cls_id,
                  tokenizer.sep_id), symbols


def draw(template: Template, symbols: list[int], digits: int, rng: np.random.Generator, rows: int,
         length: int) -> dict:
  """``rows`` prompts with random keys at random depths: ``input_ids [rows, L]`` and, as an MLM batch marks its
  labels, ``masked_positions`` (the tokens that predict the key's), ``masked_labels`` (the key) and
  ``masked_weights`` (``[rows, digits]`` each)."""
  room = length - fixed_tokens(template, digits)
  keys_RxD = rng.choice(np.asarray(symbols), size=(rows, digits))
  depths_R = rng.integers(0, max(room, 0) + 1, size=rows)
  ids_RxL = np.asarray([prompt(template, key.tolist(), int(depth), length) for key, depth in zip(keys_RxD, depths_R)],
                       np.int32)
  positions_RxD = np.broadcast_to(np.arange(length - digits - 1, length - 1), (rows, digits))
  return {"input_ids": ids_RxL, "masked_positions": positions_RxD.astype(np.int32),
          "masked_labels": keys_RxD.astype(np.int32), "masked_weights": np.ones((rows, digits), np.float32)}


def row_sums(model, params, batch) -> dict:
  """Per row: the key tokens predicted right (``correct``), the key's tokens (``weight``), whether all were right
  (``retrieved``) and whether the row is real (``rows``; padding rows weigh 0)."""
  logits_BxDxV = model.apply({"params": params}, batch["input_ids"], masked_positions=batch["masked_positions"],
                             deterministic=True).logits
  weights_BxD = batch["masked_weights"]
  right_BxD = (jnp.argmax(logits_BxDxV, -1) == batch["masked_labels"]).astype(jnp.float32) * weights_BxD
  correct_B, weight_B = jnp.sum(right_BxD, -1), jnp.sum(weights_BxD, -1)
  real_B = (weight_B > 0).astype(jnp.float32)
  return {"correct": correct_B, "weight": weight_B, "retrieved": real_B * (correct_B == weight_B), "rows": real_B}


def metrics(outputs: dict, workdir: str | None = None) -> dict:
  """``accuracy`` (rows whose whole key greedy decoding reproduces) and ``digit_accuracy`` (key tokens)."""
  del workdir
  total = {name: float(np.sum(values, dtype=np.float64)) for name, values in outputs.items()}
  return {"accuracy": total["retrieved"] / max(total["rows"], 1.0),
          "digit_accuracy": total["correct"] / max(total["weight"], 1.0)}


def check_spec(name: str, spec: dict) -> dict:
  """The spec with its defaults; an unknown option or a key of no symbols is an error."""
  unknown = sorted(set(spec) - set(DEFAULTS) - {"kind"})
  if unknown:
    raise ValueError(f"config.evals.{name}: unknown passkey option(s) {unknown}; known: {sorted(DEFAULTS)}")
  spec = {**DEFAULTS, **spec}
  for field in ("batches", "digits", "length_multiple"):
    if int(spec[field]) != spec[field] or spec[field] < 1:
      raise ValueError(f"config.evals.{name}.{field}={spec[field]!r} must be a whole number >= 1")
  return spec


def evaluators(config, tokenizer: Tokenizer, model_config, predict) -> dict[str, Evaluator]:
  """An :class:`Evaluator` per ``config.evals`` entry of kind ``passkey``, its rows drawn from the seed, the
  evaluator's name and its length (``predict(params, batch)``: :func:`row_sums` of the run's model); one at a length
  a learned position table cannot encode reports ``unsupported``."""
  global_batch = config.get("eval_batch_size") or config.batch_size
  found = {}
  for name, raw in config.evals.items():
    if raw.get("kind") != "passkey":
      continue
    spec = check_spec(name, dict(raw))
    length = spec["max_len"] or config.max_len * spec["length_multiple"]
    pieces, symbols = template(tokenizer, spec)
    if length < fixed_tokens(pieces, spec["digits"]):
      raise ValueError(f"config.evals.{name}: a passkey row needs at least {fixed_tokens(pieces, spec['digits'])} "
                       f"tokens with these texts, but its length is {length}")
    try:
      model_config.position_spec.check_length(length)
    except ValueError as error:
      found[name] = Evaluator([], predict, None, unsupported=str(error), metric_names=METRICS)
      continue
    rng = np.random.default_rng([config.seed, length, *name.encode()])
    rows = features.process_rows(global_batch)
    batches = [{k: v[rows] for k, v in draw(pieces, symbols, spec["digits"], rng, global_batch, length).items()}
               for _ in range(spec["batches"])]
    found[name] = Evaluator(batches, predict, metrics)
  return found
