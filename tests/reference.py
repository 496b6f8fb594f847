"""Independent numpy references: each method's logit written as a loop over (b, h, i, j) from the papers'
formulas (``../shared/papers/``), sharing no code with posjax."""

import math

import numpy as np

# T5 buckets of one direction, as tabulated in tupe.md §1: (first distance, last distance, bucket).
T5_RANGES = [(8, 11, 8), (12, 15, 9), (16, 22, 10), (23, 31, 11), (32, 45, 12), (46, 63, 13), (64, 90, 14)]


def t5_bucket_tabulated(rel: int) -> int:
  """Bidirectional, 32 buckets, max distance 128, read off the table; ``rel = j - i``; keys after the query add 16."""
  n = abs(rel)
  if n < 8:
    b = n
  elif n >= 91:
    b = 15
  else:
    b = next(bucket for lo, hi, bucket in T5_RANGES if lo <= n <= hi)
  return b + (16 if rel > 0 else 0)


def t5_bucket(rel: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> int:
  """T5's bucket of ``rel = j - i`` (Raffel et al. 2020; mesh_tensorflow's ``_relative_position_bucket``) for any
  options, in float64: half the buckets per direction (keys after the query add ``num_buckets // 2``) or, one-way,
  keys after the query in bucket 0; the first half of a direction's buckets exact, then log-spaced up to
  ``max_distance``. (Where float32 rounding of the log crosses a bucket boundary an implementation in float32 can
  differ by one bucket: 8 buckets at max distance 200, 64 one-way at 50; the tests' options have no such distance.)"""
  n, offset = -rel, 0
  if bidirectional:
    num_buckets //= 2
    offset = num_buckets if n < 0 else 0
    n = abs(n)
  else:
    n = max(n, 0)
  exact = num_buckets // 2
  if n < exact:
    return offset + n
  return offset + min(exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)),
                      num_buckets - 1)


def softmax(x):
  """Over the last axis; a row of -inf and finite values weighs only the finite ones."""
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def layer_norm(x, scale, bias, eps=1e-5):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def project(x, dense):
  """``x W + c`` for a ``[D, H, K]`` kernel."""
  out = np.einsum("...d,dhk->...hk", x, dense["kernel"])
  return out + dense["bias"] if "bias" in dense else out


def rope_rotate(vec, position, base=10_000.0):
  """Rotate feature pairs (f, f + K/2) by ``position / base^(2f/K)``."""
  k = vec.shape[-1]
  out = vec.copy()
  for f in range(k // 2):
    angle = position / base ** (2 * f / k)
    a, b = vec[f], vec[f + k // 2]
    out[f] = a * math.cos(angle) - b * math.sin(angle)
    out[f + k // 2] = b * math.cos(angle) + a * math.sin(angle)
  return out


def tupe_positional(P_pos, P_corr, pos, opts, num_heads, head_dim, relative):
  """TUPE's positional term ``[B, H, L, L]`` including the [CLS] reset, from tupe.md §1."""
  official = opts.get("cls_reset", "official") == "official"
  reset = opts.get("cls_reset", "official") != "none"
  table = P_pos["table"]["embedding"]
  ln = (lambda v: layer_norm(v, P_pos["pos_ln"]["scale"], P_pos["pos_ln"]["bias"])) if "pos_ln" in P_pos else (
      lambda v: v)
  c = 1.0 / math.sqrt(2 * head_dim)

  def corr(pi, pj, h):
    return project(pi, P_corr["query"])[h] @ project(pj, P_corr["key"])[h] * c

  def row_of(p):
    return table[p + 1] if official else table[p]

  if official:
    theta1 = [corr(ln(table[0]), ln(table[0]), h) for h in range(num_heads)]
    theta2 = [corr(ln(table[1]), ln(table[1]), h) for h in range(num_heads)]
  elif reset:
    extra = P_pos["cls_theta"]
    theta1 = [corr(ln(extra[0]), ln(extra[0]), h) for h in range(num_heads)]
    theta2 = [corr(ln(extra[1]), ln(extra[1]), h) for h in range(num_heads)]
  B, L = pos.shape
  out = np.zeros((B, num_heads, L, L))
  rel_table = P_corr["relative_bias"]["rel_bias"] if relative else None
  clip = opts.get("relative_distance") == "clip"
  cmax = opts.get("max_distance", 128)
  for b in range(B):
    for h in range(num_heads):
      for i in range(L):
        for j in range(L):
          pi, pj = pos[b, i], pos[b, j]
          value = corr(ln(row_of(pi)), ln(row_of(pj)), h)
          rel_bias = 0.0
          if relative:
            r = pj - pi
            rel_bias = rel_table[min(max(r, -cmax), cmax) + cmax, h] if clip else rel_table[t5_bucket(r), h]
          if reset and pi == 0:  # [CLS] row, including [CLS] -> [CLS]
            if official:
              extra_row = (2 * cmax + 1) if clip else 16
              out[b, h, i, j] = theta1[h] + (rel_table[extra_row, h] if relative else 0.0)
            else:
              out[b, h, i, j] = theta1[h]
          elif reset and pj == 0:  # [CLS] column
            if official:
              extra_col = (2 * cmax + 2) if clip else 32
              out[b, h, i, j] = theta2[h] + (rel_table[extra_col, h] if relative else 0.0)
            else:
              out[b, h, i, j] = theta2[h]
          else:
            out[b, h, i, j] = value + rel_bias
  return out


def xpos_logit(q, k, n, m, opts):
  """xPos's ``Re Σ_f q̃_f conj(k̃_f) e^{i (n - m) θ_f} ζ_f^((n - m)/γ)`` (Sun et al. 2023, §3), feature pairs
  ``(f, f + d/2)`` as complex numbers."""
  d = len(q)
  f = np.arange(d // 2)
  theta = opts.get("max_timescale", 10_000.0) ** (-2 * f / d)
  gamma = opts.get("gamma", 0.4)
  zeta = (2 * f / d + gamma) / (1 + gamma)
  qc, kc = q[:d // 2] + 1j * q[d // 2:], k[:d // 2] + 1j * k[d // 2:]
  return float(np.real(np.sum(qc * np.conj(kc) * np.exp(1j * (n - m) * theta)
                              * zeta ** ((n - m) / opts.get("scale_base", 512.0)))))


def fire_bias(F, opts, r, query_position, h, max_len):
  """FIRE's bias at distance ``r`` from a query at ``query_position`` for head ``h`` (Li et al. 2023); ``L`` starts
  at the ``threshold`` option, else a quarter (``threshold_ratio``) of the training length."""
  initial = opts.get("threshold") or opts.get("threshold_ratio", 0.25) * (opts.get("original_max_len") or max_len)
  c, L = abs(float(F["c"])), abs(float(F["threshold_multiplier"]) * initial)
  psi = lambda d: math.log(c * d + 1)
  u = psi(abs(r)) / (psi(max(query_position, L)) + opts.get("eps", 1e-6))
  hidden = np.maximum(u * F["w1"] + F["b1"], 0.0)
  return hidden @ F["w2"][:, h] + F["b2"][h]


def sandwich_bias(opts, r, h, num_heads, head_dim):
  """Sandwich's bias at distance ``r`` for head ``h``: ``λ (Σ_f cos(r ω_f / ρ_h) - dim/2)`` (Chi et al. 2023);
  ``compression="bias"``, ``dim=None`` and ``first_frequency=1`` as NVIDIA NeMo's ``SandwichRelativePositionEmbedding``
  computes it, ``(Σ_{f=1..d/2} cos(r 10000^(-2f/d)) - d/2) / (8h/H)`` with ``d`` the head dimension."""
  dim, base = opts.get("dim", 128) or head_dim, opts.get("base", 10_000.0)
  compression, first = opts.get("compression", "alibi"), opts.get("first_frequency", 0)
  rho = 8 * (h + 1) / num_heads if compression in ("alibi", "bias") else 1.0
  position_ratio = rho if compression == "alibi" else 1.0
  inner = sum(math.cos(r * base ** (-2 * f / dim) / position_ratio) for f in range(first, first + dim // 2))
  return opts.get("scale", 1.0) * (inner - dim / 2) / (rho if compression == "bias" else 1.0)


def fox_log_gates(tables, opts, x, num_heads):
  """``[B, L, H]`` the Forgetting Transformer's log forget gates, ``log sigmoid(x W + b)`` (the official
  ``fgate_proj``), or a bias per head (``bias_only``; ``fixed``: ``-log(expm1(1 / T))``, ``T`` log-spaced over the
  heads from ``decay_time``)."""
  gate = opts.get("gate", "full")
  if gate == "full":
    logit = np.einsum("bld,dh->blh", x, tables["gate"]["kernel"]) + tables["gate"]["bias"]
  elif gate == "bias_only":
    logit = np.broadcast_to(tables["gate_bias"], x.shape[:2] + (num_heads,))
  else:
    t_min, t_max = opts["decay_time"]
    t = [math.exp(math.log(t_min) + (math.log(t_max) - math.log(t_min)) * n / (num_heads - 1))
         for n in range(num_heads)]
    logit = np.broadcast_to([-math.log(math.expm1(1 / T)) for T in t], x.shape[:2] + (num_heads,))
  return -np.logaddexp(0.0, -np.asarray(logit, np.float64))


def fox_sum(log_f, pos, i):
  """``Σ log f_t`` from the start of ``i``'s run of positions (its last position 0) through ``i``."""
  start = max(t for t in range(i + 1) if pos[t] == 0)
  return sum(log_f[t] for t in range(start, i + 1))


def logits(name, opts, P, x, pos, max_len, num_heads):
  """Reference attention logits ``[B, H, L, L]`` of one layer (harness: ``pos`` + ``attn`` modules)."""
  A = P["attn"]
  q, k = project(x, A["query"]), project(x, A["key"])
  B, L, H, K = q.shape
  layer_tables = A.get("position", {})
  shared_tables = P.get("pos", {})
  tables = shared_tables if opts.get("share_across_layers") else layer_tables
  kmax = opts.get("max_distance") or (max_len - 1)
  clip = lambda r: min(max(r, -kmax), kmax) + kmax
  if name == "tupe_a" or name == "tupe_r":
    corr_params = P["pos"]["correlation"] if opts.get("share_across_layers", True) else A["position"]["correlation"]
    positional = tupe_positional(P["pos"], corr_params, pos, opts, H, K, relative=name == "tupe_r")
  if name == "fox":
    log_f = fox_log_gates(layer_tables, opts, x, H)
  out = np.zeros((B, H, L, L))
  for b in range(B):
    if name == "bert_ad":
      p = P["pos"]["table"]["embedding"][pos[b]]
      if opts.get("layernorm"):
        p = layer_norm(p, P["pos"]["pos_ln"]["scale"], P["pos"]["pos_ln"]["bias"])
      pq, pk = project(p, A["position"]["pos_query"]), project(p, A["position"]["pos_key"])
    for h in range(H):
      for i in range(L):
        for j in range(L):
          qi, kj, r = q[b, i, h], k[b, j, h], pos[b, j] - pos[b, i]
          s = 1.0 / math.sqrt(K)
          if name in ("none", "absolute", "sinusoidal"):
            e = qi @ kj * s
          elif name in ("t5", "bert_r"):
            e = qi @ kj * s + P["pos"]["relative_bias"]["rel_bias"][t5_bucket(r), h]
          elif name == "alibi":
            e = qi @ kj * s - 2.0 ** (-8 * (h + 1) / H) * abs(r)
          elif name == "rope":
            e = rope_rotate(qi, pos[b, i]) @ rope_rotate(kj, pos[b, j]) * s
          elif name == "bert_ad":
            e = (qi @ kj + qi @ pk[j, h] + pq[i, h] @ kj + pq[i, h] @ pk[j, h]) / math.sqrt(4 * K)
          elif name in ("tupe_a", "tupe_r"):
            e = qi @ kj / math.sqrt(2 * K) + positional[b, h, i, j]
          elif name == "shaw":
            e = (qi @ kj + qi @ tables["key"][clip(r)]) * s
          elif name == "huang_m1":
            e = (qi @ kj) * tables["scalar"][min(abs(r), kmax), h] * s
          elif name == "huang_m2":
            e = (qi @ kj) * tables["scalar"][clip(r), h] * s
          elif name == "huang_m3":
            e = np.sum(qi * kj * tables["vector"][clip(r)]) * s
          elif name in ("huang_m4", "relative_key_query"):
            a = tables["key"][clip(r)]
            e = (qi @ kj + qi @ a + a @ kj) * s
          elif name in ("kerple_log", "kerple_power"):
            eps = opts.get("eps", 1e-2)
            kt = shared_tables if opts.get("share_across_layers", True) else layer_tables  # shared: the official
            r1, r2 = max(kt["r1"][h], eps), max(kt["r2"][h], eps)
            if name == "kerple_log":
              e = qi @ kj * s - r1 * math.log(1 + r2 * abs(r))
            else:
              e = qi @ kj * s - r1 * abs(r) ** min(r2, 2.0)
          elif name == "xpos":
            e = xpos_logit(qi, kj, pos[b, i], pos[b, j], opts) * s
          elif name == "fire":
            e = qi @ kj * s + fire_bias(tables["fire"], opts, r, pos[b, i], h, max_len)
          elif name == "sandwich":
            e = qi @ kj * s + sandwich_bias(opts, r, h, H, K)
          elif name == "pope":  # the paper's form: magnitudes times the cosine of the phase difference
            theta = opts.get("max_timescale", 10_000.0) ** (-np.arange(K) / K)
            delta = layer_tables["phase_bias"][h]
            delta = np.clip(delta, -2 * math.pi, 0.0) if opts.get("clamp", True) else delta
            softplus = lambda z: np.logaddexp(0.0, z)
            e = np.sum(softplus(qi) * softplus(kj) * np.cos((pos[b, i] - pos[b, j]) * theta - delta)) * s
          elif name == "fox":
            if opts.get("rope"):
              qi, kj = (rope_rotate(v, pos[b, n], opts.get("rope_base", 500_000.0)) for v, n in ((qi, i), (kj, j)))
            later, earlier = max(i, j), min(i, j)  # the gates between the two tokens, either way
            e = qi @ kj * s + fox_sum(log_f[b, :, h], pos[b], later) - fox_sum(log_f[b, :, h], pos[b], earlier)
          else:
            raise KeyError(name)
          out[b, h, i, j] = e
  return out


def shaw_value_output(P, x, pos, weights, max_len, opts):
  """``z_i = Σ_j α_ij (v_j + w^V_{clip(j-i)})`` before the output projection, ``[B, L, H, K]``."""
  A = P["attn"]
  tables = P["pos"] if opts.get("share_across_layers") else A["position"]
  v = project(x, A["value"])
  kmax = opts.get("max_distance") or (max_len - 1)
  B, L, H, K = v.shape
  z = np.zeros_like(v)
  for b in range(B):
    for h in range(H):
      for i in range(L):
        for j in range(L):
          r = min(max(pos[b, j] - pos[b, i], -kmax), kmax) + kmax
          z[b, i, h] += weights[b, h, i, j] * (v[b, j, h] + tables["value"][r])
  return z


def cope_row(z, keys, qe):
  """``[(j, term)]``: CoPE's term of a query's allowed ``keys`` from its logits ``z`` and ``q·e[n]`` ``qe`` ``[P]``
  (the paper's code): p_j = Σ_{t in keys, t >= j} σ(z_t) clamped at P - 1, the term interpolated between the
  entries floor(p) and ceil(p)."""
  sigmoid = lambda t: 1.0 / (1.0 + math.exp(-t))
  out = []
  for j in keys:
    p = min(sum(sigmoid(z[t]) for t in keys if t >= j), len(qe) - 1)
    lo, w = math.floor(p), p - math.floor(p)
    out.append((j, (1 - w) * qe[lo] + w * qe[math.ceil(p)]))
  return out


def stick_breaking_row(z, keys, i, remainder):
  """``{j: A_ij}``: query i's stick-breaking weights over ``keys`` (ascending), ``A_ij = σ(z_j) Π_{k in keys, k > j}
  (1 - σ(z_k))``; with ``remainder``, ``1 - Σ_j A_ij`` more on the query's own key."""
  sigmoid = lambda t: 1.0 / (1.0 + math.exp(-t))
  weight = {j: sigmoid(z[j]) * math.prod(1 - sigmoid(z[t]) for t in keys if t > j) for j in keys}
  if remainder:
    weight[i] = weight.get(i, 0.0) + 1 - sum(weight.values())
  return weight


def weight_rule_output(name, opts, P, x, pos, segments):
  """``[B, L, H, V]`` before the output projection: one causal layer of ``cope`` or ``stick_breaking``, in loops.
  Keys allowed to query i: j <= i in i's segment (query head h reads k/v head h // (H / G)).

  CoPE (the official layer, facebookresearch/RAM): z_ij = q_i·k_j / sqrt(K); gates g_it = sigmoid(z_it) over the
  allowed t; p_ij = Σ_{t=j..i} g_it clamped at npos - 1; logit z_ij + ((1 - w) q_i·e[floor p] + w q_i·e[ceil p]) /
  sqrt(K) (not divided with ``scaled=False``, the official cope_nodiv), w = p - floor p; a softmax over the allowed
  keys. Stick-breaking (the authors' ``sb_attn``): over the allowed keys, the query's own left out
  unless ``attend_current``, A_ij = σ(z_ij) Π_{j<k} (1 - σ(z_ik)); with ``remainder`` the query's own value also
  gets 1 - Σ_j A_ij."""
  A = P["attn"]
  q, k, v = project(x, A["query"]), project(x, A["key"]), project(x, A["value"])
  B, L, H, K = q.shape
  group = H // k.shape[2]
  sigmoid = lambda t: 1.0 / (1.0 + math.exp(-t))
  out = np.zeros((B, L, H, v.shape[-1]))
  for b in range(B):
    for h in range(H):
      for i in range(L):
        keys = [j for j in range(i + 1) if segments[b, j] == segments[b, i]]
        z = {j: q[b, i, h] @ k[b, j, h // group] / math.sqrt(K) for j in keys}
        weight = {}
        if name == "cope":
          divide = math.sqrt(K) if opts.get("scaled", True) else 1.0
          weight = {j: z[j] + e / divide for j, e in cope_row(z, keys, q[b, i, h] @ A["position"]["pos_emb"])}
          top = max(weight.values())
          total = sum(math.exp(e - top) for e in weight.values())
          weight = {j: math.exp(e - top) / total for j, e in weight.items()}
        else:
          keys = [j for j in keys if opts.get("attend_current", False) or j != i]
          weight = stick_breaking_row(z, keys, i, opts.get("remainder", True))
        for j, w in weight.items():
          out[b, i, h] += w * v[b, j, h // group]
  return out


def path_products(q, k, w, beta):
  """``[B, H, L, L]``: PaTH's ``q_i^T H_i H_{i-1} ... H_{j+1} k_j`` with ``H_t = I - β_t w_t w_t^T`` for ``j <= i``
  (0 above the diagonal), per head (``w``, ``beta`` already per query head): the row vector ``q_i^T`` multiplied by
  one factor at a time, walking the keys from the query back."""
  B, L, H, _ = q.shape
  out = np.zeros((B, H, L, L))
  for b in range(B):
    for h in range(H):
      for i in range(L):
        row = q[b, i, h].copy()
        for j in range(i, -1, -1):
          if j < i:
            t = j + 1
            row = row - beta[b, t, h] * (row @ w[b, t, h]) * w[b, t, h]
          out[b, h, i, j] = row @ k[b, j, h]
  return out


class FusedAttention:
  """The fused op (``posjax.kernels.relative_attention``) in float64, from the terms' formulas (the table in
  ``posjax.kernels.terms``): with r = p_j - p_i and c = clip(r, -k, k),

    logit(i, j) = scale q_i·k_j - m_h |r| + scale (q_i·a_c + a_c·k_j) + positional(i, j),

  positional = u_q,i·u_k,j (TUPE's untied term) under its [CLS] reset (a query at position 0 reads θ1, else a key
  at position 0 reads θ2: ``official`` before the bucket term is added, ``paper`` over it), plus the bucket
  table's entry (T5's bucket of r, or c with ``kind="clip"``; a [CLS] key's column, then a [CLS] query's row,
  reads its own entry where given), plus KERPLE's ``-r1 log(1 + r2 |r|)`` or ``-r1 |r|^r2``, FIRE's MLP of
  ``log(c|r| + 1) / (log(c max(p_i, |L|) + 1) + eps)`` and Sandwich's ``λ (Σ_f cos(r ω_f / ρ_h) - F)``. Key j is
  attended by query i when it is real, in i's segment, (causal) j <= i, (sliding window W) |i - j| < W and (chunk
  C) i // C == j // C; a query
  with no such key averages every key. Grouped keys (fewer heads than q): query head h reads head h // (H / G).

  Built from the batch's layout: each pair's distance, table entries, [CLS] flags and mask, found in a loop over
  (b, i, j); called with the arrays (numpy products), so that finite differences reuse the loop's work."""

  def __init__(self, positions, segments, valid, causal=False, buckets=None, relative_max_distance=None,
               sliding_window=0, chunk=0):
    B, L = positions.shape
    self.distance, self.bucket, self.row, self.query_position = (np.zeros((B, L, L), int) for _ in range(4))
    self.cls_i, self.cls_j, self.allowed = (np.zeros((B, L, L), bool) for _ in range(3))
    for b in range(B):
      for i in range(L):
        for j in range(L):
          r = int(positions[b, j]) - int(positions[b, i])
          self.distance[b, i, j] = r
          self.query_position[b, i, j] = int(positions[b, i])
          self.cls_i[b, i, j], self.cls_j[b, i, j] = int(positions[b, i]) == 0, int(positions[b, j]) == 0
          self.allowed[b, i, j] = (bool(valid[b, j]) and segments[b, i] == segments[b, j] and (not causal or j <= i)
                                   and (not sliding_window or abs(i - j) < sliding_window)
                                   and (not chunk or i // chunk == j // chunk))
          if relative_max_distance is not None:
            self.row[b, i, j] = min(max(r, -relative_max_distance), relative_max_distance) + relative_max_distance
          if buckets is not None:
            if buckets["kind"] == "buckets":
              entry = t5_bucket(r, buckets["num_buckets"], buckets["max_distance"], buckets["bidirectional"])
            else:
              entry = min(max(r, -buckets["max_distance"]), buckets["max_distance"]) + buckets["max_distance"]
            if self.cls_j[b, i, j] and buckets["cls_col"] is not None:
              entry = buckets["cls_col"]
            if self.cls_i[b, i, j] and buckets["cls_row"] is not None:
              entry = buckets["cls_row"]
            self.bucket[b, i, j] = entry

  def __call__(self, q, k, v, *, scale, alibi=None, bucket_table=None, relative_table=None, relative_query=False,
               relative_key=False, u_q=None, u_k=None, theta=None, reset="none", kerple_r1=None, kerple_r2=None,
               kerple_kind="log", fire_w1=None, fire_b1=None, fire_w2=None, fire_b2=None, fire_c=None,
               fire_threshold=None, fire_eps=1e-6, sandwich=None, forget_c=None, stick_breaking=None,
               cope_table=None, path=None):
    """``[B, L, H, V]`` float64. ``alibi`` ``[H]``, ``bucket_table`` ``[N, H]``, ``relative_table`` ``[2k+1, K]``,
    ``u_q``/``u_k`` ``[1 or B, L, H, K]``, ``theta`` ``[2, H]``, ``reset``: official | paper | none; ``kerple_r1``,
    ``kerple_r2`` ``[H]``; FIRE's ``w1``, ``b1`` ``[W]``, ``w2`` ``[W, H]``, ``b2`` ``[H]``, ``c``, ``threshold``;
    ``sandwich``: ``dict(ratios [H], dim, base, scale, divide, first)``; ``forget_c`` ``[1 or B, H, L]``: the
    Forgetting Transformer's cumulative log gates, ``c_i - c_j`` (``c_j - c_i`` for a later key);
    ``stick_breaking``: ``dict(attend_current, remainder)``, the weights of stick-breaking attention instead of the
    softmax (:func:`stick_breaking_row`); ``cope_table`` ``[K, P]``: CoPE's term on the masked logits
    (:func:`cope_row`); ``path``: ``dict(w [B, L, G, K], beta [B, L, G])``, PaTH's content term in place of
    ``q_i·k_j`` (:func:`path_products`)."""
    f64 = lambda x: np.asarray(x, np.float64)
    q, k, v = f64(q), f64(k), f64(v)
    B, L, H, _ = q.shape
    # grouped-query attention: query head h reads key/value head h // (H / G)
    k, v = (np.repeat(x, H // x.shape[2], axis=2) for x in (k, v))
    logits = scale * np.einsum("bihd,bjhd->bhij", q, k)
    if path is not None:
      w, beta = (np.repeat(f64(x), H // x.shape[2], axis=2) for x in (path["w"], path["beta"]))
      logits = scale * path_products(q, k, w, beta)
    if alibi is not None:
      logits = logits - f64(alibi)[None, :, None, None] * np.abs(self.distance)[:, None]
    d = np.abs(self.distance).astype(np.float64)[:, None]  # [B, 1, L, L]
    if kerple_r1 is not None:
      r1, r2 = f64(kerple_r1)[None, :, None, None], f64(kerple_r2)[None, :, None, None]
      logits = logits - r1 * (np.log(1 + r2 * d) if kerple_kind == "log" else d ** r2)
    if forget_c is not None:  # c_i - c_j for a key at or before the query, c_j - c_i after it
      c = f64(forget_c)
      difference = c[:, :, :, None] - c[:, :, None, :]
      logits = logits + np.where(np.arange(L)[None, :] > np.arange(L)[:, None], -difference, difference)
    if fire_w1 is not None:
      c, threshold = abs(float(fire_c)), abs(float(fire_threshold))
      u = np.log(c * d[:, 0] + 1) / (np.log(c * np.maximum(self.query_position, threshold) + 1) + fire_eps)
      hidden = np.maximum(u[..., None] * f64(fire_w1) + f64(fire_b1), 0.0)  # [B, L, L, W]
      logits = logits + (hidden @ f64(fire_w2) + f64(fire_b2)).transpose(0, 3, 1, 2)
    if sandwich is not None:  # divide="bias": NeMo's form, each head's bias divided by its ratio
      first = sandwich.get("first", 0)
      f = np.arange(first, first + sandwich["dim"] // 2)
      ratios = np.asarray(sandwich["ratios"], np.float64)
      by_bias = sandwich.get("divide", "positions") == "bias"
      omega = sandwich["base"] ** (-2.0 * f / sandwich["dim"])[None, :] / (1.0 if by_bias else ratios[:, None])
      angles = self.distance[:, None, :, :, None] * omega[None, :, None, None, :]  # [B, H, L, L, F]
      bias = sandwich["scale"] * (np.cos(angles).sum(-1) - len(f))
      logits = logits + (bias / ratios[None, :, None, None] if by_bias else bias)
    if relative_table is not None:
      a = f64(relative_table)[self.row]  # [B, L, L, K]
      if relative_query:
        logits = logits + scale * np.einsum("bihd,bijd->bhij", q, a)
      if relative_key:
        logits = logits + scale * np.einsum("bjhd,bijd->bhij", k, a)
    positional = np.zeros_like(logits)
    if u_q is not None:
      positional = np.einsum("bihd,bjhd->bhij", *(np.broadcast_to(f64(u), (B,) + f64(u).shape[1:]) for u in (u_q, u_k)))

    def untie(x):
      theta_row, theta_col = f64(theta)[0][None, :, None, None], f64(theta)[1][None, :, None, None]
      return np.where(self.cls_i[:, None], theta_row, np.where(self.cls_j[:, None], theta_col, x))

    if reset == "official":
      positional = untie(positional)
    if bucket_table is not None:
      positional = positional + f64(bucket_table)[self.bucket].transpose(0, 3, 1, 2)
    if reset == "paper":
      positional = untie(positional)
    logits = logits + positional
    if cope_table is not None:
      qe = np.einsum("bihd,dp->bhip", q, f64(cope_table))
      for b in range(B):
        for h in range(H):
          for i in range(L):
            keys = [j for j in range(L) if self.allowed[b, i, j]]
            logits[b, h, i, keys] = [logits[b, h, i, j] + e for j, e in cope_row(logits[b, h, i], keys, qe[b, h, i])]
    if stick_breaking is not None:
      out = np.zeros(q.shape[:3] + v.shape[-1:])
      for b in range(B):
        for h in range(H):
          for i in range(L):
            keys = [j for j in range(L) if self.allowed[b, i, j] and (stick_breaking["attend_current"] or j != i)]
            weights = stick_breaking_row(logits[b, h, i], keys, i, stick_breaking["remainder"])
            out[b, i, h] = sum(w * v[b, j, h] for j, w in weights.items())
      return out
    logits = np.where(self.allowed[:, None], logits, -np.inf)
    logits = np.where(self.allowed.any(-1)[:, None, :, None], logits, 0.0)  # a row with no key: every key alike
    return np.einsum("bhij,bjhd->bihd", softmax(logits), v)
