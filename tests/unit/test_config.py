"""dlserve.engine.config (config.pbtxt: parse, complete, validate, Triton's JSON) and
dlserve.engine.repository (version folders, version policy, uploads)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import pytest

from dlserve.engine import config as cfg
from dlserve.engine import config_forms as forms
from dlserve.engine.backends import backend_model_file
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import (
    ModelSource,
    Repository,
    may_define_auto_complete,
    select_versions,
)
from dlserve.engine.request import Request
from dlserve.engine.sequence import ControlInput
from dlserve.errors import InternalError, InvalidArgumentError, NotFoundError, UnsupportedError
from dlserve.pb_utils.model_config import ModelConfig as PbModelConfig

REFERENCE = Path(__file__).parent.parent / "data" / "triton_reference"
PROBE_REPO = REFERENCE / "probe_repo"


def parse(text: str, name: str = "m") -> mc.ModelConfig:
    return forms.parse_text(text, name)


def completed(text: str, name: str = "m", gpu_count: int = 0) -> mc.ModelConfig:
    config = parse(text, name)
    cfg.complete(config, name, gpu_count)
    return config


def reference_json(model: str) -> dict:
    return json.loads((REFERENCE / f"config_{model}.json").read_text())


def probe_config(model: str) -> str:
    return (PROBE_REPO / model / "config.pbtxt").read_text()


# -- parse ---------------------------------------------------------------------------------


def test_parse_text_of_a_valid_config():
    config = parse(probe_config("args_probe"), "args_probe")
    assert config.name == "args_probe"
    assert config.backend == "python"
    assert config.max_batch_size == 8
    assert config.HasField("dynamic_batching")
    assert [i.name for i in config.input] == ["INPUT0", "OPT_IN"]
    assert config.input[0].data_type == mc.TYPE_FP32 and list(config.input[0].dims) == [-1]
    assert config.input[1].optional
    assert list(config.output[1].reshape.shape) == [4]
    assert config.instance_group[0].count == 2
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert config.parameters["key"].string_value == "value"


def test_parse_text_of_an_empty_config():
    config = parse("")
    assert config == mc.ModelConfig()


@pytest.mark.parametrize(
    "text,where",
    [
        ('name: "m" input [ { name: "a" ', "1:"),
        ('nme: "x"', 'no field named "nme"'),
        ('max_batch_size: "x"', "Couldn't parse integer"),
        ("instance_group [ { kind: KIND_WHAT } ]", "KIND_WHAT"),
        ('input [ { name: "a" }\noutput [ ]', "2:1"),
    ],
    ids=["unterminated", "unknown-field", "bad-int", "bad-enum", "line-2"],
)
def test_parse_text_syntax_errors_name_the_model(text, where):
    with pytest.raises(InvalidArgumentError) as info:
        forms.parse_text(text, "my_model")
    message = str(info.value)
    assert message.startswith("failed to load model 'my_model': config.pbtxt: ")
    assert where in message


def test_parse_json():
    config = forms.parse_json('{"name": "m", "max_batch_size": 4, "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [-1]}]}', "m")
    assert config.max_batch_size == 4 and list(config.input[0].dims) == [-1]
    assert forms.parse_json({"backend": "python"}, "m").backend == "python"


@pytest.mark.parametrize("text", ["{", '{"nme": 1}', '{"max_batch_size": "many"}'])
def test_parse_json_errors_name_the_model(text):
    with pytest.raises(InvalidArgumentError, match="failed to load model 'm': Invalid config override: "):
        forms.parse_json(text, "m")


def tensor_from_json(**fields) -> mc.ModelInput:
    return forms.parse_json({"input": [{"name": "A", "data_type": "TYPE_FP32", **fields}]}, "m").input[0]


@pytest.mark.parametrize(
    "dims,expected",
    [
        (["4"], [4]), (["-1", "4"], [-1, 4]), (["+4", "010"], [4, 10]), ("4", [4]), (4, [4]),
        ([["4"], 5], [4, 5]), ([1e3], [1000]), (["9223372036854775807"], [9223372036854775807]),
    ],
)
def test_parse_json_reads_dims_as_triton_does(dims, expected):
    """Triton 2.51 (measured with auto_complete_config and load overrides): numbers in
    strings, one value for a list and lists in lists are read as protobuf's C++ parser reads them."""
    assert list(tensor_from_json(dims=dims).dims) == expected


@pytest.mark.parametrize("word", ["true", "True", "TRUE", "t", "yes", "y", "1"])
def test_parse_json_reads_true_in_a_string_as_triton_does(word):
    assert tensor_from_json(dims=[1], optional=word).optional is True


@pytest.mark.parametrize("word", ["false", "False", "f", "no", "N", "0"])
def test_parse_json_reads_false_in_a_string_as_triton_does(word):
    assert tensor_from_json(dims=[1], optional=word).optional is False


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"dims": ["abc"]}, "input[0].dims[0]: 'abc' is not an integer"),
        ({"dims": ["4.0"]}, "input[0].dims[0]: '4.0' is not an integer"),
        ({"dims": ["1e3"]}, "input[0].dims[0]: '1e3' is not an integer"),
        ({"dims": [" 4"]}, "input[0].dims[0]: ' 4' is not an integer"),
        ({"dims": ["0x10"]}, "input[0].dims[0]: '0x10' is not an integer"),
        ({"dims": [4.5]}, "Couldn't parse integer: 4.5"),
        ({"dims": ["99999999999999999999"]}, "Value out of range"),
        ({"dims": [1], "optional": "on"}, "input[0].optional: 'on' is not a bool"),
        ({"dims": [1], "optional": "2"}, "input[0].optional: '2' is not a bool"),
        ({"dims": [1], "optional": 1}, "Expected true or false"),
    ],
)
def test_parse_json_refuses_what_triton_cannot_read(fields, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        tensor_from_json(**fields)


def test_parse_json_reads_strings_as_triton_does_in_every_message():
    config = forms.parse_json(
        {
            "max_batch_size": "2",
            "output": {"name": "O", "data_type": "TYPE_FP32", "dims": "-1"},
            "model_transaction_policy": {"decoupled": "no"},
            "dynamic_batching": {"priority_queue_policy": {"1": {"max_queue_size": "3"}}},
        },
        "m",
    )
    assert config.max_batch_size == 2 and list(config.output[0].dims) == [-1]
    assert config.HasField("model_transaction_policy") and not config.model_transaction_policy.decoupled
    assert config.dynamic_batching.priority_queue_policy[1].max_queue_size == 3


@pytest.mark.parametrize("text", ["5", "null", "[]"])
def test_parse_json_rejects_json_that_is_not_an_object(text):
    with pytest.raises(InvalidArgumentError, match="failed to load model 'm'"):
        forms.parse_json(text, "m")


# -- complete ------------------------------------------------------------------------------


def test_complete_defaults_of_an_empty_config():
    config = completed("", "empty")
    assert config.name == "empty"
    assert config.backend == "python" and config.platform == ""
    assert config.version_policy.WhichOneof("policy_choice") == "latest"
    assert config.version_policy.latest.num_versions == 1
    assert config.default_model_filename == "model.py"
    assert config.optimization.input_pinned_memory.enable
    assert config.optimization.output_pinned_memory.enable
    assert not config.HasField("dynamic_batching")
    assert len(config.instance_group) == 1
    group = config.instance_group[0]
    # An auto-filled group is named after the model alone (Triton: "<model>").
    assert (group.name, group.count, group.kind) == ("empty", 1, mc.ModelInstanceGroup.KIND_CPU)


def test_complete_names_written_groups_by_index():
    config = completed(
        'instance_group [ { kind: KIND_CPU }, { name: "mine" count: 3 kind: KIND_CPU }, { count: 2 } ]',
        "m",
    )
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [
        ("m_0", 1, mc.ModelInstanceGroup.KIND_CPU),
        ("mine", 3, mc.ModelInstanceGroup.KIND_CPU),
        ("m_2", 2, mc.ModelInstanceGroup.KIND_CPU),  # KIND_AUTO without GPUs
    ]


def test_complete_kind_auto_with_gpus():
    config = completed("instance_group [ { kind: KIND_AUTO }, { kind: KIND_AUTO gpus: [1] } ]", "m", gpu_count=2)
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert list(config.instance_group[0].gpus) == [0, 1]
    assert list(config.instance_group[1].gpus) == [1]


def test_complete_keeps_what_is_written():
    config = completed(
        'name: "m" platform: "" backend: "python" default_model_filename: "other.py" '
        "version_policy { all { } } optimization { input_pinned_memory { enable: false } }",
        "m",
    )
    assert config.default_model_filename == "other.py"
    assert config.version_policy.WhichOneof("policy_choice") == "all"
    assert not config.optimization.input_pinned_memory.enable
    assert config.optimization.output_pinned_memory.enable  # filled in beside it, as Triton does


def test_complete_does_not_set_a_backend_next_to_a_platform():
    config = completed('platform: "onnxruntime_onnx"', "m")
    assert config.backend == ""


def test_complete_preferred_batch_size():
    assert list(completed("max_batch_size: 8 dynamic_batching { }").dynamic_batching.preferred_batch_size) == [8]
    assert list(
        completed("max_batch_size: 8 dynamic_batching { preferred_batch_size: [2, 4] }").dynamic_batching.preferred_batch_size
    ) == [2, 4]
    assert list(completed("max_batch_size: 0 dynamic_batching { }").dynamic_batching.preferred_batch_size) == []


# -- Triton's JSON ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["add_sub", "args_probe"])
def test_to_json_equals_tritons_rendering(model):
    config = completed(probe_config(model), model)
    cfg.validate(config, model)
    assert forms.to_json(config) == reference_json(model)


def _run_probe_auto_complete(model: str, config: mc.ModelConfig) -> mc.ModelConfig:
    """What the server does: the model's auto_complete_config on Triton's JSON of the config."""
    spec = importlib.util.spec_from_file_location(f"probe_{model}", PROBE_REPO / model / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.TritonPythonModel.auto_complete_config(PbModelConfig(json.dumps(forms.to_json(config))))
    return forms.parse_json(json.dumps(result.as_dict()), model)


@pytest.mark.parametrize("model", ["auto_complete", "auto_complete_noconfig"])
def test_to_json_after_auto_complete_equals_tritons_rendering(model):
    # Triton renders these configs *after* auto-complete: max_batch_size 4, the inputs and
    # outputs the model added (INPUT1 kept optional), dynamic_batching with
    # preferred_batch_size [4], and the auto-filled instance group named "<model>".
    # Run the probe model's own auto_complete_config through dlserve's pb_utils.ModelConfig
    # to get the same starting point; every field then matches, none differs.
    path = PROBE_REPO / model / "config.pbtxt"
    config = parse(path.read_text() if path.exists() else "", model)
    config.name = model
    if not config.backend:
        config.backend = "python"
    config = _run_probe_auto_complete(model, config)
    cfg.complete(config, model)
    cfg.validate(config, model)
    assert forms.to_json(config) == reference_json(model)


@pytest.mark.parametrize("model", ["add_sub", "args_probe"])
def test_to_json_key_order_is_tritons(model):
    config = completed(probe_config(model), model)
    rendered = json.dumps(forms.to_json(config), separators=(",", ":"))
    assert rendered == (REFERENCE / f"config_{model}.json").read_text().strip()


def test_to_json_writes_int64_as_numbers():
    config = completed(
        "max_batch_size: 4 version_policy { specific { versions: [1, 3] } } "
        'input [ { name: "A" data_type: TYPE_FP32 dims: [ -1, 2 ] } ] '
        "dynamic_batching { max_queue_delay_microseconds: 100 }"
    )
    rendered = forms.to_json(config)
    assert rendered["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert rendered["input"][0]["dims"] == [-1, 2]
    assert rendered["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert '"dims":[-1,2]' in json.dumps(rendered, separators=(",", ":"))
    latest = forms.to_json(completed(""))["version_policy"]["latest"]["num_versions"]
    assert latest == 1 and type(latest) is int


def test_to_json_writes_numbers_as_triton_does_where_it_is_odd():
    """Side by side with Triton 2.51: whole floats as integers (fp32_false_true [0,1],
    minimum_slot_utilization 1), and an implicit state's initial_state dims and a secondary
    device's id as strings."""
    config = completed(
        "max_batch_size: 4 sequence_batching { direct { minimum_slot_utilization: 1.0 } "
        'control_input [ { name: "R" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1.5 ] } ] } ] '
        'state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] '
        'initial_state [ { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "init" } ] } ] }'
    )
    batching = json.dumps(forms.to_json(config)["sequence_batching"], separators=(",", ":"))
    assert '"minimum_slot_utilization":1}' in batching
    assert '"fp32_false_true":[0,1.5]' in batching
    assert '"dims":[1],"initial_state":[{"data_type":"TYPE_INT32","dims":["1"]' in batching
    grouped = completed("instance_group [ { kind: KIND_CPU secondary_devices [ { kind: KIND_NVDLA device_id: 0 } ] } ]")
    assert forms.to_json(grouped)["instance_group"][0]["secondary_devices"] == [{"kind": "KIND_NVDLA", "device_id": "0"}]


def test_to_json_reshape_only_when_set():
    rendered = forms.to_json(completed(probe_config("args_probe"), "args_probe"))
    assert "reshape" not in rendered["output"][0]
    assert rendered["output"][1]["reshape"] == {"shape": [4]}


# -- validate ------------------------------------------------------------------------------

GOOD = 'name: "m" backend: "python" input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]'


def invalid(text: str, gpu_count: int = 0, name: str = "m") -> str:
    config = completed(text, name, gpu_count)
    with pytest.raises((InvalidArgumentError, UnsupportedError)) as info:
        cfg.validate(config, name, gpu_count)
    return f"{type(info.value).__name__}: {info.value}"


def test_validate_accepts_a_good_config():
    cfg.validate(completed(GOOD), "m")
    cfg.validate(completed("instance_group [ { kind: KIND_GPU gpus: [1] } ]", gpu_count=2), "m", 2)


def test_validate_name_mismatch():
    config = completed('name: "other"', "m")
    with pytest.raises(InvalidArgumentError, match="model 'm': config.pbtxt 'name' is 'other', but it must match the model's folder name"):
        cfg.validate(config, "m")


@pytest.mark.parametrize("text", ['platform: "tensorflow_savedmodel"', 'backend: "onnxruntime"', 'platform: "x" backend: "onnxruntime"'])
def test_only_python_models_are_served(text, tmp_path):
    """A framework's platform is refused; another backend is served only as a Python-based
    backend (its model.py in the backend directory), and this one has none there."""
    with pytest.raises((InvalidArgumentError, UnsupportedError)) as info:
        backend_model_file(completed(text, "m"), "m", str(tmp_path))
    if "backend" in text:
        assert isinstance(info.value, InvalidArgumentError)
        assert info.value.message.startswith("unable to find backend library for backend 'onnxruntime', ")
        assert f"{tmp_path}/onnxruntime/model.py is not a file" in info.value.message
    else:
        assert str(info.value) == (
            "model 'm': dlserve serves Python models only (backend \"python\", or a Python-based "
            "backend) and ensembles of them, this config asks for 'tensorflow_savedmodel'"
        )


def test_a_python_based_backend_is_its_folders_model_py(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.py").write_text("")
    config = completed('backend: "mine"', "m")
    assert backend_model_file(config, "m", str(tmp_path)) == tmp_path / "mine" / "model.py"
    assert (config.runtime, config.default_model_filename) == ("model.py", "")  # (as Triton shows them)
    assert backend_model_file(completed('backend: "python"', "m"), "m", str(tmp_path)) is None


@pytest.mark.parametrize("name", ["../mine", "..", "mine/../mine", "/abs"])
def test_a_backend_is_named_never_a_path(tmp_path, name):
    """A load's config override cannot run a model.py from elsewhere on disk."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.py").write_text("")
    with pytest.raises(InvalidArgumentError, match="is not a backend's name"):
        backend_model_file(completed(f'backend: "{name}"', "m"), "m", str(tmp_path / "mine"))


@pytest.mark.parametrize("platform", ["custom", "onnxruntime_onnx"])
def test_backend_python_is_served_whatever_platform_it_also_names(platform):
    """As Triton 2.51 loads it (measured; its own QA wrong_model has platform "custom")."""
    config = completed(f'backend: "python" platform: "{platform}"', "m")
    cfg.validate(config, "m")
    assert backend_model_file(config, "m", "/nowhere") is None
    assert config.platform == platform


def test_validate_negative_max_batch_size():
    assert invalid("max_batch_size: -1") == "InvalidArgumentError: model 'm': max_batch_size must be >= 0, got -1"


@pytest.mark.parametrize("kind", ["input", "output"])
def test_validate_missing_data_type(kind):
    message = invalid(f'{kind} [ {{ name: "X" dims: [ 1 ] }} ]')
    assert message == f"InvalidArgumentError: model {kind} 'X' must specify 'data_type' for m"


@pytest.mark.parametrize("dims", ["[ 0 ]", "[ 2, -2 ]", "[ -3 ]", "[ 4, 0, 1 ]"])
@pytest.mark.parametrize("kind", ["input", "output"])
def test_validate_bad_dims(kind, dims):
    message = invalid(f'{kind} [ {{ name: "X" data_type: TYPE_INT32 dims: {dims} }} ]')
    assert message == (  # Triton 2.51's words
        f"InvalidArgumentError: model {kind} 'X' dimension must be integer >= 1, or -1 to "
        "indicate a variable-size dimension for m"
    )


def test_validate_accepts_variable_dims():
    cfg.validate(completed('input [ { name: "X" data_type: TYPE_INT32 dims: [ -1, 3 ] } ]'), "m")


@pytest.mark.parametrize("kind", ["input", "output"])
def test_validate_refuses_empty_dims_as_triton_does(kind):
    # Triton 2.51 (measured): "Invalid argument: model input 'IN' must specify 'dims' for m"
    message = invalid(f'{kind} [ {{ name: "S" data_type: TYPE_INT32 dims: [ ] }} ]')
    assert message == f"InvalidArgumentError: model {kind} 'S' must specify 'dims' for m"


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 8 ] }", "dynamic batching preferred size must be <= max batch size"),
        ("max_batch_size: 0 dynamic_batching { preferred_batch_size: [ 2 ] }", "dynamic batching preferred size must be <= max batch size"),
        ("max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 0 ] }", "dynamic batching preferred size must be positive"),
        ("max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 5 }", "default priority level must be in range [1, 2]"),
        ("max_batch_size: 4 dynamic_batching { priority_levels: 2 }", "default priority level must be in range [1, 2]"),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 1 "
            "priority_queue_policy { key: 5 value: { max_queue_size: 1 } } }",
            "priority queue policy must have priority level in range [1, 2]",
        ),
        (
            "max_batch_size: 4 sequence_batching { oldest { max_candidate_sequences: 4 preferred_batch_size: [ 8 ] } }",
            "sequence batching preferred batch size must be <= max batch size for m",
        ),
        (
            'max_batch_size: 4 sequence_batching { control_input [ { name: "S1" control [ { kind: CONTROL_SEQUENCE_START '
            'int32_false_true: [ 0, 1 ] } ] }, { name: "S2" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }',
            "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preserve_ordering: true priority_levels: 3 default_priority_level: 1 }",
            "Only one priority level is allowed when 'preserve_ordering' is true",
        ),
    ],
)
def test_validate_refuses_batching_settings_triton_refuses(text, message):
    # Each measured on Triton 2.51, which fails the load with these words; they loaded
    # READY here and the batchers quietly clamped what made no sense.
    assert invalid(text) == f"InvalidArgumentError: {message}"


@pytest.mark.parametrize("kind", ["input", "output"])
def test_validate_refuses_what_triton_refuses_of_a_tensor(kind):
    # Both measured on Triton 2.51, which fails the load with these words.
    message = invalid(f'{kind} [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] reshape: {{ shape: [ ] }} }} ]')
    assert message == (
        f"InvalidArgumentError: model {kind} 'X' cannot have empty reshape for non-batching model "
        "as scalar tensors are not supported for m"
    )
    batching = f'max_batch_size: 2 {kind} [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] reshape: {{ shape: [ ] }} }} ]'
    cfg.validate(completed(batching), "m")  # (a batch of scalars is fine)
    message = invalid(f'{kind} [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true }} ]')
    assert message == "InvalidArgumentError: shape tensors are only supported for TensorRT platform for m"


@pytest.mark.parametrize("kind", ["input", "output"])
def test_validate_duplicate_names(kind):
    message = invalid(
        f'{kind} [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }} ]'
    )
    assert message == f"InvalidArgumentError: model 'm': {kind} 'X' is declared twice"


def test_validate_tensor_without_name():
    message = invalid('input [ { data_type: TYPE_INT32 dims: [ 1 ] } ]')
    assert message == "InvalidArgumentError: model input must specify 'name' for m"  # (Triton's)


@pytest.mark.parametrize(
    "dims,shape,why",
    [  # Triton 2.51's rule and words (its ValidateIOShape; the last two measured side by side)
        ("[ 1, 4 ]", "[ 5 ]", "has different size for dims and reshape"),
        ("[ 2 ]", "[ ]", "has different size for dims and reshape"),
        ("[ -1, 4 ]", "[ 4 ]", "has different size for dims and reshape"),
        ("[ 2, 3 ]", "[ -1 ]", "has different size for dims and reshape"),
        (
            "[ -1, 4 ]",
            "[ -1, 2, -1 ]",
            "has different number of variable-size dimensions for dims and reshape",
        ),
        ("[ 2, 4, -1, 6 ]", "[ 2, -1, 24 ]", "has different size for dims and reshape"),
        ("[ -1, 4 ]", "[ 2, -1, 2 ]", "has different size for dims and reshape"),
        ("[ -1, 2 ]", "[ 2, -1 ]", "has different size for dims and reshape"),
        (
            "[ 4 ]",
            "[ 2, 0 ]",
            "reshape dimensions must be integer >= 1, or -1 to indicate a variable-size dimension",
        ),
    ],
)
def test_validate_bad_reshape(dims, shape, why):
    config = (
        'max_batch_size: 1 output [ { name: "R" data_type: TYPE_FP32 '
        f"dims: {dims} reshape: {{ shape: {shape} }} }} ]"
    )
    assert invalid(config) == f"InvalidArgumentError: model output 'R' {why} for m"


def test_validate_good_reshapes():
    cfg.validate(
        completed(
            'max_batch_size: 2 input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ] '
            'output [ { name: "R" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } }, '
            '{ name: "V" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape: { shape: [ -1, 2, 2 ] } }, '
            '{ name: "W" data_type: TYPE_FP32 dims: [ 2, 4, -1, 6 ] '
            'reshape: { shape: [ 8, -1, 1, 6 ] } } ]'
        ),
        "m",
    )


@pytest.mark.parametrize("count", [0, -1])
def test_an_instance_count_below_one_is_one(count):
    config = completed(f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]")
    cfg.validate(config, "m")
    assert config.instance_group[0].count == 1  # as Triton loads it


def test_validate_kind_gpu_without_gpus():
    message = invalid('instance_group [ { name: "g" kind: KIND_GPU } ]')
    assert message.startswith("InvalidArgumentError: instance group g of model m has kind KIND_GPU but no GPUs are available")


def test_validate_gpus_that_do_not_exist():
    message = invalid("instance_group [ { kind: KIND_GPU gpus: [0, 2] } ]", gpu_count=2)
    assert message == "InvalidArgumentError: model 'm', instance_group 'm_0': gpus [2] do not exist (this machine has 2 GPUs)"


def test_validate_kind_cpu_with_gpus():
    message = invalid("instance_group [ { kind: KIND_CPU gpus: [0] } ]", gpu_count=1)
    assert message == "InvalidArgumentError: instance group m_0 of model m has kind KIND_CPU but specifies one or more GPUs"


def test_validate_profile_is_for_tensorrt_only():
    message = invalid('instance_group [ { kind: KIND_CPU profile: ["p1"] } ]')
    assert message == (  # (Triton 2.51's words)
        "InvalidArgumentError: instance group m_0 of model m and platform specifies profile field "
        "which is only supported for TensorRT models"
    )


@pytest.mark.parametrize("value", ["maybe", "YES", ""])
def test_validate_force_cpu_only_input_tensors(value):
    message = invalid(f'parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "{value}" }} }}')
    assert message == (  # (Triton 2.51's code and first words)
        f"UnsupportedError: Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: '{value}' "
        "(it takes 'yes' or 'no')"
    )


@pytest.mark.parametrize("value", ["yes", "no"])
def test_validate_force_cpu_only_input_tensors_ok(value):
    cfg.validate(completed(f'parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "{value}" }} }}'), "m")


def test_validate_async_execute_concurrency():
    for bad in ("0", "-2", "many", ""):
        message = invalid(
            'parameters { key: "ASYNC_EXECUTE_CONCURRENCY" value: { string_value: "%s" } }' % bad
        )
        assert "ASYNC_EXECUTE_CONCURRENCY must be a positive integer" in message
    cfg.validate(
        completed('parameters { key: "ASYNC_EXECUTE_CONCURRENCY" value: { string_value: "4" } }'), "m"
    )
    cfg.validate(completed("model_transaction_policy { decoupled: true }"), "m")


def test_validate_ensemble_scheduling_goes_with_the_ensemble_platform():
    expected = (
        "InvalidArgumentError: model 'm': ensemble_scheduling goes with platform \"ensemble\", "
        "and an ensemble needs it"
    )
    assert invalid("ensemble_scheduling { }") == expected
    assert invalid('platform: "ensemble"') == expected


def test_an_ensemble_input_no_step_reads_is_refused_as_in_triton():
    from dlserve.engine import ensemble

    config = parse(
        'platform: "ensemble" '
        'input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] }, '
        '{ name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ] '
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ] '
        'ensemble_scheduling { step [ { model_name: "identity" '
        'input_map { key: "INPUT0" value: "A" } output_map { key: "OUTPUT0" value: "Y" } } ] }',
        name="e",
    )
    with pytest.raises(InvalidArgumentError) as info:
        ensemble.validate(config, "e")
    # (Triton's words, its stray quote too)
    assert info.value.message == "ensemble input 'B' for ensemble e' is not used"


def test_sequence_batching_defaults_and_control_inputs():
    config = completed("sequence_batching { }")
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert config.sequence_batching.WhichOneof("strategy_choice") is None  # as Triton shows it
    cfg.validate(config, "m")
    oldest = completed("max_batch_size: 4 sequence_batching { oldest { max_candidate_sequences: 4 } }")
    assert list(oldest.sequence_batching.oldest.preferred_batch_size) == [4]  # Triton's filling
    two_controls = (
        'sequence_batching { control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START '
        "int32_false_true: [ 0, 1 ] }, { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ] }"
    )
    assert "only one control" in invalid(two_controls)
    no_control = completed('sequence_batching { control_input [ { name: "S" } ] }')  # loads, as in Triton
    cfg.validate(no_control, "m")
    # Triton 2.51's words (side by side for the first and the last two)
    start = (
        'sequence_batching { control_input [ { name: "S" '
        "control [ { kind: CONTROL_SEQUENCE_START %s } ] } ] }"
    )
    fields = "'int32_false_true', 'fp32_false_true' %s 'bool_false_true'"
    kind = "for CONTROL_SEQUENCE_START for m"
    assert invalid(start % "") == (
        f"InvalidArgumentError: sequence batching must specify either {fields % 'or'} {kind}"
    )
    assert invalid(start % "int32_false_true: [ 1 ]") == (
        "InvalidArgumentError: sequence batching control 'int32_false_true' must have exactly 2 "
        "entries for CONTROL_SEQUENCE_START for m"
    )
    assert invalid(start % "int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ]") == (
        "InvalidArgumentError: sequence batching specifies more than one from "
        f"{fields % 'and'} {kind}"
    )
    nameless = (
        "sequence_batching { control_input [ { control [ { kind: CONTROL_SEQUENCE_START } ] } ] }"
    )
    assert invalid(nameless) == (
        "InvalidArgumentError: sequence batching control tensor must have a name for m"
    )
    corrid = 'sequence_batching { control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID } ] } ] }'
    assert "CORRID needs data_type" in invalid(corrid)


# -- repository: version policy ------------------------------------------------------------


def policy(text: str) -> mc.ModelVersionPolicy:
    return parse(f"version_policy {{ {text} }}").version_policy


@pytest.mark.parametrize(
    "text,available,expected",
    [
        ("latest { num_versions: 1 }", [1, 2, 3], [3]),
        ("latest { num_versions: 2 }", [3, 1, 2], [2, 3]),
        ("latest { num_versions: 5 }", [1, 2], [1, 2]),
        ("all { }", [1, 5, 9], [1, 5, 9]),
        ("specific { versions: [1, 3, 7] }", [1, 2, 3], [1, 3]),
        ("specific { versions: [7] }", [1, 2, 3], []),
        ("latest { num_versions: 1 }", [], []),
        ("latest { num_versions: 0 }", [1, 2], []),  # (Triton 2.51 fails such a load)
        ("latest { }", [1, 2], []),
    ],
)
def test_select_versions(text, available, expected):
    assert select_versions(policy(text), available) == expected


def test_select_versions_without_a_policy_is_latest_one():
    assert select_versions(mc.ModelVersionPolicy(), [4, 2, 9]) == [9]


def test_versions_on_disk_ignores_non_numeric_folders(tmp_path, caplog):
    for name in ["1", "2", "10", "abc", "1a", "-3", "__pycache__"]:
        (tmp_path / name).mkdir()
    (tmp_path / "7").write_text("a file, not a folder")
    (tmp_path / "config.pbtxt").write_text("")
    with caplog.at_level(logging.WARNING, logger="dlserve.engine"):
        assert ModelSource("m", tmp_path).versions_on_disk() == [1, 2, 10]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for ignored in ["abc", "1a", "-3", "__pycache__"]:
        assert f"'{ignored}'" in warned


def test_versions_on_disk_ignores_leading_zeros_as_triton_does(tmp_path, caplog):
    for name in ["0", "1", "007", "010"]:
        (tmp_path / name).mkdir()
    with caplog.at_level(logging.WARNING, logger="dlserve.engine"):
        assert ModelSource("m", tmp_path).versions_on_disk() == [0, 1]
    assert [r.getMessage() for r in caplog.records] == [
        f"model 'm': ignoring folder '{name}', version folders have no leading zeros" for name in ["007", "010"]
    ]


def test_versions_on_disk_ignores_unicode_digit_folders(tmp_path):
    for name in ["1", "²"]:
        (tmp_path / name).mkdir()
    assert ModelSource("m", tmp_path).versions_on_disk() == [1]


# -- repository: auto-complete detection ---------------------------------------------------


@pytest.mark.parametrize(
    "source,expected",
    [
        ("class TritonPythonModel:\n    @staticmethod\n    def auto_complete_config(c):\n        return c\n", True),
        ("class TritonPythonModel:\n    async def auto_complete_config(c):\n        return c\n", True),
        ("class TritonPythonModel:\n    def execute(self, requests):\n        return []\n", False),
        ("class Other:\n    def auto_complete_config(c):\n        return c\n\nclass TritonPythonModel:\n    pass\n", False),
        ("def auto_complete_config(c):\n    return c\n\nclass TritonPythonModel:\n    pass\n", False),
        ("class TritonPythonModel(object):\n    pass\n", False),
        # The hook may come from elsewhere: Triton asks the class, and so does the worker.
        ("class Base:\n    pass\n\nclass TritonPythonModel(Base):\n    pass\n", True),
        ("from base import TritonPythonModel\n", True),
        ("from base import Model as TritonPythonModel\n", True),
        ("from base import *\n\nclass TritonPythonModel:\n    pass\n", True),
        ("@register\nclass TritonPythonModel:\n    pass\n", True),
        ("class TritonPythonModel(metaclass=Meta):\n    pass\n", True),
        ("class TritonPythonModel:\n    auto_complete_config = staticmethod(complete)\n", True),
        ("class TritonPythonModel:\n    pass\n\nTritonPythonModel.auto_complete_config = f\n", True),
        ("class TritonPythonModel:\n    pass\n\nsetattr(TritonPythonModel, name, f)\n", True),
        ("TritonPythonModel = make_model()\n", True),
        # Unparseable files and files without the class are left for the instance's
        # worker to report, after the config has been checked.
        ("def broken(:\n", False),
        ("x = 1\n", False),
    ],
    ids=[
        "static", "async", "absent", "other-class", "module-level", "object-base", "inherited",
        "imported", "imported-as", "star-import", "decorated", "metaclass", "assigned-in-body",
        "assigned-after", "setattr", "bound-by-call", "syntax-error", "no-class",
    ],
)
def test_may_define_auto_complete(tmp_path, source, expected):
    path = tmp_path / "model.py"
    path.write_text(source)
    assert may_define_auto_complete(path) is expected


def test_may_define_auto_complete_of_probe_models():
    assert may_define_auto_complete(PROBE_REPO / "auto_complete" / "1" / "model.py")
    assert not may_define_auto_complete(PROBE_REPO / "add_sub" / "1" / "model.py")
    assert not may_define_auto_complete(Path("/nonexistent/model.py"))  # the instance reports it


# -- repository: folders and uploads -------------------------------------------------------


@pytest.fixture
def repository(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    repo = Repository([root])
    yield repo
    repo.close()


def test_repository_requires_folders(tmp_path):
    with pytest.raises(InternalError, match=f"^failed to stat file {tmp_path / 'missing'}$"):  # (Triton's)
        Repository([tmp_path / "missing"])
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        Repository([tmp_path / "file"])


def test_scan_and_find(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for path in [a / "m1", a / "dup", b / "dup", b / "m2", a / ".hidden"]:
        path.mkdir(parents=True)
    (a / "not_a_model.txt").write_text("")
    repo = Repository([a, b])
    try:
        found = repo.scan()
        assert sorted(found) == [("", "dup"), ("", "m1"), ("", "m2")]
        assert found[("", "m1")] == ModelSource("m1", a.resolve() / "m1")
        assert [s.path for s in repo.find("m2")] == [b.resolve() / "m2"]
        with pytest.raises(InvalidArgumentError, match="'dup' appears in more than one model repository"):
            repo.find("dup")
        with pytest.raises(NotFoundError, match="failed to load 'nope'"):
            repo.find("nope")
        assert repo.read_config(repo.find("m1")[0]) is None
        (a / "m1" / "config.pbtxt").write_text('max_batch_size: 3')
        assert repo.read_config(repo.find("m1")[0]).max_batch_size == 3
    finally:
        repo.close()


def test_with_namespacing_each_repository_is_a_namespace_named_as_given(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for path in [a / "m1", a / "dup", b / "dup"]:
        path.mkdir(parents=True)
    repo = Repository([a, f"{b}/"], namespacing=True)
    try:
        found = repo.scan()
        assert sorted(found) == [(str(a), "dup"), (str(a), "m1"), (f"{b}/", "dup")]
        assert {(s.namespace, s.path) for s in repo.find("dup")} == {
            (str(a), a.resolve() / "dup"), (f"{b}/", b.resolve() / "dup")}
        assert found[(str(a), "m1")].key == (str(a), "m1")
    finally:
        repo.close()


def test_write_upload_writes_the_files(repository):
    source = repository.write_upload("up", {"config.pbtxt": b'backend: "python"', "1/model.py": b"x = 1\n", "1/sub/data.bin": b"\x00\xff"})
    assert source.name == "up"
    assert (source.path / "config.pbtxt").read_bytes() == b'backend: "python"'
    assert (source.path / "1" / "model.py").read_bytes() == b"x = 1\n"
    assert (source.path / "1" / "sub" / "data.bin").read_bytes() == b"\x00\xff"
    assert source.versions_on_disk() == [1]
    # A second upload of the same model gets a folder of its own (the first one's versions
    # may serve on); each folder goes when the last that holds it lets go.
    again = repository.write_upload("up", {"2/model.py": b""})
    assert again.path != source.path and again.path.name == "up"
    assert again.versions_on_disk() == [2]
    assert not (again.path / "config.pbtxt").exists()
    assert (source.path / "1" / "model.py").read_bytes() == b"x = 1\n"
    source.upload.hold()  # (as a version loaded from it does)
    source.upload.release()
    assert source.path.exists()
    source.upload.release()
    assert not source.path.parent.exists()
    assert again.path.exists()


@pytest.mark.parametrize("path", ["../x", "../../etc/passwd", "1/../../x", "/etc/passwd", "/tmp/x", "", "."])
def test_write_upload_rejects_paths_outside_the_model_folder(repository, tmp_path, path):
    with pytest.raises(InvalidArgumentError, match=r"load of model 'up': file path 'file:.*' escapes the model folder"):
        repository.write_upload("up", {"1/model.py": b"", path: b"evil"})
    assert not (tmp_path / "x").exists()
    assert not list(repository._uploads.iterdir())  # (nor the files before it)


def test_repository_close_removes_uploads(tmp_path):
    (tmp_path / "r").mkdir()
    repo = Repository([tmp_path / "r"])
    source = repo.write_upload("up", {"1/model.py": b""})
    assert source.path.exists()
    repo.close()
    assert not source.path.exists()


def test_repository_makes_no_uploads_folder_until_a_load_brings_files(tmp_path, monkeypatch):
    # a server killed before its stop must not leave an empty folder in the temp dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "r").mkdir()
    repo = Repository([tmp_path / "r"])
    assert list(tmp_path.glob("dlserve-uploads-*")) == []
    repo.write_upload("up", {"1/model.py": b""})
    assert len(list(tmp_path.glob("dlserve-uploads-*"))) == 1
    repo.close()
    assert list(tmp_path.glob("dlserve-uploads-*")) == []


@pytest.mark.parametrize("name", ["..", ".", "", " up", "a/b", "a\\b", "x\0"], ids=repr)
def test_write_upload_rejects_bad_model_names(repository, name):
    with pytest.raises(InvalidArgumentError, match="model name"):
        repository.write_upload(name, {"1/model.py": b""})


def test_write_upload_model_name_cannot_escape_the_uploads_folder(repository, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    uploads = repository.write_upload("first", {"1/model.py": b""}).path.parent
    name = os.path.relpath(victim, uploads)  # "../..../victim"
    assert name.startswith("..")
    with pytest.raises(InvalidArgumentError, match="path traversal"):
        repository.write_upload(name, {"1/model.py": b""})
    assert (victim / "precious.txt").read_text() == "keep me"
    assert not (victim / "1").exists()


@pytest.mark.parametrize(
    "data_type,correlation_id,expected",
    [
        ("TYPE_INT32", 2**40 + 7, 7),  # the low bits, as Triton casts it
        ("TYPE_UINT32", 2**40 + 7, 7),
        ("TYPE_INT64", 2**63 + 5, -(2**63) + 5),
        ("TYPE_UINT64", 2**64 - 1, 2**64 - 1),
        ("TYPE_UINT64", -1, 2**64 - 1),  # (a gRPC int64_param: a uint64 in an int64)
    ],
)
def test_a_corrid_control_takes_what_fits_of_the_correlation_id(data_type, correlation_id, expected):
    """A correlation ID that did not fit the CORRID control's type raised while its
    batch was made, which left its sequence's slot taken for good."""
    spec = parse(
        f'sequence_batching {{ control_input [ {{ name: "C" control [ {{ kind: CONTROL_SEQUENCE_CORRID '
        f"data_type: {data_type} }} ] }} ] }}",
        "m",
    ).sequence_batching.control_input[0]
    control = ControlInput.parse("m", spec)
    request = Request(model_name="m", inputs={}, on_response=lambda response: None, correlation_id=correlation_id)
    assert control.tensor(request, batching=True).as_numpy().tolist() == [[expected]]


def test_a_corrid_control_of_another_type_is_refused_as_in_triton():
    text = 'sequence_batching { control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ] }'
    assert invalid(text) == (
        "InvalidArgumentError: unexpected data type for control CONTROL_SEQUENCE_CORRID for m. Allowed "
        "data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
    )



RAGGED = (
    'max_batch_size: 8 input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ] '
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ] '
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [  # Triton 2.51's words (measured side by side)
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 source_input: "NOPE" } ]',
         "unknown source input name 'NOPE' for m"),
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 source_input: "OUTPUT0" } ]',
         "unknown source input name 'OUTPUT0' for m"),
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT64 source_input: "INPUT0" } ]',
         "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" source_input: "INPUT0" } ]',
         "unexpected batch input data type 'TYPE_INVALID'"),
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 } ]',
         "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 0 for m"),
        ('batch_input [ { kind: BATCH_ITEM_SHAPE target_name: "N" data_type: TYPE_INT32 '
         'source_input: [ "INPUT0", "INPUT0" ] } ]',
         "batch input kind 'BATCH_ITEM_SHAPE' expects 1 source input, got 2 for m"),
        ('batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "NOPE" source_input: "INPUT0" } ]',
         "unknown target output name 'NOPE' for m"),
        ('batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "OUTPUT0" source_input: "NOPE" } ]',
         "unknown source input name 'NOPE' for m"),
        ('batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "OUTPUT0" } ]',
         "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 0 for m"),
        ('batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT0" } ]',
         "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' names no target output for m"),
    ],
)
def test_batch_inputs_and_outputs_are_checked_as_triton_checks_them(fields, message):
    assert invalid(RAGGED + fields) == f"InvalidArgumentError: {message}"


def test_good_batch_inputs_and_outputs_load():
    cfg.validate(completed(
        RAGGED + 'batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_INT32 '
        'source_input: "INPUT0" } ] batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "OUTPUT0" '
        'source_input: "INPUT0" } ]'
    ), "m")
