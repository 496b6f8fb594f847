"""The language-model loss without ``[B, L, V]`` logits: the sequence in chunks, each chunk's logits computed,
reduced to per-token losses and dropped, and computed again in the backward (``jax.checkpoint``), so the loss and its
gradient hold one chunk's ``[B, C, V]`` at a time (levanter's and MaxText's chunked / vocabulary-tiled
cross-entropy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(logits, cap: float):
  """``cap · tanh(logits / cap)`` (Gemma 2's final logit soft cap); the logits unchanged for ``cap=0``."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def token_losses(x_BxLxE, matrix, layout: str, bias_V, labels_BxL, *, chunk: int = 0, z_loss: float = 0.0,
                 softcap: float = 0.0):
  """``(loss, correct)``, each ``[B, L]`` float32: per token the cross-entropy of ``logits = x · W (+ bias)`` at
  ``labels`` (``logsumexp - logit[label]``, plus ``z_loss · logsumexp²``, PaLM's auxiliary loss, where given) and
  whether the argmax is the label.

  ``matrix``: the output embedding in the compute dtype, ``[V, E]`` (``layout="ve"``: tied word embeddings) or
  ``[E, V]`` (``"dv"``: an untied head); the products take the compute dtype, the sums over ``E`` accumulate in
  float32. ``chunk``: sequence positions per piece (0 or ``>= L``: one piece, the whole ``[B, L, V]``). ``softcap``:
  the logits capped first (:func:`soft_cap`)."""
  b, length, e = x_BxLxE.shape
  chunk = length if chunk <= 0 or chunk >= length else chunk
  pieces = -(-length // chunk)
  pad = pieces * chunk - length
  x_NxBxCxE = jnp.pad(x_BxLxE, ((0, 0), (0, pad), (0, 0))).reshape(b, pieces, chunk, e).swapaxes(0, 1)
  labels_NxBxC = jnp.pad(labels_BxL, ((0, 0), (0, pad))).reshape(b, pieces, chunk).swapaxes(0, 1)
  spec = "bce,ve->bcv" if layout == "ve" else "bce,ev->bcv"

  @jax.checkpoint
  def piece(x_BxCxE, labels_BxC):
    logits_BxCxV = jnp.einsum(spec, x_BxCxE.astype(matrix.dtype), matrix, preferred_element_type=jnp.float32)
    if bias_V is not None:
      logits_BxCxV = logits_BxCxV + bias_V.astype(jnp.float32)
    logits_BxCxV = soft_cap(logits_BxCxV, softcap)
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    label_BxC = jnp.take_along_axis(logits_BxCxV, labels_BxC[..., None], axis=-1)[..., 0]
    loss_BxC = lse_BxC - label_BxC + (z_loss * jnp.square(lse_BxC) if z_loss else 0.0)
    return loss_BxC, (jnp.argmax(logits_BxCxV, axis=-1) == labels_BxC).astype(jnp.float32)

  if pieces == 1:
    loss_BxL, correct_BxL = piece(x_NxBxCxE[0], labels_NxBxC[0])
    return loss_BxL[:, :length], correct_BxL[:, :length]
  loss_NxBxC, correct_NxBxC = jax.lax.map(lambda args: piece(*args), (x_NxBxCxE, labels_NxBxC))
  unchunk = lambda y_NxBxC: y_NxBxC.swapaxes(0, 1).reshape(b, pieces * chunk)[:, :length]
  return unchunk(loss_NxBxC), unchunk(correct_NxBxC)
