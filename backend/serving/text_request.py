"""The request schema of Triton's vLLM backend (model ``nightdraft``).

Inputs: ``text_input`` (required), ``stream``, ``sampling_parameters`` (JSON; numbers may be
strings), ``exclude_input_in_output``, ``return_finish_reason``, ``return_cumulative_logprob``,
``return_logprobs``, ``return_num_input_tokens``, ``return_num_output_tokens``, ``max_tokens``;
``ignore_eos`` and ``min_tokens`` as tensors too (genai-perf's ``--extra-inputs``). Request
parameters (``/generate``'s ``"parameters"``) are read as well: ``sampling_parameters`` wins over
them and the tensor inputs win over both.

Outputs: ``text_output`` (a UTF-8-safe delta per streamed response; the whole text otherwise,
after the prompt unless ``exclude_input_in_output``), ``finish_reason`` (``None`` on non-final
responses), ``cumulative_logprob`` (FP32, the sum over the tokens so far), ``logprobs`` (JSON: per
token of the response, {token id: {logprob, rank, decoded_token}} for the generated token and the
``logprobs`` most likely ones; ``null`` unless ``sampling_parameters`` has ``logprobs``; strict JSON:
a token the processed distribution rules out, e.g. beyond ``top_k``, has logprob -9999.0 as in
OpenAI's API, never -Infinity),
``num_input_tokens``, ``num_output_tokens`` (per response when streaming).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import numpy as np

from backend.engine.outputs import RequestOutput
from backend.errors import InvalidRequest
from backend.sampling.params import SamplingParams
from backend.serving.inputs import (check_size, input_int, optional_scalar, request_parameters,
                                    sampling_parameters)
from backend.serving.request import RequestLimits, ServedRequest
from backend.values import to_bool, to_str

# Sampling knobs that may also come as tensor inputs (they win over sampling_parameters).
SAMPLING_TENSORS = ("ignore_eos", "min_tokens")
# Keys of request parameters / sampling_parameters that are request options, not sampling knobs.
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
         "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
# The vLLM backend's wording: clients match on it.
STREAM_WITH_PROMPT = "When streaming, `exclude_input_in_output` = False is not allowed."
# The logprob JSON carries for a token the processed distribution rules out (OpenAI's value).
MASKED_LOGPROB = -9999.0


class TextRequest(ServedRequest):

    def __init__(self, pb: Any, request: Any, sender: Any = None, arrival: float = 0.0, token_text: Any = None,
                 limits: RequestLimits | None = None):
        super().__init__(pb, request, sender, arrival, token_text, limits)
        raw_prompt = optional_scalar(pb, request, "text_input")
        if raw_prompt is None:
            raise InvalidRequest("missing required input 'text_input'")
        if limits is not None:    # before decoding it, as the engine checks it before tokenizing
            check_size("the prompt", raw_prompt, limits.max_prompt_bytes, "max_prompt_bytes")
        prompt = to_str("input 'text_input'", raw_prompt)
        if not prompt:
            raise InvalidRequest("input 'text_input' is empty")
        self.prompt = prompt
        raw = request_parameters(request)
        raw.update(sampling_parameters(pb, request))
        opts = _options(pb, request, raw)
        for name in SAMPLING_TENSORS:   # genai-perf's --extra-inputs arrive as tensors
            v = optional_scalar(pb, request, name)
            if v is not None:
                raw[name] = v
        params = SamplingParams.from_dict(raw, max_tokens=input_int(pb, request, "max_tokens"))
        self.stream = opts.get("stream", False)
        # As in the vLLM backend: the prompt is prepended to a non-streamed output unless
        # exclude_input_in_output; streamed outputs never include it.
        if "exclude_input_in_output" in opts:
            self.prepend_input = not opts["exclude_input_in_output"]
        else:
            self.prepend_input = not self.stream
        if self.prepend_input and self.stream:
            raise InvalidRequest(STREAM_WITH_PROMPT)
        self.return_finish_reason = opts.get("return_finish_reason", False)
        self.return_cumulative_logprob = opts.get("return_cumulative_logprob", False)
        self.return_logprobs = opts.get("return_logprobs", False)
        self.logprobs_asked = params.logprobs is not None
        if self.return_cumulative_logprob and not self.logprobs_asked:
            params = replace(params, logprobs=0)   # the engine tracks the sum only when asked
        self.params = params
        self._logprobs: list = []       # tokens of the coming response (all of them, not streamed)
        self.return_num_input_tokens = opts.get("return_num_input_tokens", False)
        self.return_num_output_tokens = opts.get("return_num_output_tokens", False)
        self._text: list[str] = []      # not streamed: the text so far
        self._pending_ids = 0           # streamed: ids whose text has not been sent yet

    # ---- responses

    def partial_response(self, out: RequestOutput) -> Any | None:
        self._logprobs += out.logprobs or []
        if not self.stream:
            self._text.append(out.new_text)
            return None
        self._pending_ids += len(out.new_token_ids)
        if not out.new_text:
            return None   # e.g. half a multi-byte character; it comes with the next step
        return self._delta_response(out)

    def final_response(self, out: RequestOutput) -> Any:
        self._logprobs += out.logprobs or []
        if self.stream:
            self._pending_ids += len(out.new_token_ids)
            return self._delta_response(out)
        self._text.append(out.new_text)
        text = "".join(self._text)
        if self.prepend_input:
            text = self.prompt + text
        return self._response(text, out, self.num_output_tokens)

    def _delta_response(self, out: RequestOutput) -> Any:
        response = self._response(out.new_text, out, self._pending_ids)
        self._pending_ids = 0
        self._logprobs = []
        return response

    def _response(self, text: str, out: RequestOutput, num_ids: int) -> Any:
        tensors = [self.tensor("text_output", _strings(text))]
        if self.return_finish_reason:
            tensors.append(self.tensor("finish_reason", _strings(str(out.finish_reason if out.finished else None))))
        if self.return_cumulative_logprob:
            tensors.append(self.tensor("cumulative_logprob",
                                       np.array([out.cumulative_logprob or 0.0], dtype=np.float32)))
        if self.return_logprobs:
            tensors.append(self.tensor("logprobs", _strings(json.dumps(
                [self._entry(t) for t in self._logprobs] if self.logprobs_asked else None, allow_nan=False))))
        if self.return_num_input_tokens:
            tensors.append(self.tensor("num_input_tokens", np.array([self.num_prompt_tokens], dtype=np.uint32)))
        if self.return_num_output_tokens:
            tensors.append(self.tensor("num_output_tokens", np.array([num_ids], dtype=np.uint32)))
        return self.pb.InferenceResponse(output_tensors=tensors)


    def _entry(self, t) -> dict[str, dict]:
        """One token in the vLLM backend's format: the generated token and the most likely ones."""
        entry = {str(tid): {"logprob": json_logprob(lp), "rank": rank + 1, "decoded_token": self.token_text(tid)}
                 for rank, (tid, lp) in enumerate(t.top)}
        entry.setdefault(str(t.token), {"logprob": json_logprob(t.logprob), "rank": t.rank,
                                        "decoded_token": self.token_text(t.token)})
        return entry


def _options(pb: Any, request: Any, raw: dict[str, Any]) -> dict[str, bool]:
    """The request options, taken out of ``raw``; tensor inputs win over parameters."""
    flags: dict[str, Any] = {k: raw.pop(k) for k in FLAGS if k in raw}
    for name in FLAGS:
        v = optional_scalar(pb, request, name)
        if v is not None:
            flags[name] = v
    return {k: to_bool(k, v) for k, v in flags.items()}


def json_logprob(lp: float) -> float:
    """A logprob as strict JSON can carry it: a token the processed distribution rules out (-inf,
    e.g. beyond top_k) is -9999.0, OpenAI's convention; JSON has no -Infinity or NaN."""
    lp = float(lp)
    return lp if math.isfinite(lp) else MASKED_LOGPROB


def _strings(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)
