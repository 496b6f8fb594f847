"""Position probes as a task of the training loop: tiny encoders (or decoders, ``model.causal=True``) on synthetic
sequences where position is the whole difficulty, trained at one length and evaluated at multiples of it
(:mod:`posjax.experiments.probes` runs every method on every probe and tabulates them).

Every sequence starts with ``[CLS]`` (id ``symbols``) and the model labels every token (a classifier over the
symbols; a token of weight 0 is not scored):

- ``copy_left``: the symbol ``shift`` places to the left (a purely relative task);
- ``reverse``: the symbol at the mirrored place of the sequence (needs to know where the sequence ends);
- ``index``: the symbol at absolute index ``index`` (a purely absolute task).

Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length Generalization in Transformers") train
decoder-only models on seq2seq tasks written as one sequence, the input then the output, and score the output. As
per-token probes, the tasks below lay a row out as ``[CLS]``, the input, then blank answer slots (id ``symbols + 1``,
a token of its own), and label the slots with the output, all at once (no teacher forcing: a slot sees the input and
blanks, never an earlier answer, so no answer leaks into the next). Finding an answer's input means knowing how long
the input is, which grows with the row: a length-generalisation question, as in the paper.

- ``copy`` (the paper's Copy): ``n = (L - 1) // 2`` symbols, then ``n`` slots; slot ``j`` is labelled the input's
  ``j``-th symbol;
- ``sort`` (its Sorting, one token per number): the same layout; slot ``j`` is labelled the ``j``-th smallest input
  symbol;
- ``addition`` (its Addition): two numbers of ``n = (L - 2) // 3`` decimal digits each (symbols 0-9, least
  significant digit first, so that a carry runs forward as a decoder reads), then ``n + 1`` slots labelled with the
  sum's digits, least significant first;
- ``parity`` (its Parity): random bits; token ``i`` is labelled the parity of the bits up to and including ``i``.
  The paper asks for one answer, the whole sequence's parity, after the input; the prefix parity is that answer at
  the last token and a label at every other one. It is chosen for the encoder too: the whole sequence's parity at
  every token would not depend on order, so positions would not matter; the prefix's needs them (which bits are
  before ``i``), and in a decoder the causal mask hands the prefix over.

A row's last tokens that no slot needs (``L`` not filling the layout) are blanks of weight 0.

The expressivity probes the 2025-26 position papers report beside perplexity (PaTH, FoX, stick-breaking), each
labelled where its authors score it (token accuracy there: their exact match per answer):

- ``mqar`` (Arora et al. 2023, Zoology's ``multiquery_ar``): ``(L - 1) // 8`` key-value pairs, at least 2 (one
  pair is recalled by copying the only value, which no longer row would test) where the row has room for them and
  their queries (``(L - 1) // 4``), and at most ``symbols / 2 - 1``; keys from the lower half of the symbols, values from the upper, each distinct), then each
  key once more at an even offset of the rest (the offsets drawn with Zoology's power law, ``power_a`` 0.01, which
  favours the near ones), random symbols between; a repeated key is labelled with its value.
- ``flip_flop`` (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop Language Modeling"): pairs of an
  instruction (``w`` write, ``r`` read, ``i`` ignore: symbols 2, 3, 4) and a bit (0, 1); the first is a write, the
  others ``i`` with probability 0.8 and ``w`` or ``r`` with 0.1 each (their FFL(0.8)); a read's bit is the last
  written one, and the read instruction is labelled with it (the next token they score).
- ``s5`` / ``a5`` (the word problem of the symmetric group on 5 elements or its alternating subgroup: Merrill,
  Petty, Sabharwal 2024, "The Illusion of State in State-Space Models"): each token a group element (the
  permutations of 0-4 in lexicographic order; the even ones for ``a5``), labelled with the product of the elements
  up to it (the state after it, ``g_t ∘ ... ∘ g_1``: the first applied first). Its vocabulary and classes are the
  group's 120 or 60 elements, whatever ``symbols`` says.

A decoder labels a token from that token and the ones before it: ``copy_left``, ``copy``, ``sort``, ``addition``
and ``parity`` need nothing later; ``index`` scores only the tokens after index ``index`` (the decoder form);
``reverse`` labels a token with a later one, which a decoder cannot see, and is refused (:func:`check`).
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import features
from posjax.models import TransformerConfig, TransformerStack
from posjax.train.task import Evaluator, Task, summed_metrics

TASKS = ("copy_left", "reverse", "index", "copy", "sort", "parity", "addition", "mqar", "flip_flop", "s5", "a5")
GROUPS = ("s5", "a5")  # word problems: the group's elements are the vocabulary and the classes
FLIP_FLOP = {"write": 2, "read": 3, "ignore": 4}  # the instructions' symbols; the bits are 0 and 1
ANSWER_TASKS = ("copy", "sort", "addition")  # the input, then blank answer slots
DECODER_REFUSED = ("reverse",)  # labels a token with a later one
BASE = 10  # addition's digits


def min_length(task: str) -> int:
  """The shortest row that holds one of ``task``'s examples (one symbol, one digit per number)."""
  return {"copy": 3, "sort": 3, "addition": 5, "mqar": 5, "flip_flop": 5}.get(task, 2)


def group(task: str) -> np.ndarray:
  """``[N, 5]``: the elements of ``s5`` (all 120 permutations of 0-4, lexicographic) or ``a5`` (the 60 even ones)."""
  elements = np.asarray(list(itertools.permutations(range(5))))
  if task == "a5":
    inversions = np.asarray([sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) for p in elements])
    elements = elements[inversions % 2 == 0]
  return elements


def classes(task: str, symbols: int) -> int:
  """The classifier's classes: the group's elements for a word problem, else the symbols."""
  return len(group(task)) if task in GROUPS else symbols


def check(task: str, *, causal: bool = False, symbols: int = BASE, length: int | None = None) -> None:
  """Raises (one line) for a task that does not exist, a decoder task that needs later tokens, too few symbols for
  the digits of ``addition``, or a row too short for one example."""
  if task not in TASKS:
    raise ValueError(f"unknown probe task {task!r}; allowed: {list(TASKS)}")
  if causal and task in DECODER_REFUSED:
    raise ValueError(f"probe task {task!r} labels a token with a later one, which a decoder (model.causal=True) "
                     f"cannot see; decoder tasks: {[t for t in TASKS if t not in DECODER_REFUSED]}")
  if task == "addition" and symbols < BASE:
    raise ValueError(f"probe task 'addition' writes decimal digits: it needs symbols >= {BASE}, got {symbols}")
  needed = {"mqar": 4, "flip_flop": 5}.get(task, 0)
  if symbols < needed:
    raise ValueError(f"probe task {task!r} needs symbols >= {needed} (keys and values, or instructions and bits), "
                     f"got {symbols}")
  if length is not None and length < min_length(task):
    raise ValueError(f"probe task {task!r} needs rows of at least {min_length(task)} tokens, got {length}")


def vocab_size(task: str, symbols: int) -> int:
  """The symbols (a word problem's elements), [CLS] and, for the tasks with answer slots, the blank."""
  return classes(task, symbols) + (2 if task in ANSWER_TASKS else 1)


def make_batch(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int, shift: int, index: int,
               causal: bool = False):
  """``(input_ids, labels, weights)``, each ``[batch, length]``; id ``symbols`` is [CLS], ``symbols + 1`` the blank
  of an answer slot. ``causal``: the decoder form (see the module docstring)."""
  check(task, causal=causal, symbols=symbols, length=length)
  if task in ANSWER_TASKS or task == "parity":
    return _sequence_task(task, rng, batch, length, symbols)
  if task in ("mqar", "flip_flop") + GROUPS:
    x_BxL, labels_BxL, weights_BxL = {"mqar": _mqar, "flip_flop": _flip_flop}.get(task, _word_problem)(
        task, rng, batch, length, symbols)
    return x_BxL.astype(np.int32), labels_BxL.astype(np.int32), weights_BxL.astype(np.float32)
  x = rng.integers(0, symbols, size=(batch, length))
  x[:, 0] = symbols
  positions = np.arange(length)
  labels = np.zeros_like(x)
  weights = np.zeros(x.shape, np.float32)
  if task == "copy_left":
    labels[:, shift + 1:] = x[:, 1:length - shift]
    weights[:, shift + 1:] = 1
  elif task == "reverse":
    labels[:, 1:] = x[:, length - positions[1:]]
    weights[:, 1:] = 1
  else:  # index
    labels[:, 1:] = x[:, [index]]
    weights[:, (index + 1 if causal else 1):] = 1
    weights[:, index] = 0
  return x.astype(np.int32), labels.astype(np.int32), weights


def _sequence_task(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int):
  """``copy``, ``sort``, ``addition`` (the input, then answer slots) and ``parity``, as :func:`make_batch`."""
  x_BxL = np.full((batch, length), symbols + 1)
  x_BxL[:, 0] = symbols
  labels_BxL = np.zeros_like(x_BxL)
  weights_BxL = np.zeros(x_BxL.shape, np.float32)
  if task == "parity":
    x_BxL[:, 1:] = rng.integers(0, 2, size=(batch, length - 1))
    labels_BxL[:, 1:] = np.cumsum(x_BxL[:, 1:], axis=1) % 2
    weights_BxL[:, 1:] = 1
  elif task in ("copy", "sort"):
    n = (length - 1) // 2
    x_BxL[:, 1:n + 1] = rng.integers(0, symbols, size=(batch, n))
    inputs_BxN = x_BxL[:, 1:n + 1]
    labels_BxL[:, n + 1:2 * n + 1] = inputs_BxN if task == "copy" else np.sort(inputs_BxN, axis=1)
    weights_BxL[:, n + 1:2 * n + 1] = 1
  else:  # addition
    n = (length - 2) // 3
    x_BxL[:, 1:2 * n + 1] = rng.integers(0, BASE, size=(batch, 2 * n))
    a_BxN, b_BxN = x_BxL[:, 1:n + 1], x_BxL[:, n + 1:2 * n + 1]
    carry_B = np.zeros(batch, np.int64)
    for k in range(n):  # digit by digit, least significant first
      total_B = a_BxN[:, k] + b_BxN[:, k] + carry_B
      labels_BxL[:, 2 * n + 1 + k], carry_B = total_B % BASE, total_B // BASE
    labels_BxL[:, 3 * n + 1] = carry_B
    weights_BxL[:, 2 * n + 1:3 * n + 2] = 1
  return x_BxL.astype(np.int32), labels_BxL.astype(np.int32), weights_BxL


def _mqar(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int, power_a: float = 0.01):
  """Zoology's multi-query associative recall after ``[CLS]`` (the module docstring)."""
  del task
  n, half = length - 1, symbols // 2
  pairs = max(1, min(max(2, n // 8), n // 4, half - 1))
  space = (n - 2 * pairs) // 2  # even offsets of the query region
  p = power_a * np.arange(1, space + 1) ** (power_a - 1)
  x_BxL = rng.integers(0, symbols, size=(batch, length))
  x_BxL[:, 0] = symbols
  labels_BxL = np.zeros_like(x_BxL)
  weights_BxL = np.zeros(x_BxL.shape, np.float32)
  for b in range(batch):
    keys = rng.choice(half, size=pairs, replace=False)
    values = half + rng.choice(symbols - half, size=pairs, replace=False)
    x_BxL[b, 1:2 * pairs + 1:2], x_BxL[b, 2:2 * pairs + 2:2] = keys, values
    at = 1 + 2 * pairs + 2 * rng.choice(space, size=pairs, replace=False, p=p / p.sum())
    x_BxL[b, at], labels_BxL[b, at], weights_BxL[b, at] = keys, values, 1
  return x_BxL, labels_BxL, weights_BxL


def _flip_flop(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int, ignore: float = 0.8):
  """Flip-flop pairs after ``[CLS]`` (the module docstring); a last odd token is a bit of weight 0."""
  del task
  pairs = (length - 1) // 2
  write, read, skip = FLIP_FLOP["write"], FLIP_FLOP["read"], FLIP_FLOP["ignore"]
  x_BxL = rng.integers(0, 2, size=(batch, length))
  x_BxL[:, 0] = symbols
  labels_BxL = np.zeros_like(x_BxL)
  weights_BxL = np.zeros(x_BxL.shape, np.float32)
  instructions_BxP = rng.choice([skip, write, read], size=(batch, pairs), p=[ignore, (1 - ignore) / 2,
                                                                             (1 - ignore) / 2])
  instructions_BxP[:, 0] = write
  x_BxL[:, 1:2 * pairs + 1:2] = instructions_BxP
  for b in range(batch):
    last = 0
    for k in range(pairs):
      at = 1 + 2 * k
      if instructions_BxP[b, k] == write:
        last = x_BxL[b, at + 1]
      elif instructions_BxP[b, k] == read:
        x_BxL[b, at + 1], labels_BxL[b, at], weights_BxL[b, at] = last, last, 1
  return x_BxL, labels_BxL, weights_BxL


def _word_problem(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int):
  """Group elements after ``[CLS]``, each labelled with the product so far (the module docstring)."""
  del symbols
  elements = group(task)
  index = {tuple(p): i for i, p in enumerate(elements)}
  x_BxL = rng.integers(0, len(elements), size=(batch, length))
  x_BxL[:, 0] = len(elements)
  labels_BxL = np.zeros_like(x_BxL)
  weights_BxL = np.ones(x_BxL.shape, np.float32)
  weights_BxL[:, 0] = 0
  for b in range(batch):
    state = np.arange(5)
    for t in range(1, length):
      state = elements[x_BxL[b, t]][state]  # g_t after the product so far
      labels_BxL[b, t] = index[tuple(state)]
  return x_BxL, labels_BxL, weights_BxL


class Probe(nn.Module):
  """A BERT encoder (a decoder with ``config.causal``) and a per-token classifier over the probe's symbols."""

  config: TransformerConfig
  symbols: int

  @nn.compact
  def __call__(self, input_ids):
    h = TransformerStack(self.config, name="encoder")(input_ids).last_hidden_state
    return nn.Dense(self.symbols, name="classifier")(h).astype(jnp.float32)


def model_config(config, method: str, task: str) -> TransformerConfig:
  """The probe model of ``method`` for ``task`` (``config``: symbols, train_len, model; ``model.causal``: a
  decoder), without dropout."""
  return TransformerConfig(vocab_size=vocab_size(task, config.symbols), max_len=config.train_len, type_vocab_size=0,
                           position=method, dropout_rate=0.0, attention_dropout_rate=0.0, **config.model.to_dict())


class SeededBatches:
  """Endless training batches: batch ``n`` is ``draw(rng)`` with ``rng`` from ``[seed, *key, n]``, drawn whole, and
  each process takes its rows, so the batches depend on the seed alone and restoring costs nothing."""

  def __init__(self, draw, *, seed: int, key: tuple[int, ...], global_batch: int):
    self.draw, self.seed, self.key = draw, seed, tuple(key)
    self.drawn = 0
    self._rows = features.process_rows(global_batch)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rng = np.random.default_rng([self.seed, *self.key, self.drawn])
    self.drawn += 1
    return local_rows(self.draw(rng), self._rows)

  def state(self) -> dict:
    return {"batches_drawn": self.drawn}

  def restore(self, state: dict) -> None:
    self.drawn = int(state["batches_drawn"])


def draw(probe, rng: np.random.Generator, batch: int, length: int, causal: bool = False) -> dict:
  """A global batch of the probe's task (``causal``: its decoder form), as the loss reads it."""
  x, y, w = make_batch(probe.task, rng, batch, length, symbols=probe.symbols, shift=probe.shift, index=probe.index,
                       causal=causal)
  return {"input_ids": x, "labels": y, "weights": w}


def local_rows(batch: dict, rows: slice) -> dict:
  """This process's ``rows`` of every array of a global batch."""
  return {k: v[rows] for k, v in batch.items()}


def build(config, local_batch: int) -> Task:
  """One (method, task) probe for the training loop (``config.task = "probe"``, ``config.probe``: method, task,
  symbols, shift, index, eval_multiples; ``config.model.causal``: a decoder and the task's decoder form); evaluators
  of kind ``probe`` report token accuracy at each multiple of the training length as ``<name>@<length>``
  (``unsupported`` beyond a learned table)."""
  del local_batch
  probe = config.probe
  causal = bool(config.model.get("causal", False))
  check(probe.task, causal=causal, symbols=probe.symbols, length=config.max_len)
  settings = ml_collections.ConfigDict(dict(symbols=probe.symbols, train_len=config.max_len, model=config.model))
  bert = model_config(settings, probe.method, probe.task)
  model = Probe(bert, classes(probe.task, probe.symbols))

  def token_sums(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"])
    weights = batch["weights"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1),
            "weight": jnp.sum(weights, -1)}

  def loss_fn(params, batch, rng):
    del rng  # no dropout
    rows = token_sums(params, batch)
    return jnp.sum(rows["loss"]), {"correct": jnp.sum(rows["correct"]), "weight": jnp.sum(rows["weight"])}

  eval_batch = config.get("eval_batch_size") or config.batch_size
  evaluators = {}
  for name in config.evals:
    for multiple in probe.eval_multiples:
      length = config.max_len * multiple
      try:
        bert.position_spec.check_length(length)
      except ValueError as error:
        evaluators[f"{name}@{length}"] = Evaluator([], token_sums, None, unsupported=str(error),
                                                         metric_names=("accuracy",))
        continue
      batch = draw(probe, np.random.default_rng([config.seed, 99, multiple]), eval_batch, length, causal)
      evaluators[f"{name}@{length}"] = Evaluator([local_rows(batch, features.process_rows(eval_batch))],
                                                       token_sums, summed_metrics)
  batches = SeededBatches(lambda rng: draw(probe, rng, config.batch_size, config.max_len, causal), seed=config.seed,
                          key=(TASKS.index(probe.task),), global_batch=config.batch_size)
  return Task(f"probe/{probe.task}", model, bert, {"input_ids": jnp.zeros((1, config.max_len), jnp.int32)},
                    loss_fn, batches, evaluators, info={"position": bert.position})
