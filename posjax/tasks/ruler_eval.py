"""RULER's tasks (:mod:`posjax.tasks.ruler`) for a decoder run: evaluators of kind ``ruler`` of the ``clm`` task, and
training rows holding them with their answers (``config.ruler_train``: the last rows of a batch; the passkey rows
take the first), the positive control that shows a task is measurable at all.

An evaluator's row is one prompt of its task whose haystack is the largest that leaves ``tokens`` of the row's length
``L`` for the answer (RULER's fit, counted in the run's tokenizer), left-padded to ``L - tokens``; greedy decoding
over the KV cache writes ``tokens`` tokens, which are decoded to text and scored by RULER's ``string_match_all``
(``accuracy``: its share, 0-1). Spec options (``config.evals.<name>``, beside ``kind="ruler"``): ``task``
(:data:`TASKS`), ``options`` (the generator's keyword options: ``keys``, ``values``, ``queries``, ``haystack``,
``words``, ``filler``, ``chains``, ``hops``, ...), ``batches``, ``length_multiple`` or ``max_len``, ``tokens``
(default RULER's per task: :data:`TOKENS`) and ``depths`` (``niah`` with one needle: N >= 2 depths from 0 to 1, rows
in turn, ``accuracy@<fraction>`` each).
"""

from __future__ import annotations

import functools

import numpy as np

from posjax import generate
from posjax.data import features, wrapped
from posjax.data.tokenizer import Tokenizer
from posjax.tasks import passkey, ruler
from posjax.train.task import Evaluator

TASKS = {"niah": ruler.niah, "variable_tracking": ruler.variable_tracking, "common_words": ruler.common_words,
         "frequent_words": ruler.frequent_words}
TOKENS = {"niah": 128, "variable_tracking": 30, "common_words": 120, "frequent_words": 50}  # RULER's
DEFAULTS = {"task": "niah", "options": {}, "batches": 1, "length_multiple": 1, "max_len": 0, "tokens": 0, "depths": 0}
# RULER's tasks that need no download, by their names in RULER's synthetic.yaml (the essay haystacks of
# niah_single_2/3 and niah_multikey_1/3 and the QA tasks need data of the user's; niah_multivalue and
# niah_multiquery sit on the repeat haystack here, on essays in RULER).
SUITE = {
    "niah_single_1": {"task": "niah"},
    "niah_multikey_2": {"task": "niah", "options": {"keys": 4, "haystack": "needle"}},
    "niah_multivalue": {"task": "niah", "options": {"values": 4}},
    "niah_multiquery": {"task": "niah", "options": {"keys": 4, "queries": 4}},
    "vt": {"task": "variable_tracking", "options": {"chains": 1, "hops": 4}},
    "cwe": {"task": "common_words"},
    "fwe": {"task": "frequent_words", "options": {"alpha": 2.0}},
}


def check_spec(name: str, spec: dict) -> dict:
  """The spec with its defaults; an unknown option, task or count is a one-line error."""
  unknown = sorted(set(spec) - set(DEFAULTS) - {"kind"})
  if unknown:
    raise ValueError(f"{name}: unknown ruler option(s) {unknown}; known: {sorted(DEFAULTS)}")
  spec = {**DEFAULTS, **spec}
  if spec["task"] not in TASKS:
    raise ValueError(f"{name}.task={spec['task']!r}; allowed: {list(TASKS)}")
  spec["tokens"] = spec["tokens"] or TOKENS[spec["task"]]
  for field in ("batches", "length_multiple", "tokens"):
    if int(spec[field]) != spec[field] or spec[field] < 1:
      raise ValueError(f"{name}.{field}={spec[field]!r} must be a whole number >= 1")
  depths = spec["depths"]
  if int(depths) != depths or depths < 0 or depths == 1 or (depths and spec["task"] != "niah"):
    raise ValueError(f"{name}.depths={depths!r} must be 0, or N >= 2 for task 'niah' (one needle at N depths)")
  return {**spec, "options": dict(spec["options"])}


def row(tokenizer: Tokenizer, spec: dict, seed, length: int, depth: float | None = None):
  """``(prompt ids, answers)``: the task's sample whose prompt fits ``length - tokens`` tokens (the run's start ids
  first)."""
  make = functools.partial(TASKS[spec["task"]], **spec["options"], **({"depth": depth} if depth is not None else {}))
  count = lambda text: len(tokenizer.start_ids) + len(tokenizer.encode(text))
  budget = length - spec["tokens"]
  try:
    _, sample = ruler.fit(lambda size: make(np.random.default_rng(seed), size), count, budget, high=max(budget, 1))
  except ValueError as error:
    raise ValueError(f"RULER task {spec['task']!r} with options {spec['options']} at length {length}: {error} "
                     f"({budget} tokens: the row's length less the {spec['tokens']} answered)") from None
  return tokenizer.start_ids + tokenizer.encode(sample.prompt), sample.answers


def draw(tokenizer: Tokenizer, spec: dict, seed: list, rows: int, length: int) -> tuple[dict, list]:
  """``rows`` prompts left-padded to ``length - tokens`` (``input_ids``, ``attention_mask``), their ``row_id`` and
  ``depth_index`` (-1 off the grid), and their answers."""
  prompt_len = length - spec["tokens"]
  fractions = passkey.depth_fractions(spec["depths"])
  ids_RxP = np.full((rows, prompt_len), tokenizer.pad_id, np.int32)
  mask_RxP = np.zeros((rows, prompt_len), np.int32)
  answers = []
  for r in range(rows):
    depth = float(fractions[r % len(fractions)]) if len(fractions) else None
    ids, found = row(tokenizer, spec, [*seed, r], length, depth)
    ids_RxP[r, prompt_len - len(ids):], mask_RxP[r, prompt_len - len(ids):] = ids, 1
    answers.append(found)
  index_R = np.arange(rows) % len(fractions) if len(fractions) else np.full((rows,), -1)
  return {"input_ids": ids_RxP, "attention_mask": mask_RxP, "row_id": np.arange(rows, dtype=np.int32),
          "depth_index": index_R.astype(np.int32)}, answers


def generated(model, tokens: int, params, batch) -> dict:
  """The ``tokens`` greedy decoding writes after each left-padded prompt."""
  ids_BxT = generate.greedy(model, {"params": params}, batch["input_ids"], tokens, batch["attention_mask"] > 0)
  return {"generated": ids_BxT[:, batch["input_ids"].shape[1]:], "row_id": batch["row_id"],
          "depth_index": batch["depth_index"]}


def text(tokenizer: Tokenizer, ids) -> str:
  """Generated ids as text, up to the end of sequence (its eos, or [SEP] for a BERT vocabulary)."""
  ids = [int(i) for i in ids]
  end = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
  if end is not None and end in ids:
    ids = ids[:ids.index(end)]
  return tokenizer.backend.decode(ids, skip_special_tokens=True)


def metrics(tokenizer: Tokenizer, answers: list, depths: int, outputs: dict, workdir: str | None = None) -> dict:
  """``accuracy`` (RULER's ``string_match_all`` over the rows, as a fraction) and ``accuracy@<fraction>`` per depth."""
  del workdir
  predictions = [text(tokenizer, ids) for ids in outputs["generated"]]
  references = [answers[int(r)] for r in outputs["row_id"]]
  found = {"accuracy": ruler.string_match_all(predictions, references) / 100.0}
  for i, fraction in enumerate(passkey.depth_fractions(depths)):
    at = [j for j, d in enumerate(outputs["depth_index"]) if d == i]
    if at:
      found[f"accuracy@{fraction:.2f}"] = ruler.string_match_all(
          [predictions[j] for j in at], [references[j] for j in at]) / 100.0
  return found


def evaluators(config, tokenizer: Tokenizer, model_config, model) -> dict[str, Evaluator]:
  """An :class:`Evaluator` per ``config.evals`` entry of kind ``ruler``, its rows drawn from the seed, the
  evaluator's name and its length; one at a length a learned position table cannot encode, or of a method that
  cannot decode, reports ``unsupported``."""
  global_batch = config.get("eval_batch_size") or config.batch_size
  found = {}
  for name, raw in config.evals.items():
    if raw.get("kind") != "ruler":
      continue
    spec = check_spec(f"config.evals.{name}", dict(raw))
    length = spec["max_len"] or config.max_len * spec["length_multiple"]
    names = passkey.metric_names(spec["depths"])[:1] + passkey.metric_names(spec["depths"])[2:]
    why = None
    try:
      model_config.position_spec.check_length(length)
    except ValueError as error:
      why = str(error)
    why = why or passkey.cannot_decode(model, 8)
    if why:
      found[name] = Evaluator([], None, None, unsupported=why, metric_names=names)
      continue
    rows = features.process_rows(global_batch)
    batches, answers = [], []
    for b in range(spec["batches"]):
      batch, drawn = draw(tokenizer, spec, [config.seed, length, b, *name.encode()], global_batch, length)
      batch["row_id"] = batch["row_id"] + len(answers)
      answers += drawn
      batches.append({k: v[rows] for k, v in batch.items()})
    found[name] = Evaluator(batches, functools.partial(generated, model, spec["tokens"]),
                            functools.partial(metrics, tokenizer, answers, spec["depths"]), metric_names=names)
  return found


class TrainingRows(wrapped.Wrapped):
  """A run's training batches with RULER prompts and their answers in them (``config.ruler_train``: ``fraction`` of
  each local batch's rows, the last ones, each a prompt of one of ``tasks`` (``{name: {"task": ..., "options":
  ...}}``, as :data:`SUITE`'s, drawn uniformly) fitted to the row with its answers after it, joined by ", " as RULER's answers read, then padding): a model
  that learns the tasks at its training length, the positive control of the ``ruler`` evaluators. Drawn from the
  seed, the process and the batch's index, so a resumed run draws the same ones."""

  def __init__(self, batches, tokenizer: Tokenizer, spec: dict, local_batch: int, length: int, seed: int):
    fraction = spec.get("fraction", 0.0)
    if not 0.0 < fraction <= 1.0:
      raise ValueError(f"config.ruler_train.fraction={fraction!r} must be in (0, 1] (0: no RULER rows; drop the key)")
    tasks = dict(spec.get("tasks") or {})
    if not tasks:
      raise ValueError("config.ruler_train.tasks is empty: name one or more ({name: {task, options}}, the tasks: "
                       f"{list(TASKS)})")
    super().__init__(batches, seed)
    self.tokenizer, self.length = tokenizer, length
    self.rows = max(1, round(fraction * local_batch))
    self.specs = [check_spec(f"config.ruler_train.tasks.{name}", {**dict(task), "tokens": int(spec.get("tokens", 16))})
                  for name, task in tasks.items()]

  salt = (1,)  # draws of their own beside the passkey rows

  def change(self, batch: dict, rng: np.random.Generator) -> dict:
    local_batch = batch["input_ids"].shape[0]
    for r in range(local_batch - self.rows, local_batch):  # the last rows: the passkey rows take the first
      spec = self.specs[int(rng.integers(len(self.specs)))]
      seed = [int(x) for x in rng.integers(2 ** 31, size=2)]
      ids, answers = row(self.tokenizer, spec, seed, self.length)
      ids = (ids + self.tokenizer.encode(" " + ", ".join(answers)))[:self.length]
      batch["input_ids"][r] = self.tokenizer.pad_id
      batch["input_ids"][r, :len(ids)] = ids
      batch["attention_mask"][r] = 0
      batch["attention_mask"][r, :len(ids)] = 1
      if "segment_ids" in batch:
        batch["segment_ids"][r] = 0
        batch["segment_ids"][r, :len(ids)] = 1
      if "positions" in batch:
        batch["positions"][r] = np.arange(self.length)
    return batch
