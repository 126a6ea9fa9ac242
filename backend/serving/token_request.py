"""The TensorRT-LLM-style token schema (model ``nightdraft_tokens``, the middle of the ensemble).

Inputs: ``input_ids`` (required), ``input_lengths``, ``request_output_len``, ``streaming``,
``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``random_seed``, ``sampling_parameters``.

Outputs: ``output_ids`` and ``output_offset``. Each response holds a window of token ids whose
first ``output_offset`` ids were already sent (context for the decoder), so the stateless
``postprocessing`` model can decode exactly the text delta the engine's incremental detokenizer
produced, also across multi-byte characters. A response goes out only when the detokenizer
produced text (a clean text boundary).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from backend.engine.outputs import RequestOutput
from backend.errors import InvalidRequest
from backend.sampling.params import SamplingParams
from backend.serving.inputs import input_int, optional_scalar, sampling_parameters
from backend.serving.request import RequestLimits, ServedRequest
from backend.values import to_bool

SCALARS = {  # TensorRT-LLM input name -> SamplingParams key
    "request_output_len": "max_tokens",
    "temperature": "temperature",
    "runtime_top_k": "top_k",
    "runtime_top_p": "top_p",
    "random_seed": "seed",
}


class TokenRequest(ServedRequest):

    def __init__(self, pb: Any, request: Any, sender: Any = None, arrival: float = 0.0, token_text: Any = None,
                 limits: RequestLimits | None = None):
        super().__init__(pb, request, sender, arrival, token_text, limits)
        self.prompt = _input_ids(pb, request, limits)
        raw = sampling_parameters(pb, request)
        self.stream = False
        if "streaming" in raw or "stream" in raw:
            self.stream = to_bool("streaming", raw.pop("streaming", raw.pop("stream", False)))
        streaming = optional_scalar(pb, request, "streaming")
        if streaming is not None:
            self.stream = to_bool("streaming", streaming)
        for name, key in SCALARS.items():
            v = optional_scalar(pb, request, name)
            if v is not None:
                raw[key] = v
        self.params = SamplingParams.from_dict(raw)
        _refuse_text_options(self.params)
        self._ids: list[int] = []       # every id generated so far
        self._win_start = 0             # where the next window starts
        self._win_read = 0              # ids already sent

    # ---- responses

    def partial_response(self, out: RequestOutput) -> Any | None:
        self._ids += out.new_token_ids
        if self.stream and out.new_text:   # a clean text boundary: send the window
            return self._window_response()
        return None

    def final_response(self, out: RequestOutput) -> Any:
        self._ids += out.new_token_ids
        if not self.stream:                # one response: every id, none sent before
            self._win_start, self._win_read = 0, 0
        return self._window_response()

    def _window_response(self) -> Any:
        window = self._ids[self._win_start:]
        offset = self._win_read - self._win_start
        self._win_start, self._win_read = self._win_read, len(self._ids)
        return self.pb.InferenceResponse(output_tensors=[
            self.tensor("output_ids", np.array(window, dtype=np.int32)),
            self.tensor("output_offset", np.array([offset], dtype=np.int32)),
        ])


def _input_ids(pb: Any, request: Any, limits: RequestLimits | None) -> list[int]:
    """The prompt's ids, their count and range checked on the array, before any is converted."""
    t = pb.get_input_tensor_by_name(request, "input_ids")
    if t is None:
        raise InvalidRequest("missing required input 'input_ids'")
    ids = np.asarray(t.as_numpy()).reshape(-1)
    if ids.dtype.kind not in "iu":
        raise InvalidRequest(f"input 'input_ids' must hold integers, got {ids.dtype}")
    n = input_int(pb, request, "input_lengths")
    if n is not None:
        if not 0 <= n <= ids.size:
            raise InvalidRequest(f"input_lengths {n} outside [0, {ids.size}]")
        ids = ids[:n]
    if ids.size == 0:
        raise InvalidRequest("input 'input_ids' is empty")
    if limits is not None:
        if ids.size > limits.max_prompt_tokens:
            raise InvalidRequest(f"input 'input_ids' has {ids.size} ids; the context holds "
                                 f"{limits.max_prompt_tokens + 1} tokens, leaving no room to generate")
        outside = (ids < 0) | (ids >= limits.vocab_size)
        if outside.any():
            raise InvalidRequest(f"token id(s) {ids[outside][:5].tolist()} outside the vocabulary "
                                 f"[0, {limits.vocab_size})")
    return ids.tolist()


def _refuse_text_options(params: SamplingParams) -> None:
    """This model sends token ids; `postprocessing` decodes them with the tokenizer's defaults and
    there is no output for the prompt's log-probabilities. Options that would change what it
    cannot change are refused by name, never ignored."""
    asked = [k for k in ("skip_special_tokens", "spaces_between_special_tokens") if not getattr(params, k)]
    if params.prompt_logprobs is not None:
        asked.append("prompt_logprobs")
    if asked:
        raise InvalidRequest(f"{', '.join(asked)}: not supported through the ensemble (token ids out, "
                             f"text decoded by postprocessing with the tokenizer's defaults); "
                             f"send the request to the nightdraft model")
