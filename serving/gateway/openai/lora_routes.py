"""LoRA adapters at run time, vLLM's routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

- ``load_lora_adapter``: ``{"lora_name", "lora_path", "base_model"?}`` serves the PEFT
  adapter folder ``lora_path`` (on the server's machine) as model ``lora_name`` over the
  base model (``base_model``, or the one model that serves LoRA); it is listed by
  ``/v1/models`` with its ``parent`` from then on. 400 for a name already served or a
  folder that cannot be served (the message says why: DoRA, ``modules_to_save``, a rank
  above ``--max-lora-rank``, ...), 404 for an unknown ``base_model``, 400 when no served
  model takes adapters.
- ``unload_lora_adapter``: ``{"lora_name"}`` stops serving it. 404 for a name that is no
  adapter; 409 ``lora_in_use`` while requests run on it (the adapter is never dropped
  under a running request). KV pages computed with it are never reused, not even by
  other weights loaded later under the same name (the engine salts them with the
  adapter's digest).

Admin keys only (403 ``forbidden`` otherwise; the anonymous caller of an open server is no
admin). ``lora_path`` must lie under the server's ``--lora-root`` (a relative path is taken
under it; symbolic links are resolved first, on the gateway's machine): 400
``lora_path_outside_root`` otherwise, the same answer whether or not the path exists, so the
route is no file-existence oracle; without a root, 403 ``lora_loading_disabled``. Errors in
OpenAI's shape. The engine
does the loading (``EngineLoop.load_lora``; an engine takes adapters when its ``serves_lora``);
behind ``serve --engines`` the router sends the load or unload to every replica up that takes
adapters (``Router.load_lora``: one refusing a load undoes it on the others), and the gateway
lists what the replicas report (``OpenAIServing.follow_adapters``).
"""

from __future__ import annotations

import os

from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from serving.contract.engine_client import LoraInUseError
from serving.gateway.accounts.api_keys import Principal
from serving.gateway.http.errors import OpenAIError, model_not_found
from serving.gateway.http.openapi import error_responses, json_request_body
from serving.gateway.openai.openai_serving import OpenAIServing, read_json
from serving.gateway.openai.served_model import ServedModel, adapter_model
from serving.gateway.schema.protocol import Text, _Request


class LoadLoraRequest(_Request):
    """``POST /v1/load_lora_adapter``."""

    lora_name: Text
    lora_path: Text
    base_model: Text | None = None


class UnloadLoraRequest(_Request):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: Text


def _admin(caller: Principal) -> None:
    if not caller.is_admin:
        raise OpenAIError("Only admin keys may load or unload LoRA adapters.", status_code=403,
                          code="forbidden")


def lora_path_under(root: str | os.PathLike | None, path: str) -> str:
    """The path an adapter is loaded from: `path` (relative ones taken under `root`), its
    symbolic links resolved, when it lies under `root`.

    Raises:
      OpenAIError: 403 ``lora_loading_disabled`` without a root; 400 ``lora_path_outside_root``
        for a path outside it (whether or not it exists).
    """
    if root is None:
        raise OpenAIError("This server loads no LoRA adapters at run time: start it with "
                          "--lora-root DIR to allow adapters under DIR.", status_code=403,
                          code="lora_loading_disabled")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise OpenAIError("`lora_path` must name a folder under the server's --lora-root.",
                          param="lora_path", code="lora_path_outside_root")
    return real


def _base(serving: OpenAIServing, name: str | None) -> ServedModel:
    """The base model an adapter is loaded over (``name``, or the only one that takes LoRA)."""
    if name is not None:
        served = serving.models.get(name)
        if served is None or served.lora_name is not None:
            raise model_not_found(name)
        if not getattr(served.engine, "serves_lora", False):
            raise OpenAIError(f"The model `{name}` serves no LoRA adapters.", param="base_model",
                              code="lora_not_supported")
        return served
    bases = [m for m in serving.models.values() if m.lora_name is None and getattr(m.engine, "serves_lora", False)]
    if len(bases) != 1:
        raise OpenAIError("No served model takes LoRA adapters here (started without --max-loras or "
                          "--lora-modules; behind a router: no replica was)"
                          if not bases else "Several models take LoRA adapters: name one as `base_model`.",
                          param="base_model", code="lora_not_supported")
    return bases[0]


def install_lora_routes(app: FastAPI, serving: OpenAIServing, principal,
                        lora_root: str | os.PathLike | None = None) -> None:
    """Adds the two routes; they change ``serving.models`` (what requests and ``/v1/models`` see).

    Args:
      lora_root: the folder adapters may be loaded from (None: run-time loads are refused).
    """

    @app.post("/v1/load_lora_adapter", openapi_extra=json_request_body(LoadLoraRequest),
              responses=error_responses(400, 401, 403, 404, 413, 415))
    async def load_lora_adapter(request: Request, caller: Principal = Depends(principal)) -> Response:
        _admin(caller)
        req = LoadLoraRequest.model_validate(await read_json(request))
        serving.follow_adapters()
        base = _base(serving, req.base_model)
        path = lora_path_under(lora_root, req.lora_path)
        if req.lora_name in serving.models:
            raise OpenAIError(f"A model named `{req.lora_name}` is already served.", param="lora_name",
                              code="lora_name_taken")
        try:
            await base.engine.load_lora(req.lora_name, path)
        except ValueError as e:  # LoraAdapterError: the folder cannot be served, and why
            raise OpenAIError(str(e), param="lora_path", code="invalid_lora_adapter") from None
        serving.models[req.lora_name] = adapter_model(base, req.lora_name)
        serving.services.metering.prices.parents[req.lora_name] = base.name
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "parent": base.name,
                             "status": "loaded"})

    @app.post("/v1/unload_lora_adapter", openapi_extra=json_request_body(UnloadLoraRequest),
              responses=error_responses(400, 401, 403, 404, 409, 413, 415))
    async def unload_lora_adapter(request: Request, caller: Principal = Depends(principal)) -> Response:
        _admin(caller)
        req = UnloadLoraRequest.model_validate(await read_json(request))
        serving.follow_adapters()
        served = serving.models.get(req.lora_name)
        if served is None or served.lora_name is None:
            raise OpenAIError(f"No LoRA adapter named `{req.lora_name}` is served.", status_code=404,
                              param="lora_name", code="lora_not_found")
        try:
            await served.engine.unload_lora(served.lora_name)
        except LoraInUseError as e:
            raise OpenAIError(f"{e}; retry once they finish.", status_code=409, param="lora_name",
                              code="lora_in_use") from None
        except KeyError:
            pass  # already gone from the engine: drop the name here too
        serving.models.pop(req.lora_name, None)
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"})
