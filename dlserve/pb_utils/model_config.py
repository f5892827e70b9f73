"""``pb_utils.ModelConfig``: what ``auto_complete_config`` may change, with Triton's rules.

A model may fill in ``max_batch_size``, inputs, outputs, dynamic batching and the
transaction policy; whatever ``config.pbtxt`` already says wins, and a conflict is
a ``ValueError`` that names the model, the tensor and both values, in the words of
Triton's ``triton_python_backend_utils`` (upstream tests look for them).
"""

from __future__ import annotations

import json
from typing import Any

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")
_ALLOWED = {
    "input": "'name', 'data_type', 'dims' and 'optional'",
    "output": "'name', 'data_type' and 'dims'",
}
_IN_HOOK = "in auto-complete-config function for model"


class ModelConfig:
    def __init__(self, model_config: str | dict[str, Any]) -> None:
        self._config: dict[str, Any] = (
            json.loads(model_config) if isinstance(model_config, str) else model_config
        )
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    @property
    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = int(self._config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but {_IN_HOOK} "
                f"'{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 - Triton's name
        self._add_tensor("input", input, _INPUT_KEYS)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output, _OUTPUT_KEYS)

    def _add_tensor(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        label = tensor.get("name", "<unnamed>")
        where = f"{kind} '{label}' {_IN_HOOK} '{self._name}'"
        if any(key not in allowed for key in tensor):
            raise ValueError(f"{where} contains property other than {_ALLOWED[kind]}.")
        if "name" not in tensor:
            raise ValueError(f"{kind} {_IN_HOOK} '{self._name}' is missing 'name' property.")
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{where} is missing '{key}' property.")
        for current in self._config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            configured_type = current.get("data_type", "TYPE_INVALID")
            if configured_type != "TYPE_INVALID" and configured_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects datatype "
                    f"{configured_type} for {kind} '{label}', model provides {tensor['data_type']}"
                )
            # compared as given, as Triton does: ["4"] or 4 is not config.pbtxt's [4]
            wanted_dims = list(tensor["dims"]) if isinstance(tensor["dims"], tuple) else tensor["dims"]
            if current.get("dims") and list(current["dims"]) != wanted_dims:
                raise ValueError(
                    f"model '{self._name}', tensor '{label}': the model expects dims "
                    f"{wanted_dims} but the model configuration specifies dims "
                    f"{list(current['dims'])}"
                )
            if "optional" in tensor and current.get("optional", tensor["optional"]) != tensor[
                "optional"
            ]:
                raise ValueError(
                    f"model '{self._name}', tensor '{label}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{current['optional']}"
                )
            current.update(tensor)
            return
        self._config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property {_IN_HOOK} '{self._name}' contains property "
                    "other than 'decoupled'."
                )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
