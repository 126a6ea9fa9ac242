"""nightdraft as a Triton *Python-based backend*: the one ``TritonPythonModel`` class every model
with ``backend: "nightdraft"`` runs.

Triton looks for ``<backend directory>/nightdraft/model.py`` (``backend_model.py`` here, laid out
by ``nightdraft install-backend`` and ``nightdraft serve``) and runs it with its Python backend, so
a model folder holds configuration only: ``config.pbtxt`` and ``1/engine.json`` and/or
``1/model.json`` (vLLM engine arguments), as a folder of Triton's vLLM backend does.

A model's ``role`` parameter says what it serves (default ``text``):

==================  ================================================================
``text``            decoupled generation, the vLLM backend's request schema
``tokens``          decoupled token-level generation inside the ensemble
``preprocessing``   the ensemble's tokenizer
``postprocessing``  the ensemble's detokenizer
==================  ================================================================

Config auto-complete (Triton's ``auto_complete_config``) adds the role's inputs and outputs that
config.pbtxt does not declare, the decoupled transaction policy of the generation roles, and
``max_batch_size: 0`` (the engine batches on its own), as the vLLM backend does; so its sample
config.pbtxt, which declares none of them, loads here unchanged. An input config.pbtxt declares
that the role does not read is refused at load: the model would ignore it silently.
"""
from __future__ import annotations

import json
from typing import Any

ROLE_PARAMETER = "role"
DEFAULT_ROLE = "text"


def _io(name: str, dtype: str, dims: list[int], optional: bool = False) -> dict:
    spec = {"name": name, "data_type": dtype, "dims": dims}
    if optional:
        spec["optional"] = True
    return spec


def _flag(name: str) -> dict:
    return _io(name, "TYPE_BOOL", [1], optional=True)


# What each role reads and writes; config.pbtxt may declare these, auto-complete adds the rest.
ROLES: dict[str, dict[str, Any]] = {
    "text": {
        "decoupled": True,
        "inputs": [
            _io("text_input", "TYPE_STRING", [1]),
            _flag("stream"),
            _io("sampling_parameters", "TYPE_STRING", [1], optional=True),
            _flag("exclude_input_in_output"),
            _flag("return_finish_reason"),
            _flag("return_cumulative_logprob"),
            _flag("return_logprobs"),
            _flag("return_prompt_logprobs"),
            _flag("return_num_input_tokens"),
            _flag("return_num_output_tokens"),
            _io("max_tokens", "TYPE_INT32", [1], optional=True),
            # genai-perf's --extra-inputs ignore_eos:true sends a tensor.
            _flag("ignore_eos"),
            _io("min_tokens", "TYPE_INT32", [1], optional=True),
        ],
        "outputs": [
            _io("text_output", "TYPE_STRING", [-1]),
            _io("finish_reason", "TYPE_STRING", [-1]),
            _io("cumulative_logprob", "TYPE_FP32", [-1]),
            _io("logprobs", "TYPE_STRING", [-1]),
            _io("prompt_logprobs", "TYPE_STRING", [-1]),
            _io("num_input_tokens", "TYPE_UINT32", [1]),
            _io("num_output_tokens", "TYPE_UINT32", [-1]),
        ],
    },
    "tokens": {
        "decoupled": True,
        "inputs": [
            _io("input_ids", "TYPE_INT32", [-1]),
            _io("input_lengths", "TYPE_INT32", [1], optional=True),
            _io("request_output_len", "TYPE_INT32", [1], optional=True),
            _flag("streaming"),
            _io("temperature", "TYPE_FP32", [1], optional=True),
            _io("runtime_top_k", "TYPE_INT32", [1], optional=True),
            _io("runtime_top_p", "TYPE_FP32", [1], optional=True),
            _io("random_seed", "TYPE_UINT64", [1], optional=True),
            _io("sampling_parameters", "TYPE_STRING", [1], optional=True),
        ],
        "outputs": [
            # A window of generated ids; the first output_offset of them were sent before.
            _io("output_ids", "TYPE_INT32", [-1]),
            _io("output_offset", "TYPE_INT32", [1]),
        ],
    },
    "preprocessing": {
        "decoupled": False,
        "inputs": [_io("text_input", "TYPE_STRING", [1])],
        "outputs": [_io("input_ids", "TYPE_INT32", [-1]), _io("input_lengths", "TYPE_INT32", [1])],
    },
    "postprocessing": {
        "decoupled": False,
        "inputs": [_io("output_ids", "TYPE_INT32", [-1]), _io("output_offset", "TYPE_INT32", [1])],
        "outputs": [_io("text_output", "TYPE_STRING", [-1])],
    },
}


def role_of(model_config: dict) -> str:
    """The model's role (its ``role`` parameter, default ``text``); an unknown one is refused."""
    entry = (model_config.get("parameters") or {}).get(ROLE_PARAMETER) or {}
    role = (entry.get("string_value") or "").strip() or DEFAULT_ROLE
    if role not in ROLES:
        raise ValueError(f"model {model_config.get('name', '?')!r}: parameter {ROLE_PARAMETER!r} must be "
                         f"one of {sorted(ROLES)}, got {role!r}")
    return role


def undeclared_inputs(model_config: dict, role: str) -> list[str]:
    """Inputs config.pbtxt declares that the role does not read."""
    known = {spec["name"] for spec in ROLES[role]["inputs"]}
    return sorted(i["name"] for i in model_config.get("input") or [] if i["name"] not in known)


def auto_complete(config: Any) -> Any:
    """Triton's ``auto_complete_config``: the role's inputs and outputs that config.pbtxt leaves
    out, the generation roles' decoupled policy, ``max_batch_size: 0``."""
    current = config.as_dict()
    role = role_of(current)
    spec = ROLES[role]
    have_in = {i["name"] for i in current.get("input") or []}
    have_out = {o["name"] for o in current.get("output") or []}
    for i in spec["inputs"]:
        if i["name"] not in have_in:
            config.add_input(dict(i))
    for o in spec["outputs"]:
        if o["name"] not in have_out:
            config.add_output(dict(o))
    if spec["decoupled"]:
        config.set_model_transaction_policy(dict(decoupled=True))
    config.set_max_batch_size(0)
    return config


def backend_model(pb_utils: Any) -> type:
    """The ``TritonPythonModel`` class of ``backend_model.py``: it builds the role's model
    (``backend.serving.python_model``) at ``initialize`` and hands it every call."""
    from backend.serving import python_model

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config: Any) -> Any:
            return auto_complete(auto_complete_model_config)

        def initialize(self, args: dict[str, str]) -> None:
            config = json.loads(args["model_config"])
            role = role_of(config)
            stray = undeclared_inputs(config, role)
            if stray:
                raise pb_utils.TritonModelException(
                    f"{config.get('name', '?')}: config.pbtxt declares input(s) {stray} that the "
                    f"{role!r} role does not read (it reads {[i['name'] for i in ROLES[role]['inputs']]})")
            self._model = python_model(role, pb_utils)()
            self._model.initialize(args)

        def execute(self, requests: list[Any]) -> Any:
            return self._model.execute(requests)

        def finalize(self) -> None:
            model = getattr(self, "_model", None)
            if model is not None and hasattr(model, "finalize"):
                model.finalize()

    return TritonPythonModel
