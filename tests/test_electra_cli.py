"""``python -m posjax.convert hf-to-posjax`` refuses a model type it does not convert. (An ELECTRA run's way out to
Hugging Face and back: tests/test_electra_run.py, on that module's run.)"""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from posjax.convert import __main__ as cli  # noqa: E402


def test_hf_to_posjax_refuses_a_model_type_it_does_not_convert(tmp_path, capsys):
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "roberta"}))
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run")]) == 2
  error = capsys.readouterr().err
  assert ("has model_type='roberta'; hf-to-posjax converts BERT ('bert'), ModernBERT ('modernbert'), ELECTRA ('electra') "
          "and the decoders") in error
