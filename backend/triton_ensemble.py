"""The ensemble's two stateless ends: ``preprocessing`` (tokenize) and ``postprocessing``
(detokenize). ``pb_utils`` is passed in by the thin ``model.py`` files; see ``triton_model`` for
the decoupled generation model between them.

Both load the tokenizer of the target checkpoint named by an engine configuration (model
parameter ``engine_config``, relative to the model's version directory), so the three models
always agree on the vocabulary.

Postprocessing is stateless, yet streamed text must be decoded across token boundaries (a
byte-level BPE token can end inside a multi-byte character, and some decoders treat a leading
token differently). ``nightdraft_tokens`` therefore sends a window of ids whose first
``output_offset`` ids were already decoded; the new text is ``decode(window)`` minus
``decode(window[:offset])``, the same rule as the engine's incremental detokenizer.
"""
from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from backend.engine_config import EngineConfig
from backend.tokenizer import Tokenizer

log = logging.getLogger("nightdraft.triton")


def _load_tokenizer(pb: Any, args: dict[str, str]) -> tuple[Tokenizer, dict]:
    model_config = json.loads(args["model_config"])
    params = model_config.get("parameters") or {}
    rel = (params.get("engine_config") or {}).get("string_value") or "../../nightdraft/1/engine.json"
    path = Path(rel)
    if not path.is_absolute():
        path = Path(args["model_repository"]) / str(args["model_version"]) / path
    try:
        config = EngineConfig.from_file(path)
    except Exception as e:
        raise pb.TritonModelException(f"{args.get('model_name')}: cannot read {path}: {e}") from None
    tok = Tokenizer.from_pretrained(config.target)
    return tok, model_config


def _error(pb: Any, message: str) -> Any:
    try:
        err = pb.TritonError(message, pb.TritonError.INVALID_ARG)
    except (TypeError, AttributeError):
        err = pb.TritonError(message)
    return pb.InferenceResponse(output_tensors=[], error=err)


def _respond_each(pb: Any, requests, handle, what: str) -> list:
    """One response per request: `handle(request)`'s tensors, or an error naming the problem."""
    responses = []
    for request in requests:
        try:
            responses.append(pb.InferenceResponse(output_tensors=handle(request)))
        except (ValueError, UnicodeDecodeError) as e:
            responses.append(_error(pb, str(e)))
        except Exception as e:
            log.error("%s failed:\n%s", what, traceback.format_exc())
            responses.append(_error(pb, f"internal error: {type(e).__name__}: {e}"))
    return responses


def make_preprocessing_model(pb_utils: Any) -> type:
    pb = pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.tokenizer, _ = _load_tokenizer(pb, args)

        def execute(self, requests):
            return _respond_each(pb, requests, self._tokenize, "preprocessing")

        def _tokenize(self, request):
            t = pb.get_input_tensor_by_name(request, "text_input")
            if t is None:
                raise ValueError("missing required input 'text_input'")
            flat = np.asarray(t.as_numpy()).reshape(-1)
            if flat.size != 1:
                raise ValueError(f"input 'text_input' must hold exactly one string, got {flat.size}")
            v = flat[0]
            text = v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)
            if not text:
                raise ValueError("input 'text_input' is empty")
            ids = self.tokenizer.encode(text)
            if not ids:
                raise ValueError("input 'text_input' encodes to no tokens")
            return [pb.Tensor("input_ids", np.array(ids, dtype=np.int32)),
                    pb.Tensor("input_lengths", np.array([len(ids)], dtype=np.int32))]

    return TritonPythonModel


def make_postprocessing_model(pb_utils: Any) -> type:
    pb = pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.tokenizer, _ = _load_tokenizer(pb, args)

        def execute(self, requests):
            return _respond_each(pb, requests, self._detokenize, "postprocessing")

        def _detokenize(self, request):
            t = pb.get_input_tensor_by_name(request, "output_ids")
            if t is None:
                raise ValueError("missing required input 'output_ids'")
            ids = [int(x) for x in np.asarray(t.as_numpy()).reshape(-1)]
            offset = 0
            o = pb.get_input_tensor_by_name(request, "output_offset")
            if o is not None:
                offset = int(np.asarray(o.as_numpy()).reshape(-1)[0])
            offset = max(0, min(offset, len(ids)))
            full = self.tokenizer.decode(ids)
            done = self.tokenizer.decode(ids[:offset]) if offset else ""
            text = full[len(done):] if len(full) >= len(done) else ""
            return [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]

    return TritonPythonModel
