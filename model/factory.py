"""Which decoder class a config builds: ``architecture`` -> Gemma3 or Llama."""

from __future__ import annotations

from flax import nnx

from model.config import ModelConfig


def build_model(cfg: ModelConfig, *, params: dict | None = None, rngs: nnx.Rngs | None = None,
                **kwargs) -> nnx.Module:
    """The decoder for ``cfg`` with ``params`` (or random weights from ``rngs``).

    kwargs: ``dtype`` (weights and matmul inputs). What depends on the platform is
    not the model's: it is passed to each call (``model.compute``).
    """
    if cfg.architecture == "gemma3":
        from model.gemma3 import Gemma3

        return Gemma3(cfg, params=params, rngs=rngs, **kwargs)
    from model.llama import Llama

    return Llama(cfg, params=params, rngs=rngs, **kwargs)


def abstract_params(cfg: ModelConfig, dtype="float32", **kwargs) -> dict[str, tuple]:
    """Every parameter of the model ``build_model(cfg, dtype=dtype)`` would build, without
    allocating it: ``{name: (shape, dtype, logical axes)}`` (``jax.eval_shape`` of the
    random initialiser; norms and the router stay float32 whatever ``dtype``)."""
    import jax.numpy as jnp

    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype),
                                               **kwargs))
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[".".join(map(str, path))] = (tuple(v.get_value().shape), jnp.dtype(v.get_value().dtype),
                                         tuple(v.get_metadata()["logical_axes"]))
    return out


def quantized_copy(model: nnx.Module, quantization: str = "int8") -> nnx.Module:
    """The decoder ``model`` with its matmul weights in ``quantization`` (``model.layers.set_params``:
    per-channel int8 from ``model``'s own values), as ``--quantization int8`` would load it.

    The copy keeps ``model``'s config and dtype and shares its float32 lookup table
    (``embed_lookup``) rather than holding a second one; every other parameter is new.

    Raises:
      ValueError: what ``build_model`` raises for it (int8 for a mixture of experts).
    """
    params = {}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if len(path) != 1:
            raise ValueError(f"quantized_copy needs a decoder of top-level parameters, found {path}")
        if path[0] != "embed_lookup":
            params[str(path[0])] = v.get_value()
    copy = build_model(model.cfg, params=params, dtype=model.dtype, quantization=quantization)
    shared = getattr(model, "embed_lookup", None)
    if copy.embed_lookup is not None and shared is not None:
        copy.embed_lookup = copy.embed_lookup.replace(shared.get_value())
    return copy
