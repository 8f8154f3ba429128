"""``xlaserve convert``: an orbax checkpoint, with its config, tokenizer and chat template, from a
GGUF, a Hugging Face checkpoint or a named model.

    xlaserve convert path/to/model.gguf OUT_DIR       # orbax checkpoint + config + tokenizer
    xlaserve convert path/to/hf_dir OUT_DIR            # a Hugging Face checkpoint (or a Hub id)
    xlaserve convert tiny-moe OUT_DIR                  # a random model from configs/models.yaml
    xlaserve serve --checkpoint OUT_DIR --mesh data=1,tensor=4,expert=1
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

log = logging.getLogger("xlaserve")


def register(sub) -> None:
    """Adds the ``convert`` subcommand to the CLI's subparsers."""
    conv = sub.add_parser("convert", help="write an orbax checkpoint (with config, tokenizer and chat "
                                          "template) from a GGUF, a Hugging Face checkpoint or a "
                                          "named model")
    conv.add_argument("source", help="a .gguf path, a Hugging Face checkpoint directory, a Hub id "
                                     "(org/name), or a name from configs/models.yaml")
    conv.add_argument("out_dir", help="output directory (created; must not hold a checkpoint)")
    conv.add_argument("--name", help="the model name the checkpoint serves as (default: the "
                      "configs/models.yaml name, the GGUF file's stem, the directory's name or the Hub id)")
    conv.add_argument("--revision", help="a Hub id's branch, tag or commit (default: main)")
    conv.set_defaults(func=cmd_convert)



def _tokenizer_files(directory) -> dict[str, bytes]:
    """The tokenizer and chat-template files a directory holds ({name: bytes}), verbatim."""
    from pathlib import Path

    from model.checkpoint import TOKENIZER_FILES

    directory = Path(directory)
    return {f: (directory / f).read_bytes() for f in TOKENIZER_FILES if (directory / f).is_file()}


def cmd_convert(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from model.checkpoint import save_checkpoint
    from serving.loading.model_registry import known_models
    from serving.loading.model_source import resolve_model

    t0 = time.perf_counter()
    models = known_models()
    source = resolve_model(args.source, revision=getattr(args, "revision", None), registry=models)
    tok, tok_files = None, None
    if source.is_hf:
        from model.safetensors_loader import load_hf_checkpoint
        from serving.loading.model_registry import hf_tokenizer

        hf_tokenizer(source.path)  # refuse a directory without a usable tokenizer before reading weights
        cfg, params = load_hf_checkpoint(source.path, "float32", name=source.name)
        tok_files = _tokenizer_files(source.path)
        spm_file = Path(source.path) / "tokenizer.model"
        if "tokenizer.json" not in tok_files and spm_file.is_file():  # a SentencePiece-only checkpoint
            tok = spm_file.read_bytes()
    elif source.kind == "gguf" or models[args.source].get("source") == "gguf-package":
        import importlib

        from model.bpe_tokenizer import BPETokenizer
        from model.gguf_loader import load_gguf
        from serving.config.server_config import cache_dir
        from serving.loading.model_registry import gguf_tokenizer

        if source.kind == "gguf":
            path, weights_cache = source.path, None
        else:
            path = importlib.import_module(models[args.source]["package"]).assemble()
            weights_cache = cache_dir("weights")
        cfg, params = load_gguf(path, name=source.name, cache_dir=weights_cache)
        try:
            gtok = gguf_tokenizer(path)
        except ValueError as e:
            # A vocabulary xlaserve cannot rebuild (an unknown tokenizer.ggml.model or
            # tokenizer.ggml.pre) is not converted.
            log.warning("tokenizer not converted: the checkpoint holds weights only, and "
                        "serve/generate will refuse it: %s", e)
            gtok = None
        if isinstance(gtok, BPETokenizer):
            with tempfile.TemporaryDirectory() as d:  # tokenizer files and the GGUF's chat template
                tok_files = _tokenizer_files(gtok.save(d))
        elif gtok is not None:
            tok = gtok.serialized_model
    elif models[args.source].get("source") == "random":
        from flax import nnx

        from model.config import ModelConfig
        from model.factory import build_model
        from model.tokenizer import Tokenizer

        spec = models[args.source]
        cfg = ModelConfig.from_dict(spec["config"])
        model = build_model(cfg, rngs=nnx.Rngs(int(spec.get("seed", 0))))
        params = {".".join(map(str, p)): v.get_value()
                  for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        tok = Tokenizer.tiny(cfg.vocab_size).serialized_model
    else:
        raise ValueError(f"convert: model {args.source!r}: unknown source "
                         f"{models[args.source].get('source')!r}")
    if getattr(args, "name", None):
        cfg = dataclasses.replace(cfg, name=args.name)
    out = save_checkpoint(args.out_dir, cfg, params, tokenizer_model=tok, tokenizer_files=tok_files)
    print(f"wrote {out} ({cfg.name}, {len(params)} arrays) in {time.perf_counter() - t0:.1f} s")
    return 0
