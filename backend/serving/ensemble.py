"""The ensemble's two stateless ends: ``preprocessing`` (tokenize) and ``postprocessing``
(detokenize); ``model`` serves the decoupled generation model between them.

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

import functools
import logging
import traceback
from typing import Any, Callable

import numpy as np

from backend.model.tokenizer import Tokenizer
from backend.serving.config import ModelArgs, prompt_byte_limit, tokenizer_dir
from backend.serving.inputs import check_size, input_int, scalar
from backend.serving.responses import error_response
from backend.values import to_str

log = logging.getLogger("nightdraft.triton")

DEFAULT_ENGINE_CONFIG = "../../nightdraft/1/engine.json"


def ensemble_model(pb_utils: Any, role: str) -> type:
    """The ``TritonPythonModel`` class of ``preprocessing`` or ``postprocessing``."""
    class TritonPythonModel:
        pb = pb_utils

        def initialize(self, args: dict[str, str]) -> None:
            margs = ModelArgs(self.pb, args)
            self.tokenizer = Tokenizer.from_pretrained(tokenizer_dir(margs, DEFAULT_ENGINE_CONFIG))
            if role == "preprocessing":
                limit = prompt_byte_limit(margs, DEFAULT_ENGINE_CONFIG, self.tokenizer.max_token_bytes)
                self.step = functools.partial(tokenize, max_bytes=limit)
            else:
                self.step = detokenize

        def execute(self, requests: list[Any]) -> list[Any]:
            return respond_each(self.pb, requests, lambda r: self.step(self.pb, self.tokenizer, r), role)

    return TritonPythonModel


def respond_each(pb: Any, requests: list[Any], handle: Callable[[Any], list], what: str) -> list:
    """One response per request: ``handle(request)``'s tensors, or an error naming the problem."""
    responses = []
    for request in requests:
        try:
            responses.append(pb.InferenceResponse(output_tensors=handle(request)))
        except ValueError as e:   # InvalidRequest and UnicodeDecodeError among them
            responses.append(error_response(pb, str(e), "INVALID_ARG"))
        except Exception as e:
            log.error("%s failed:\n%s", what, traceback.format_exc())
            responses.append(error_response(pb, f"internal error: {type(e).__name__}: {e}", "INVALID_ARG"))
    return responses


def tokenize(pb: Any, tokenizer: Tokenizer, request: Any, max_bytes: int | None = None) -> list:
    """text_input -> input_ids, input_lengths; text over ``max_bytes`` is refused untokenized
    (this model has one instance: one huge text would hold up every request behind it)."""
    t = pb.get_input_tensor_by_name(request, "text_input")
    if t is None:
        raise ValueError("missing required input 'text_input'")
    raw = scalar(t, "text_input")
    if max_bytes is not None:
        check_size("the prompt", raw, max_bytes, "max_prompt_bytes")
    text = to_str("input 'text_input'", raw)
    if not text:
        raise ValueError("input 'text_input' is empty")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("input 'text_input' encodes to no tokens")
    return [pb.Tensor("input_ids", np.array(ids, dtype=np.int32)),
            pb.Tensor("input_lengths", np.array([len(ids)], dtype=np.int32))]


def detokenize(pb: Any, tokenizer: Tokenizer, request: Any) -> list:
    """A window of ids whose first output_offset were decoded before -> the new text."""
    t = pb.get_input_tensor_by_name(request, "output_ids")
    if t is None:
        raise ValueError("missing required input 'output_ids'")
    ids = [int(x) for x in np.asarray(t.as_numpy()).reshape(-1)]
    offset = max(0, min(input_int(pb, request, "output_offset") or 0, len(ids)))
    full = tokenizer.decode(ids)
    done = tokenizer.decode(ids[:offset]) if offset else ""
    text = full[len(done):] if len(full) >= len(done) else ""
    return [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
