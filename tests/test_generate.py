"""Generation with a KV cache: every decoder-form position method's greedy tokens and step logits equal the full
forward's at every position (a causal model's logits at t depend only on tokens <= t, so one forward over the
generated sequence is the loop that reruns the model for every new token); grouped k/v in the cache, a sliding
window shorter than the sequence, scanned layers, left-padded prompts, sampling, Hugging Face's own ``generate``
for a converted Llama, and the command line."""

import dataclasses
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import generate
from posjax.models import TransformerConfig, Transformer
from posjax.train import checkpoint, sharding
from conftest import randomize

# one layer per method (a position schedule): the decoder forms the decode kernels do not build, on the dense
# formulas (ALiBi, T5, KERPLE and FIRE decode there too: tests/test_decode.py checks both implementations against the
# float64 reference, and the model test below decodes them on the kernels)
SCHEDULE = "rope,sandwich,xpos,shaw,none,fox,cope,stick_breaking"


def decoder(**fields):
  config = TransformerConfig.decoder(**{**dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                               intermediate_size=48, max_len=64, dtype="float32"), **fields})
  module = Transformer(config, head="lm")
  # every parameter drawn at random, so no position term starts at zero; from the shapes alone (no initialiser
  # compiled: an 8-layer schedule's init costs more than its generation)
  return module, randomize(jax.eval_shape(module.init, jax.random.key(1), jnp.zeros((1, 8), jnp.int32)), seed=2,
                           scale=0.3)


@pytest.mark.parametrize("fields", [
    # RoPE (the schedule's first) with YaRN, every layer in a window shorter than the sequence
    dict(num_layers=len(SCHEDULE.split(",")), position_schedule=SCHEDULE, sliding_window=6,
         position_options={"scaling": "yarn", "factor": 2.0, "original_max_len": 8}),
    dict(position="absolute", scan_layers=True),
])
def test_greedy_tokens_and_step_logits_equal_the_full_forward(fields):
  module, variables = decoder(**fields)
  prompt = np.random.default_rng(0).integers(0, 61, (2, 5))
  tokens, cached = (np.asarray(x) for x in generate.generate(module, variables, prompt, max_new_tokens=9,
                                                              return_logits=True))
  assert tokens.shape == (2, 14) and (tokens[:, :5] == prompt).all()
  full = np.asarray(jax.jit(module.apply)(variables, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)
  cache = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((2, 14), jnp.int32), decode=True))["cache"]
  if fields.get("scan_layers"):
    assert cache["encoder"]["layers"]["attention"]["cached_key"].shape[-3:] == (2, 14, 8)  # k/v heads, heads first
  else:  # a ring of the window's 6 slots; FoX's layer keeps its gates per slot: the whole context
    slots = [cache["encoder"][f"layer_{i}"]["attention"]["cached_key"].shape[-2] for i in range(8)]
    assert slots == [6, 6, 6, 6, 6, 14, 6, 6]


def test_the_decode_kernels_generate_the_dense_full_forwards_tokens_on_one_device_and_on_a_mesh():
  # the decode kernels' methods (sandwich: on the xla formulas), GQA, a window, positions past the prompt; the
  # reference: the same weights' full forward on the dense xla path. Then on 8 devices: rows over data x fsdp (4),
  # the 2 k/v heads over tensor (2), the decode kernel once per shard, each device holding its part of the cache.
  schedule = "rope,alibi,t5,kerple_power,fire,sandwich,fox"
  module, variables = decoder(num_layers=len(schedule.split(",")), position_schedule=schedule, sliding_window=6,
                              attention_kernel="pallas")
  prompt = jnp.asarray(np.random.default_rng(3).integers(0, 61, (4, 5)), jnp.int32)
  tokens, cached = (np.asarray(x) for x in generate.generate(module, variables, prompt, max_new_tokens=5,
                                                              return_logits=True))
  dense = Transformer(dataclasses.replace(module.config, attention_kernel="xla"), head="lm")
  full = np.asarray(jax.jit(dense.apply)(variables, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)
  with jax.set_mesh(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
    np.testing.assert_array_equal(generate.generate(module, variables, prompt, max_new_tokens=5), tokens)
    program = generate._generate.lower(module, {"params": variables["params"]}, prompt, jnp.ones((4, 5), bool), 5,
                                       0.0, 0, 1.0, jnp.uint32(0), (), False).compile().as_text()
  written = set(re.findall(r"= [a-z0-9]+\[([\d,]*)\]\S* dynamic-update-slice\(", program))
  slots = generate.CACHE_MULTIPLE
  assert f"1,1,{slots},8" in written and f"4,2,{slots},8" not in written  # [B/4, G/2, T, K] per device
  # not asked for the step logits, no [B, N, V] is kept, and the prefill's head reads the last token only: no
  # [B, P, V] (here N = P = 5; a device's row, B/4 = 1)
  assert f"[1,5,{module.config.vocab_size}]" not in program


def test_left_padded_prompts_continue_as_each_prompt_alone():
  # RoPE's positions past the padding, and FoX's cached gate sums with the padding's gates before the prompt
  module, variables = decoder(position_schedule="rope,fox")
  rng = np.random.default_rng(1)
  short, long = rng.integers(0, 61, 3), rng.integers(0, 61, 6)
  batch = np.stack([np.concatenate([[0, 0, 0], short]), long])
  mask = np.array([[0, 0, 0, 1, 1, 1], [1] * 6])
  both = np.asarray(generate.generate(module, variables, batch, attention_mask=mask, max_new_tokens=5))
  alone = np.asarray(generate.generate(module, variables, short[None], max_new_tokens=5))
  np.testing.assert_array_equal(both[0, 6:], alone[0, 3:])
  # the long prompt beside one without padding: the same compiled program as the padded batch's (the mask is an input)
  unpadded = np.asarray(generate.generate(module, variables, np.stack([long, long]), max_new_tokens=5))
  np.testing.assert_array_equal(both[1, 6:], unpadded[1, 6:])


def test_sampling_follows_its_options():
  module, variables = decoder(position="alibi")
  prompt = np.random.default_rng(2).integers(0, 61, (3, 4))
  run = lambda **options: np.asarray(generate.generate(module, variables, prompt, max_new_tokens=12, **options))
  greedy = run()
  np.testing.assert_array_equal(run(temperature=1.0, top_k=1, seed=3), greedy)  # one candidate: the argmax
  np.testing.assert_array_equal(run(temperature=1.0, top_p=1e-6, seed=3), greedy)  # the nucleus of one token
  hot = run(temperature=2.0, seed=3)
  np.testing.assert_array_equal(run(temperature=2.0, seed=3), hot)
  assert (hot != run(temperature=2.0, seed=4)).any() and (hot != greedy).any()
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draws = set(np.asarray(jax.jit(jax.vmap(lambda key: generate.sample(logits, key, 1.0, 0, 0.7)[0]))(
      jax.random.split(jax.random.key(0), 200))).tolist())  # 200 draws, one program
  assert draws == {0, 1}  # 0.5 < 0.7 <= 0.8: the two most likely tokens
  eos = int(greedy[0, 5])  # row 0's second new token, not its first; greedily followed by another token
  assert eos not in greedy[0, 4:5] and greedy[0, 6] != eos
  stopped = np.asarray(generate.generate(module, variables, prompt, max_new_tokens=12, eos_id=eos))
  assert (stopped[0, 5:] == eos).all() and (stopped[0, :6] == greedy[0, :6]).all()


@pytest.mark.parametrize("fields,message", [
    (dict(causal=False), "generate takes a causal Transformer with head='lm'"),
    (dict(position="huang_m1"), "position method 'huang_m1' computes dense logits"),
    (dict(position="tupe_a"), "TUPE's untied term"),
    (dict(position="absolute", max_len=16), "learned table of max_len=16 positions"),
])
def test_what_cannot_decode_is_an_error(fields, message):
  module, variables = decoder(**fields)
  with pytest.raises(ValueError, match=message):
    generate.generate(module, variables, np.zeros((1, 4), np.int32), max_new_tokens=14)


def test_bad_options_are_errors():
  module, variables = decoder()
  for options, message in [(dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
                           (dict(max_new_tokens=2, top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
                           (dict(max_new_tokens=2, temperature=-1.0), "temperature=-1.0 must be >= 0")]:
    with pytest.raises(ValueError, match=message):
      generate.generate(module, variables, np.zeros((1, 4), np.int32), **options)


def random_llama(directory, **fields):
  """A Hugging Face Llama on random weights (every one moved from its initial value), saved in ``directory``."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
      **dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"), **fields}))
  with torch.no_grad():
    for parameter in hf.parameters():
      parameter.add_(0.2 * torch.randn_like(parameter))
  hf.eval().save_pretrained(directory, safe_serialization=True)
  return hf


def test_a_converted_llama_generates_hugging_faces_tokens_and_from_the_command_line(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  from posjax import convert
  from posjax.convert import __main__ as cli
  hf = random_llama(tmp_path / "hf")
  prompt = np.random.default_rng(3).integers(0, 97, (2, 7))
  with torch.no_grad():
    want = hf.generate(torch.from_numpy(prompt), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                       pad_token_id=0).numpy()
  module, variables = convert.from_hf(tmp_path / "hf")
  np.testing.assert_array_equal(np.asarray(generate.generate(module, variables, prompt, max_new_tokens=10)), want)

  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run")]) == 0
  pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(92)]
  (tmp_path / "run" / "vocab.txt").write_text("\n".join(pieces) + "\n")
  assert json.loads((tmp_path / "run" / "model_config.json").read_text())["vocab_size"] == 97
  capsys.readouterr()
  assert generate.main(["--workdir", str(tmp_path / "run"), "--prompt", "w3 w7 w1", "--max_new_tokens", "4"]) == 0
  ids = [pieces.index(p) for p in ("w3", "w7", "w1")]
  with torch.no_grad():  # Hugging Face's tokens, up to its end of sequence (where the command line stops too)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0).numpy()[0]
  assert capsys.readouterr().out.split() == [pieces[i] for i in expected]


LENGTH_DEPENDENT = {  # each crosses its original length while decoding: a prompt of 5 (LongRoPE) or 12 (dynamic)
    "longrope": (5, dict(max_position_embeddings=32, original_max_position_embeddings=8, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 4.0], long_factor=[2.0, 3.0, 6.0, 9.0]))),
    "dynamic": (12, dict(max_position_embeddings=16, rope_scaling=dict(rope_type="dynamic", factor=2.0))),
}


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_length_dependent_scalings_generate_hugging_faces_step_logits_and_tokens(name, tmp_path):
  """LongRoPE and dynamic NTK choose their frequencies from the largest position + 1 in every forward pass, the
  prefill and each decode step (each cached key keeps its own step's): Hugging Face's ``generate``, step by step."""
  torch = pytest.importorskip("torch")
  from posjax import convert
  length, fields = LENGTH_DEPENDENT[name]
  hf = random_llama(tmp_path / "hf", bos_token_id=None, eos_token_id=None, **fields)  # no token stops either
  prompt = np.random.default_rng(4).integers(0, 97, (2, length))
  with torch.no_grad():
    out = hf.generate(torch.from_numpy(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
  want = np.stack([x.numpy() for x in out.logits], axis=1)
  module, variables = convert.from_hf(tmp_path / "hf")
  tokens, logits = generate.generate(module, variables, prompt, max_new_tokens=12, return_logits=True)
  np.testing.assert_allclose(np.asarray(logits), want, atol=2e-4 * np.abs(want).max(), rtol=0)
  np.testing.assert_array_equal(np.asarray(tokens), out.sequences.numpy())


def test_longrope_on_a_packed_row_reads_each_documents_length_as_hugging_face_on_each_document():
  """Documents of 6, 10 and 4 tokens packed in a row of 20, LongRoPE's original length 8: the first and last below
  it (the short factors), the second past it (the long ones), each as Hugging Face's forward on it alone."""
  torch = pytest.importorskip("torch")
  import tempfile
  from posjax import convert
  with tempfile.TemporaryDirectory() as directory:
    hf = random_llama(directory, **LENGTH_DEPENDENT["longrope"][1])
    module, variables = convert.from_hf(directory)
  lengths = (6, 10, 4)
  ids = np.random.default_rng(5).integers(0, 97, (1, sum(lengths)))
  starts = np.cumsum((0,) + lengths)
  with torch.no_grad():
    want = np.concatenate([hf(torch.from_numpy(ids[:, a:b])).logits.numpy() for a, b in zip(starts, starts[1:])],
                          axis=1)
  positions = np.concatenate([np.arange(n) for n in lengths])[None]
  segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None]
  got = jax.jit(module.apply)(variables, jnp.asarray(ids), positions=jnp.asarray(positions),
                              segment_ids=jnp.asarray(segments)).logits
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4 * np.abs(want).max(), rtol=0)


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory):
  """A decoder run's workdir as training leaves it, without the training: model_config.json (ALiBi, max_len 16), a
  checkpoint of :func:`decoder`'s parameters and a vocab.txt of its 61 ids."""
  workdir = tmp_path_factory.mktemp("decoder_run")
  module, variables = decoder(position="alibi", max_len=16)
  (workdir / "model_config.json").write_text(json.dumps(module.config.to_dict()))
  saver = checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=1, async_save=False)
  saver.save(0, {"step": jnp.zeros((), jnp.int32), "params": nn.unbox(variables["params"])}, {})
  saver.close()
  (workdir / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                               + [f"w{i}" for i in range(56)]) + "\n")
  return workdir


def test_the_command_line_warns_once_of_prompt_pieces_read_as_unk_and_once_of_positions_past_the_runs_length(
    decoder_run, capsys):
  prompt = " ".join(["w3 zq"] + ["w7"] * 78)  # 80 tokens, one of them [UNK], 5x the run's 16
  assert generate.main(["--workdir", str(decoder_run), "--prompt", prompt, "--max_new_tokens", "2"]) == 0
  assert capsys.readouterr().err.splitlines() == [
      "warning: --prompt has 1 piece(s) the run's vocabulary does not hold, each read as [UNK]: 'zq'",
      "warning: the prompt's 80 tokens and --max_new_tokens=2 read 81 positions, 5.1x the 16 the run trained at; "
      "past them the continuation rests on how alibi extrapolates"]


def test_generate_on_an_encoder_run_says_it_needs_a_decoder_run(tmp_path, capsys):
  (tmp_path / "model_config.json").write_text(json.dumps(TransformerConfig.tiny().to_dict()))
  (tmp_path / "config.json").write_text(json.dumps({"task": "mlm"}))
  assert generate.main(["--workdir", str(tmp_path), "--prompt", "w3"]) == 2
  assert capsys.readouterr().err == (f"error: {tmp_path}: this workdir holds an encoder (mlm) run; generate needs a "
                                     "decoder run (configs/lm.py)\n")
  # a decoder fine-tuned for GLUE has a classifier, not a language model's head: for generate and for the export
  from posjax.convert import __main__ as cli
  (tmp_path / "model_config.json").write_text(json.dumps(TransformerConfig.decoder(num_layers=1).to_dict()))
  (tmp_path / "config.json").write_text(json.dumps({"task": "glue"}))
  assert generate.main(["--workdir", str(tmp_path), "--prompt", "w3"]) == 2
  assert "holds a decoder fine-tuned for glue (its head, not a language model's)" in capsys.readouterr().err
  out = tmp_path.parent / f"{tmp_path.name}_hf"
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path), "--out", str(out)]) == 2
  assert "holds a causal model fine-tuned for glue" in capsys.readouterr().err and not out.exists()
