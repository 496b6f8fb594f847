"""Official TUPE (fairseq) checkpoints -> posjax: a state dict with the official key names and shapes, run
through the official encoder's forward pass re-implemented here from the official code
(github.com/guolinke/TUPE, fairseq/modules/transformer_sentence_encoder.py, multihead_attention.py,
models/bert/model.py), independently of posjax, against the converted posjax model."""

import argparse
import math
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from posjax.convert import tupe_fairseq  # noqa: E402

D, H, LAYERS, FFN, VOCAB, MAX_POS = 32, 4, 2, 48, 50, 20
PAD = 1  # fairseq's dictionary puts <pad> at index 1


def official_bucket(relative_position, num_buckets=32, max_distance=128):
  ret = 0
  n = -relative_position
  num_buckets //= 2
  ret += (n < 0).to(torch.long) * num_buckets
  n = torch.abs(n)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                              * (num_buckets - max_exact)).to(torch.long)
  val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
  return ret + torch.where(is_small, n, val_if_large)


def official_state(rel_pos, seed=0, heads=("lm",)):
  """Random weights (scale 0.3) under the official key names and shapes."""
  g = torch.Generator().manual_seed(seed)
  r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
  ln = lambda: (1 + r(D), r(D))  # noqa: E731
  e = "decoder.sentence_encoder."
  state = {f"{e}embed_tokens.weight": r(VOCAB, D), f"{e}pos.weight": r(MAX_POS + 1, D),
           f"{e}pos_q_linear.weight": r(D, D), f"{e}pos_q_linear.bias": r(D),
           f"{e}pos_k_linear.weight": r(D, D), f"{e}pos_k_linear.bias": r(D)}
  state[f"{e}pos_ln.weight"], state[f"{e}pos_ln.bias"] = ln()
  state[f"{e}emb_layer_norm.weight"], state[f"{e}emb_layer_norm.bias"] = ln()
  if rel_pos:
    state[f"{e}relative_attention_bias.weight"] = r(33, H)
  for i in range(LAYERS):
    p = f"{e}layers.{i}."
    state.update({f"{p}self_attn.in_proj_weight": r(3 * D, D), f"{p}self_attn.in_proj_bias": r(3 * D),
                  f"{p}self_attn.out_proj.weight": r(D, D), f"{p}self_attn.out_proj.bias": r(D),
                  f"{p}fc1.weight": r(FFN, D), f"{p}fc1.bias": r(FFN), f"{p}fc2.weight": r(D, FFN), f"{p}fc2.bias": r(D)})
    state[f"{p}self_attn_layer_norm.weight"], state[f"{p}self_attn_layer_norm.bias"] = ln()
    state[f"{p}final_layer_norm.weight"], state[f"{p}final_layer_norm.bias"] = ln()
  if "lm" in heads:
    state.update({"decoder.lm_head.dense.weight": r(D, D), "decoder.lm_head.dense.bias": r(D),
                  "decoder.lm_head.weight": state[f"{e}embed_tokens.weight"], "decoder.lm_head.bias": r(VOCAB)})
    state["decoder.lm_head.layer_norm.weight"], state["decoder.lm_head.layer_norm.bias"] = ln()
  if "sentence_classification_head" in heads:
    state.update({"classification_heads.sentence_classification_head.dense.weight": r(D, D),
                  "classification_heads.sentence_classification_head.dense.bias": r(D),
                  "classification_heads.sentence_classification_head.out_proj.weight": r(3, D),
                  "classification_heads.sentence_classification_head.out_proj.bias": r(3)})
  return state


def official_args(rel_pos):
  return argparse.Namespace(encoder_layers=LAYERS, encoder_embed_dim=D, encoder_ffn_embed_dim=FFN,
                            encoder_attention_heads=H, activation_fn="gelu", dropout=0.1, attention_dropout=0.1,
                            encoder_normalize_before=False, embedding_normalize=True, max_positions=MAX_POS,
                            rel_pos=rel_pos, arch="bert_base")


def official_forward(state, tokens, rel_pos):
  """The official encoder, in evaluation mode (``TransformerSentenceEncoder.forward``, post-LN), and its heads."""
  e = lambda name: state[f"decoder.sentence_encoder.{name}"]  # noqa: E731
  ln = lambda x, name, src=e: F.layer_norm(x, (D,), src(f"{name}.weight"), src(f"{name}.bias"), eps=1e-5)  # noqa: E731
  bsz, seq_len = tokens.shape
  padding_mask = tokens.eq(PAD)
  x = ln(F.embedding(tokens, e("embed_tokens.weight")), "emb_layer_norm")
  x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
  weight = ln(e("pos.weight")[:seq_len + 1], "pos_ln")
  pos_scaling = float(D / H * 2) ** -0.5
  pos_q = F.linear(weight, e("pos_q_linear.weight"), e("pos_q_linear.bias")).view(seq_len + 1, H, -1).transpose(0, 1)
  pos_k = F.linear(weight, e("pos_k_linear.weight"), e("pos_k_linear.bias")).view(seq_len + 1, H, -1).transpose(0, 1)
  abs_pos_bias = torch.bmm(pos_q * pos_scaling, pos_k.transpose(1, 2))
  cls_2_other, other_2_cls = abs_pos_bias[:, 0, 0], abs_pos_bias[:, 1, 1]
  abs_pos_bias = abs_pos_bias[:, 1:, 1:].clone()
  abs_pos_bias[:, :, 0] = other_2_cls.view(-1, 1)
  abs_pos_bias[:, 0, :] = cls_2_other.view(-1, 1)
  if rel_pos:
    positions = torch.arange(MAX_POS)
    rp_bucket = official_bucket(positions[None, :] - positions[:, None])
    rp_bucket[:, 0] = 32
    rp_bucket[0, :] = 16
    abs_pos_bias = abs_pos_bias + F.embedding(rp_bucket[:seq_len, :seq_len], e("relative_attention_bias.weight")).permute(2, 0, 1)
  head_dim = D // H
  for i in range(LAYERS):
    p = lambda name: e(f"layers.{i}.{name}")  # noqa: E731,B023
    q, k, v = F.linear(x, p("self_attn.in_proj_weight"), p("self_attn.in_proj_bias")).chunk(3, dim=-1)
    q = q * float(head_dim * 2) ** -0.5
    split = lambda t: t.view(bsz, seq_len, H, head_dim).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) + abs_pos_bias[None]
    scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
    attn = (F.softmax(scores, dim=-1) @ split(v)).transpose(1, 2).reshape(bsz, seq_len, D)
    x = ln(x + F.linear(attn, p("self_attn.out_proj.weight"), p("self_attn.out_proj.bias")),
           f"layers.{i}.self_attn_layer_norm")
    hidden = F.gelu(F.linear(x, p("fc1.weight"), p("fc1.bias")))
    x = ln(x + F.linear(hidden, p("fc2.weight"), p("fc2.bias")), f"layers.{i}.final_layer_norm")
  out = {"features": x}
  if "decoder.lm_head.bias" in state:
    s = lambda name: state[f"decoder.lm_head.{name}"]  # noqa: E731
    y = F.layer_norm(F.gelu(F.linear(x, s("dense.weight"), s("dense.bias"))), (D,), s("layer_norm.weight"),
                     s("layer_norm.bias"), eps=1e-5)
    out["lm"] = F.linear(y, s("weight")) + s("bias")
  c = "classification_heads.sentence_classification_head."
  if f"{c}dense.weight" in state:
    y = torch.tanh(F.linear(x[:, 0], state[f"{c}dense.weight"], state[f"{c}dense.bias"]))
    out["classification"] = F.linear(y, state[f"{c}out_proj.weight"], state[f"{c}out_proj.bias"])
  return out


def tokens():
  t = torch.randint(2, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
  t[1, 9:] = PAD
  return t


@pytest.mark.parametrize("rel_pos", [False, True])
@pytest.mark.parametrize("heads", [("lm",), ("sentence_classification_head",)])
def test_official_tupe_checkpoints_convert_to_equal_posjax_models(rel_pos, heads):
  state = official_state(rel_pos, heads=heads)
  module, variables = tupe_fairseq.from_tupe_fairseq({"args": official_args(rel_pos), "model": state})
  assert module.config.position == ("tupe_r" if rel_pos else "tupe_a")
  assert module.config.position_options["cls_reset"] == "official" and module.config.type_vocab_size == 0
  t = tokens()
  with torch.no_grad():
    want = official_forward(state, t, rel_pos)
  mask = (t != PAD).numpy()
  mine = module.apply(variables, jnp.asarray(t.numpy()), attention_mask=jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(mine.last_hidden_state)[mask], want["features"].numpy()[mask], atol=1e-4)
  if "lm" in heads:
    assert module.head == "mlm"
    np.testing.assert_allclose(np.asarray(mine.logits)[mask], want["lm"].numpy()[mask], atol=1e-4)
  else:
    assert module.head == "classification"
    np.testing.assert_allclose(np.asarray(mine.logits), want["classification"].numpy(), atol=1e-4)


def test_a_checkpoint_file_with_fairseq_objects_reads_without_fairseq(tmp_path):
  meters = types.ModuleType("fairseq.meters")

  class AverageMeter:
    def __init__(self):
      self.avg = 1.5

  AverageMeter.__module__, AverageMeter.__qualname__ = "fairseq.meters", "AverageMeter"
  meters.AverageMeter = AverageMeter
  sys.modules["fairseq"], sys.modules["fairseq.meters"] = types.ModuleType("fairseq"), meters
  try:
    torch.save({"args": official_args(True), "model": official_state(True),
                "extra_state": {"train_meters": {"loss": AverageMeter()}}}, tmp_path / "checkpoint_last.pt")
  finally:
    del sys.modules["fairseq"], sys.modules["fairseq.meters"]
  module, variables = tupe_fairseq.from_tupe_fairseq(str(tmp_path / "checkpoint_last.pt"))
  assert module.config.position == "tupe_r" and module.head == "mlm"


def test_bad_checkpoints_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="TUPE checkpoint .*missing.pt does not exist"):
    tupe_fairseq.from_tupe_fairseq(str(tmp_path / "missing.pt"))
  torch.save({"args": official_args(False), "model": official_state(False)}, tmp_path / "whole.pt")
  (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:1000])  # a truncated copy
  with pytest.raises(ValueError, match=r"TUPE checkpoint .*cut.pt cannot be read \(.+\); the converter reads a whole"):
    tupe_fairseq.from_tupe_fairseq(str(tmp_path / "cut.pt"))
  with pytest.raises(ValueError, match=r"no weights under decoder.sentence_encoder."):
    tupe_fairseq.from_tupe_fairseq({"args": official_args(False), "model": {"encoder.layers.0.fc1.weight": np.ones(2)}})
  state = official_state(False)
  del state["decoder.sentence_encoder.emb_layer_norm.weight"]
  with pytest.raises(ValueError, match=r"without --embedding-normalize"):
    tupe_fairseq.from_tupe_fairseq({"args": official_args(False), "model": state})
  state = official_state(False)
  state["decoder.sentence_encoder.layers.1.fc1.weight"] = torch.zeros(FFN + 1, D)
  with pytest.raises(ValueError, match=r"layer_1/mlp_in/kernel has shape \(32, 49\) but its config implies \(32, 48\)"):
    tupe_fairseq.from_tupe_fairseq({"args": official_args(False), "model": state})
  two = official_state(False, heads=("lm", "sentence_classification_head"))
  two.update({k.replace("sentence_classification_head", "mnli"): v for k, v in two.items() if "classification" in k})
  with pytest.raises(ValueError, match=r"several classification heads \['mnli', 'sentence_classification_head'\]"):
    tupe_fairseq.from_tupe_fairseq({"args": official_args(False), "model": two})
  module, _ = tupe_fairseq.from_tupe_fairseq({"args": official_args(False), "model": two}, classification_head="mnli")
  assert module.head == "classification" and module.num_labels == 3


def test_command_line_writes_a_run_that_fine_tuning_starts_from(tmp_path):
  from posjax.convert import __main__ as cli
  from posjax.train import checkpoint

  torch.save({"args": official_args(True), "model": official_state(True)}, tmp_path / "checkpoint_best.pt")
  assert cli.main(["tupe-to-posjax", "--from", str(tmp_path / "checkpoint_best.pt"), "--workdir",
                   str(tmp_path / "run")]) == 0
  params = checkpoint.load_params(str(tmp_path / "run"))
  _, variables = tupe_fairseq.from_tupe_fairseq(str(tmp_path / "checkpoint_best.pt"))
  np.testing.assert_array_equal(params["encoder"]["position"]["table"]["embedding"],
                                variables["params"]["encoder"]["position"]["table"]["embedding"])
  assert cli.main(["tupe-to-posjax", "--from", str(tmp_path / "nothing.pt"), "--workdir", str(tmp_path / "x")]) == 2
