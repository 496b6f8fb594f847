"""FIRE (Li et al.; ICLR 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"): a learned MLP of the normalised distance, as an open term (:mod:`posjax.kernels.term`) with a
hand-written gradient per tile.

Shapes: S any (broadcast) shape, H heads, W hidden units, Q/T query/key tile rows.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.term import HEAD, Term


def _sign(x):
  """``jnp.sign`` (|x|'s derivative, 0 at 0) from comparisons: Mosaic's own sign needs a TPU to ask about, and
  Triton's lowering of a scalar select returns a bool."""
  return (x > 0).astype(jnp.float32) - (x < 0).astype(jnp.float32)


FIRE_PARTS = ("w1", "b1", "w2", "b2", "c", "threshold")


def fire_slot(width: int, part: str, unit=0):
  """Where FIRE's ``part`` (``unit`` of the ``W``-wide ones) sits in its per-head row and gradient columns:
  ``w1``, ``b1``, the head's ``w2`` (``W`` each), then ``b2``, ``c``, the threshold."""
  index = FIRE_PARTS.index(part)
  return index * width + unit if index < 3 else 3 * width + index - 3


@flax.struct.dataclass
class Fire(Term):
  """FIRE (Li et al. 2023): ``f(ψ(|r|) / (ψ(max(|L|, p_i)) + eps))``, ``ψ(x) = log(|c| x + 1)``, ``f`` a ReLU MLP
  ``1 -> W -> H``; ``p_i`` the query's position (so beyond ``L`` the distances are interpolated into ``[0, 1]``).

  Where ``c·max(|L|, p_i)`` nears 0 (a threshold learned down to ~0, a query at position 0) the normaliser nears
  ``eps`` and the bias ``1/eps``: the kernels' flash backward, whose softmax gradient is exact only to rounding,
  then differs from the dense path's in the gradients of ``c`` and the MLP (20% at ``L = 0``, 1e-4 at ``L =
  0.01``; the position method's threshold starts at 512). The kernels read each head's scalars as one
  :data:`~posjax.kernels.term.HEAD` row and compute the MLP one hidden unit at a time, forward and backward: its
  gradient per tile is written by hand (:meth:`hand_grads`), since a derived one would keep every unit's
  ``[Q, T]`` pre-activation (``W`` of them) for the backward."""

  w1: jax.Array  # [W]
  b1: jax.Array  # [W]
  w2: jax.Array  # [W, H]
  b2: jax.Array  # [H]
  c: jax.Array  # []
  threshold: jax.Array  # [] L
  eps: float = flax.struct.field(pytree_node=False, default=1e-6)
  KINDS = {"row": HEAD}  # each head's scalars in FIRE_PARTS' order (fire_slot)

  def bias(self, rel_S, query_positions_S):
    """``[S..., H]`` float32 at each distance ``rel`` from a query at ``query_positions`` (broadcast)."""
    c = jnp.abs(jnp.asarray(self.c, jnp.float32))
    psi = lambda x_S: jnp.log(c * x_S + 1.0)
    threshold = jnp.abs(jnp.asarray(self.threshold, jnp.float32))
    normaliser_S = psi(jnp.maximum(query_positions_S.astype(jnp.float32), threshold)) + self.eps
    u_S = psi(jnp.abs(rel_S).astype(jnp.float32)) / normaliser_S

    @jax.checkpoint  # one hidden unit at a time, recomputed backward: no [..., W] tensor is kept
    def unit(bias_SxH, w):
      w1, b1, w2_H = w
      return bias_SxH + jax.nn.relu(u_S * w1 + b1)[..., None] * w2_H, None

    bias_SxH = jnp.broadcast_to(self.b2.astype(jnp.float32), (*u_S.shape, self.b2.shape[-1]))
    bias_SxH, _ = jax.lax.scan(unit, bias_SxH, (self.w1.astype(jnp.float32), self.b1.astype(jnp.float32),
                                                self.w2.astype(jnp.float32)))
    return bias_SxH

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del batch, head_dim, length
    width = jnp.shape(self.w1)[0] if jnp.ndim(self.w1) == 1 else None
    expected = {"w1": (width,), "b1": (width,), "w2": (width, num_heads), "b2": (num_heads,), "c": (),
                "threshold": ()}
    for name, shape in expected.items():
      if width is None or jnp.shape(getattr(self, name)) != shape:
        raise ValueError(f"Fire.{name} has shape {jnp.shape(getattr(self, name))}; expected {shape} (w1: [W], "
                         f"b1: [W], w2: [W, {num_heads}], b2: [{num_heads}], c and threshold scalars)")

  def kernel_inputs(self, positions_BxL) -> dict:
    """``{"row": [H, 3W + 3]}``: ``w1``, ``b1``, the head's ``w2`` (``W`` each), then ``b2``, ``c``, the threshold
    (:func:`fire_slot`); the inputs the heads share broadcast to each (their gradients summed back by autodiff)."""
    del positions_BxL
    heads = self.b2.shape[0]
    shared = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32).reshape(1, -1), (heads, jnp.size(x)))
    return {"row": jnp.concatenate([shared(self.w1), shared(self.b1), self.w2.T.astype(jnp.float32),
                                    self.b2.astype(jnp.float32)[:, None], shared(self.c), shared(self.threshold)],
                                   axis=1)}

  def _normalised(self, tile):
    """``(u, m, norm, distance, query positions, c, threshold)`` of the tile: ``u = ψ(|r|) / (ψ(m) + eps)``, ``m =
    max(p_i, |L|)``."""
    width = (tile.head_columns("row") - 3) // 3
    c_raw, threshold_raw = (tile.head("row", fire_slot(width, part)) for part in ("c", "threshold"))
    c, threshold = jnp.abs(c_raw), jnp.abs(threshold_raw)
    positions = tile.q_positions.astype(jnp.float32)
    distance = jnp.abs(tile.k_positions - tile.q_positions).astype(jnp.float32)
    m = jnp.maximum(positions, threshold)
    norm = jnp.log(c * m + 1.0) + self.eps
    return jnp.log(c * distance + 1.0) / norm, m, norm, distance, positions, c_raw, threshold_raw

  def logits(self, tile, s):
    """The MLP one hidden unit at a time (no ``[Q, T, W]`` array)."""
    width = (tile.head_columns("row") - 3) // 3
    u = self._normalised(tile)[0]

    def unit(w, bias):
      w1, b1, w2 = (tile.head("row", fire_slot(width, part, w)) for part in ("w1", "b1", "w2"))
      return bias + jnp.maximum(u * w1 + b1, 0.0) * w2

    bias = jnp.zeros(jnp.broadcast_shapes(jnp.shape(u), jnp.shape(s)), jnp.float32)
    bias = bias + tile.head("row", fire_slot(width, "b2"))
    return s + jax.lax.fori_loop(0, width, unit, bias)

  def hand_grads(self, tile, s, ds, acc, add):
    """The columns' shares (:func:`fire_slot`) of the logits' gradient ``ds``, one hidden unit at a time; the score's
    own gradient passes unchanged (the term adds to it)."""
    del s
    if add is None:
      return ds, acc
    width = (tile.head_columns("row") - 3) // 3
    u, m, norm, distance, positions, c_raw, threshold_raw = self._normalised(tile)

    def unit(w, carry):
      acc, du = carry
      w1, b1, w2 = (tile.head("row", fire_slot(width, part, w)) for part in ("w1", "b1", "w2"))
      pre = u * w1 + b1
      g = jnp.where(pre > 0, ds * w2, 0.0)
      acc = add(acc, "row", fire_slot(width, "w1", w), g * u)
      acc = add(acc, "row", fire_slot(width, "b1", w), g)
      acc = add(acc, "row", fire_slot(width, "w2", w), ds * jnp.maximum(pre, 0.0))
      return acc, du + g * w1

    acc, du = jax.lax.fori_loop(0, width, unit, (acc, jnp.zeros(jnp.shape(ds), jnp.float32)))
    acc = add(acc, "row", fire_slot(width, "b2"), ds)
    c, threshold = jnp.abs(c_raw), jnp.abs(threshold_raw)
    psi_d = jnp.log(c * distance + 1.0)
    du_dc = (distance / (c * distance + 1.0)) / norm - psi_d / norm ** 2 * (m / (c * m + 1.0))
    du_dm = -psi_d / norm ** 2 * (c / (c * m + 1.0))
    dm_dl = jnp.where(threshold > positions, 1.0, jnp.where(threshold == positions, 0.5, 0.0))  # max's, 1/2 at a tie
    acc = add(acc, "row", fire_slot(width, "c"), du * du_dc * _sign(c_raw))
    return ds, add(acc, "row", fire_slot(width, "threshold"), du * du_dm * dm_dl * _sign(threshold_raw))

