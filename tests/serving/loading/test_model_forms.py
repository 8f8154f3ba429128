"""The ``--model`` forms (serving/loading/model_source.py): registry name, GGUF file, Hugging Face
checkpoint directory, Hub id from a pre-filled huggingface_hub cache (``HF_HUB_OFFLINE=1``, no
network); ``xlaserve convert`` of a Hugging Face directory and a BPE GGUF keeping tokenizer and
chat template; ``shard-plan`` of a directory. Tiny checkpoints: ``tests/data/hf_tiny/llama`` plus
a character tokenizer (tests/support/hf_dir_fixtures.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.chat_template_source import TemplatedTokenizer, load_checkpoint_chat_template
from model.hf_config import read_hf_config
from serving.cli.main import main
from serving.cli.shard_plan import plan_model_config
from serving.config.server_config import load_server_config
from serving.loading.mesh_loader import load_for_serving
from serving.loading.model_registry import hf_tokenizer, load_model
from serving.loading.model_source import ModelSource, resolve_model, stored_quantized
from tests.support import hf_dir_fixtures as hfx
from tests.support.hf_dir_fixtures import _hf_dir, _params
from tests.support.paths import REPO_ROOT

DIALOG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|eot_id|> there"}]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_each_form_resolves_and_anything_else_lists_them(tmp_path):
    d = _hf_dir(tmp_path)
    gguf = tmp_path / "some-model.gguf"
    gguf.write_bytes(b"GGUF")  # resolution does not read it
    assert resolve_model("tiny-random") == ModelSource("registry", "tiny-random", "tiny-random")
    assert resolve_model(str(gguf)) == ModelSource("gguf", str(gguf), "some-model", gguf)
    assert resolve_model(str(d)) == ModelSource("hf", str(d), "tiny-llama-hf", d)
    with pytest.raises(ValueError, match=r"unknown model 'nonsense': use a model name from "
                       r"configs/models.yaml \(gemma-3-270m, .*tiny-random\), a path to a \.gguf file, "
                       r"a Hugging Face checkpoint directory .*, or a Hugging Face Hub id \(org/name\)"):
        resolve_model("nonsense")
    with pytest.raises(ValueError, match="no such .gguf file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "orbax" / "params").mkdir(parents=True)
    (tmp_path / "orbax" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="orbax\\) checkpoint: serve it with --checkpoint"):
        resolve_model(str(tmp_path / "orbax"))
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        resolve_model(str(d))
    with pytest.raises(ValueError, match="--revision 'v1' applies to a Hugging Face Hub id"):
        resolve_model("tiny-random", revision="v1")


def test_cli_names_the_forms_for_an_unknown_model(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "Hugging Face Hub id (org/name)" in err
    # --revision (the server key `revision`) reaches the resolution
    assert main(["generate", "hi", "--model", "tiny-random", "--revision", "v2"]) == 2
    assert "--revision 'v2' applies to a Hugging Face Hub id" in capsys.readouterr().err


def test_hf_directory_serves_its_tokenizer_and_template(tmp_path):
    """load_model(DIR): named after the directory; tokenizer.json with generation_config.json's
    EOS ids; the checkpoint's chat template, where a control token typed in a message stays
    text; --chat-template overrides it."""
    d = _hf_dir(tmp_path)
    model, tok = load_model(str(d), progress=False)
    assert model.cfg.name == "tiny-llama-hf" and model.cfg.vocab_size == 256 == tok.vocab_size
    plain = hf_tokenizer(d, 256)
    eot, eos = plain.token_id("<|eot_id|>"), plain.token_id("<|end_of_text|>")
    assert set(tok.stop_token_ids) == {eos, eot}
    assert isinstance(tok, TemplatedTokenizer)
    ids = tok.apply_chat_template(DIALOG)
    assert ids[0] == plain.bos_id and ids.count(eot) == 2  # the two messages' markup only
    rendered = load_checkpoint_chat_template(d).render(DIALOG)
    assert plain.backend.decode(ids, skip_special_tokens=False) == rendered
    override = tmp_path / "plain.jinja"
    override.write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    _, tok2 = load_model(str(d), progress=False, chat_template=str(override))
    assert tok2.apply_chat_template(DIALOG) == [*plain.encode("Be brief."), eos,
                                                *plain.encode("hi <|eot_id|> there"), eos]


def test_convert_hf_directory_then_serve_the_checkpoint(tmp_path):
    """convert DIR OUT copies the tokenizer files and template beside the orbax arrays;
    serve --checkpoint OUT restores the same parameters and tokenizer, template included."""
    d = _hf_dir(tmp_path)
    assert main(["convert", str(d), str(tmp_path / "ckpt")]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ckpt" / f).read_bytes() == (d / f).read_bytes(), f
    ref_model, ref_tok = load_model(str(d), progress=False)
    model, tok, mesh = load_for_serving(load_server_config(checkpoint=str(tmp_path / "ckpt"),
                                                           dtype="float32"))
    assert mesh is None and model.cfg == ref_model.cfg
    got, want = _params(model), _params(ref_model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert tok.apply_chat_template(DIALOG) == ref_tok.apply_chat_template(DIALOG)
    assert tok.encode("hello", add_bos=True) == ref_tok.encode("hello", add_bos=True)
    assert tok.stop_token_ids == ref_tok.stop_token_ids


def test_bpe_gguf_serves_and_converts_with_its_chat_template(tmp_path, monkeypatch):
    """A Llama-architecture GGUF with a "gpt2" vocabulary and a tokenizer.chat_template serves
    that template (it used to fall back to Gemma's and fail), and convert keeps both."""
    from tests.support import bpe_fixtures as bf
    from tests.support.bpe_fixtures import _bpe_gguf

    monkeypatch.setenv("XLASERVE_DATA_DIR", str(tmp_path / "data"))
    base = bf.tiny_tokenizer(tmp_path)
    path = _bpe_gguf(tmp_path, base, "llama-bpe", chat_template=hfx.llama3_chat_template())
    _, tok = load_model(str(path), progress=False)
    ids = tok.apply_chat_template(DIALOG)
    eot = base.token_id("<|eot_id|>")
    assert ids[0] == base.bos_id and ids.count(eot) == 2
    assert base.backend.decode(ids, skip_special_tokens=False).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert main(["convert", str(path), str(tmp_path / "ckpt")]) == 0
    assert "chat_template" in json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    _, ctok, _ = load_for_serving(load_server_config(checkpoint=str(tmp_path / "ckpt")))
    assert ctok.apply_chat_template(DIALOG) == ids


def test_shard_plan_reads_a_directory_config(tmp_path, capsys):
    d = _hf_dir(tmp_path)
    assert plan_model_config(str(d)) == read_hf_config(d)
    assert main(["shard-plan", "--model", str(d), "--device", "h200", "--slots", "2", "--max-len", "64"]) == 0
    assert "model tiny-llama-hf on mesh data=1,tensor=1,expert=1" in capsys.readouterr().out


def _fill_hub_cache(hf_home: Path, repo_id: str, source: Path) -> Path:
    """A huggingface_hub cache holding ``repo_id`` at :data:`COMMIT` with ``refs/main`` pointing
    to it: the layout the library documents (``hub/models--org--name/{blobs,refs,snapshots}``,
    snapshot files linked to their blobs), its folder name from the library itself."""
    from huggingface_hub.file_download import repo_folder_name

    repo = hf_home / "hub" / repo_folder_name(repo_id=repo_id, repo_type="model")
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(p for p in source.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_hub_id_resolves_from_the_cache_offline(tmp_path):
    """With HF_HUB_OFFLINE=1 and a pre-filled cache under HF_HOME, ``--model org/name`` (and
    ``--revision COMMIT``) loads the cached snapshot, served under the hub id; an id the cache
    lacks is a clear error. Run in a subprocess: huggingface_hub reads its environment on import."""
    from huggingface_hub import scan_cache_dir

    snap = _fill_hub_cache(tmp_path / "hf", "acme/tiny-llama", _hf_dir(tmp_path))
    (scan,) = scan_cache_dir(tmp_path / "hf" / "hub").repos  # the library reads the layout back
    assert scan.repo_id == "acme/tiny-llama" and {r.commit_hash for r in scan.revisions} == {COMMIT}
    code = """
import json
from serving.loading.model_registry import load_model
from serving.loading.model_source import resolve_model
from serving.cli.shard_plan import plan_model_config
out = {}
src = resolve_model("acme/tiny-llama")
out["kind"], out["name"], out["path"] = src.kind, src.name, str(src.path)
out["at_commit"] = str(resolve_model("acme/tiny-llama", revision="%s").path)
model, tok = load_model("acme/tiny-llama", progress=False)
out["model_name"] = model.cfg.name
out["chat"] = len(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
out["plan_layers"] = plan_model_config("acme/tiny-llama").num_layers
for bad in ("acme/absent", ):
    try:
        resolve_model(bad)
    except ValueError as e:
        out["absent"] = str(e)
print(json.dumps(out))
""" % COMMIT
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env.pop("HF_HUB_CACHE", None)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["kind"] == "hub" and out["name"] == out["model_name"] == "acme/tiny-llama"
    assert Path(out["path"]) == Path(out["at_commit"]) == snap
    assert out["chat"] > 5 and out["plan_layers"] == 2
    assert out["absent"].startswith("cannot fetch the Hugging Face Hub model 'acme/absent'")


def test_sentencepiece_only_directory_serves_and_converts(tmp_path):
    """A Hugging Face directory whose tokenizer is only a SentencePiece tokenizer.model (Mistral's
    v3, from mistral-common) loads with it and its template, and convert keeps it for
    serve --checkpoint."""
    import mistral_common

    from model.tokenizer import Tokenizer

    spm = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    d = hfx.write_llama_checkpoint(tmp_path / "tiny-mistral-spm", 32768, hidden=32, head_dim=16, ffn=32)
    shutil.copyfile(spm, d / "tokenizer.model")
    template = "{{ bos_token }}{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    dialog = [{"role": "user", "content": "hi [INST] there"}]
    plain = Tokenizer.from_file(spm)
    want = [1, 3, *plain.encode("hi [INST] there"), 4]  # the typed [INST] stays text
    _, tok = load_model(str(d), progress=False)
    assert isinstance(tok, TemplatedTokenizer) and tok.apply_chat_template(dialog) == want
    assert main(["convert", str(d), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.model").read_bytes() == spm.read_bytes()
    _, tok2, _ = load_for_serving(load_server_config(checkpoint=str(tmp_path / "ckpt"), dtype="float32"))
    assert tok2.apply_chat_template(dialog) == want and tok2.stop_token_ids == (2,)


def _one_tensor_gguf(path: Path, qtype, experts: int = 0) -> Path:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    if experts:
        w.add_expert_count(experts)
    data = np.ones((2, 32), np.float32)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_stored_quantized_tells_block_files_from_float_ones(tmp_path):
    """What the default --quantization asks (BackendPolicy.default_quantization): a GGUF with a
    block-quantized tensor, or a registry GGUF package, is stored quantized; an F32 / F16 GGUF,
    a quantized mixture-of-experts GGUF, a random registry model, a directory and a file that is
    no GGUF are not."""
    from gguf import GGMLQuantizationType as T

    assert stored_quantized(str(_one_tensor_gguf(tmp_path / "q8.gguf", T.Q8_0)))
    assert not stored_quantized(str(_one_tensor_gguf(tmp_path / "f16.gguf", T.F16)))
    # a mixture of experts is refused int8 weights: never "stored quantized" for the default
    assert not stored_quantized(str(_one_tensor_gguf(tmp_path / "moe.gguf", T.Q8_0, experts=4)))
    assert stored_quantized("gemma-3-270m") and not stored_quantized("tiny-random")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")  # a header that ends early: the loader reports it
    assert not stored_quantized(str(tmp_path / "bad.gguf"))
    assert not stored_quantized(str(tmp_path)) and not stored_quantized("org/name")
