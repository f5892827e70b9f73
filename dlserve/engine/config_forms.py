"""A model config in Triton's text and JSON forms: ``config.pbtxt`` parsed, configs in
JSON (load overrides, ``auto_complete_config`` results) read as Triton reads them, and
configs rendered as Triton's HTTP endpoint and ``args["model_config"]`` render them.

The config is our own ``inference.ModelConfig`` protobuf message (names and field
numbers of Triton's ``model_config.proto``), so every form comes from one schema;
what differs is how Triton's C++ protobuf reads and writes JSON, done here by hand.
"""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import descriptor, json_format, text_format
from google.protobuf.message import Message

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import InvalidArgumentError


def parse_text(text: str, model_name: str, file: str = "config.pbtxt") -> mc.ModelConfig:
    """Parse a config's text (``file``, as the model's folder names it); a syntax error
    names the model, the file and the position."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise InvalidArgumentError(f"failed to load model '{model_name}': {file}: {exc}") from None


def parse_json(data: str | dict[str, Any], model_name: str, source: str = "Invalid config override") -> mc.ModelConfig:
    """Parse a config in Triton's JSON form (load overrides, auto-complete results),
    reading it as Triton does; ``source`` begins the error (by default Triton's words for a
    load's config parameter, which its QA greps)."""
    try:
        obj = json.loads(data) if isinstance(data, str) else data
        if not isinstance(obj, dict):
            raise ValueError("the config must be a JSON object")
        read = _as_triton_reads(mc.ModelConfig.DESCRIPTOR, obj, "")
        return json_format.ParseDict(read, mc.ModelConfig())
    except (ValueError, TypeError, json_format.ParseError) as exc:
        raise InvalidArgumentError(f"failed to load model '{model_name}': {source}: {exc}") from None


_INT64_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT64,
    descriptor.FieldDescriptor.TYPE_UINT64,
    descriptor.FieldDescriptor.TYPE_SINT64,
    descriptor.FieldDescriptor.TYPE_FIXED64,
    descriptor.FieldDescriptor.TYPE_SFIXED64,
}
_FLOAT_TYPES = {descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE}
# Messages whose 64-bit ints Triton 2.51 leaves as protobuf's strings ("dims": ["1"]).
_INT64_KEPT_AS_STRINGS = {
    mc.ModelSequenceBatching.InitialState.DESCRIPTOR.full_name,
    mc.ModelInstanceGroup.SecondaryDevice.DESCRIPTOR.full_name,
}

_INTEGER_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT32,
    descriptor.FieldDescriptor.TYPE_UINT32,
    descriptor.FieldDescriptor.TYPE_SINT32,
    descriptor.FieldDescriptor.TYPE_FIXED32,
    descriptor.FieldDescriptor.TYPE_SFIXED32,
    *_INT64_TYPES,
}
_DECIMAL_INTEGER = re.compile(r"[+-]?[0-9]+")
_BOOL_WORDS = {
    **dict.fromkeys(("true", "t", "yes", "y", "1"), True),
    **dict.fromkeys(("false", "f", "no", "n", "0"), False),
}


def _as_triton_reads(desc: descriptor.Descriptor, obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj`` as Triton's JSON parser (protobuf's C++ one) reads it, for Python's to parse.

    Triton's takes one value for a list (``"dims": "4"``), flattens lists in lists, and
    reads numbers and bools in strings (``"dims": ["-1", "4"]``, ``"optional": "yes"``,
    any case of true/t/yes/y/1 and false/f/no/n/0); an integer in a string must be
    decimal digits with an optional sign (Python's parser also takes "4.0" and "1e3").
    Fields it does not know are left for Python's parser to report."""
    read: dict[str, Any] = {}
    for key, value in obj.items():
        field = desc.fields_by_name.get(key) or desc.fields_by_camelcase_name.get(key)
        at = f"{where}.{key}" if where else key
        if field is None or value is None:
            read[key] = value
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            read[key] = (
                {k: _value_as_triton_reads(value_field, v, f"{at}[{k}]") for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        elif field.is_repeated:
            items = enumerate(_flat(value))
            read[key] = [_value_as_triton_reads(field, item, f"{at}[{i}]") for i, item in items]
        else:
            read[key] = _value_as_triton_reads(field, value, at)
    return read


def _flat(value: Any) -> list[Any]:
    if not isinstance(value, list):
        return [value]
    return [item for element in value for item in _flat(element)]


def _value_as_triton_reads(field: descriptor.FieldDescriptor, value: Any, where: str) -> Any:
    if field.message_type is not None:
        return _as_triton_reads(field.message_type, value, where) if isinstance(value, dict) else value
    if not isinstance(value, str):
        return value
    if field.type == descriptor.FieldDescriptor.TYPE_BOOL:
        if value.lower() not in _BOOL_WORDS:
            raise ValueError(f"{where}: '{value}' is not a bool")
        return _BOOL_WORDS[value.lower()]
    if field.type in _INTEGER_TYPES:
        if not _DECIMAL_INTEGER.fullmatch(value):
            raise ValueError(f"{where}: '{value}' is not an integer")
        return int(value)
    return value


def _as_triton_json(desc: descriptor.Descriptor, obj: dict[str, Any]) -> dict[str, Any]:
    """protobuf's JSON writes 64-bit ints as strings, whole floats with ".0" and set
    fields before unset ones; Triton writes numbers (in most messages), whole floats
    as integers, in the order the fields are declared."""
    _numbers_as_triton_writes(desc, obj)
    return _declaration_order(desc, obj)


def _declaration_order(desc: descriptor.Descriptor, obj: dict[str, Any]) -> dict[str, Any]:
    ordered: dict[str, Any] = {}
    for field in desc.fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            value_type = message.fields_by_name["value"].message_type
            if value_type is not None:
                value = {k: _declaration_order(value_type, v) for k, v in value.items()}
        elif message is not None:
            if field.is_repeated:
                value = [_declaration_order(message, item) for item in value]
            else:
                value = _declaration_order(message, value)
        ordered[field.name] = value
    return ordered


def _numbers_as_triton_writes(desc: descriptor.Descriptor, obj: dict[str, Any]) -> None:
    int64_as_numbers = desc.full_name not in _INT64_KEPT_AS_STRINGS
    for field in desc.fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_field.message_type is not None:
                    _numbers_as_triton_writes(value_field.message_type, item)
                elif value_field.type in _INT64_TYPES:
                    value[key] = int(item)
        elif field.message_type is not None:
            items = value if field.is_repeated else [value]
            for item in items:
                _numbers_as_triton_writes(field.message_type, item)
        elif field.type in _INT64_TYPES and int64_as_numbers:
            obj[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.type in _FLOAT_TYPES:
            obj[field.name] = [_whole(v) for v in value] if isinstance(value, list) else _whole(value)


def _whole(value: Any) -> Any:
    """A float that is a whole number as an int (1.0 -> 1), as protobuf's C++ prints it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def message_to_json(message: Message) -> dict[str, Any]:
    """Triton's JSON for any config message: proto field names, every scalar and
    repeated field printed, sub-messages only when set, 64-bit ints as numbers."""
    obj = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return _as_triton_json(message.DESCRIPTOR, obj)


def to_json(config: mc.ModelConfig) -> dict[str, Any]:
    return message_to_json(config)
