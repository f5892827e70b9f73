"""A model's config checked as Triton checks it: Triton's defaults and validation.

:func:`complete` fills in what Triton fills in before a model loads and
:func:`validate` rejects what Triton would (and what dlserve cannot serve yet) with a
message naming the model and the field. Reading and rendering the config's text and
JSON forms is :mod:`dlserve.engine.config_forms`.
"""

from __future__ import annotations

from typing import Any

from dlserve.engine.backends import BACKEND_RUNTIME, PYTHON_BACKEND
from dlserve.engine.inline_offers import inline_allowed
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.sequence import ControlInput
from dlserve.errors import InvalidArgumentError, UnsupportedError

ModelConfig = mc.ModelConfig
InstanceGroup = mc.ModelInstanceGroup
DEFAULT_MODEL_FILENAME = "model.py"
ENSEMBLE_PLATFORM = "ensemble"


def environment_parameters(config: mc.ModelConfig) -> tuple[str, str]:
    """The model's EXECUTION_ENV_PATH and EXECUTION_ENV_REQUIREMENTS parameters ("" for
    each it does not set: it runs in the server's Python)."""
    path = config.parameters.get("EXECUTION_ENV_PATH")
    requirements = config.parameters.get("EXECUTION_ENV_REQUIREMENTS")
    return (
        "" if path is None else path.string_value,
        "" if requirements is None else requirements.string_value,
    )


def complete(config: mc.ModelConfig, model_name: str, gpu_count: int = 0) -> None:
    """Fill in the defaults Triton fills in before a Python model loads."""
    complete_instances(config, model_name, gpu_count)
    if config.platform == ENSEMBLE_PLATFORM:
        return
    if config.HasField("sequence_batching"):
        sequence = config.sequence_batching
        if not sequence.max_sequence_idle_microseconds:
            sequence.max_sequence_idle_microseconds = 1_000_000
        # No strategy stays none (the direct one runs, as in Triton, which shows none).
        oldest = sequence.oldest
        if sequence.HasField("oldest") and not oldest.preferred_batch_size and config.max_batch_size > 0:
            oldest.preferred_batch_size.append(config.max_batch_size)
    if config.HasField("dynamic_batching") and not config.dynamic_batching.preferred_batch_size:
        if config.max_batch_size > 0:
            config.dynamic_batching.preferred_batch_size.append(config.max_batch_size)


def complete_instances(config: mc.ModelConfig, model_name: str, gpu_count: int = 0) -> None:
    """The defaults that do not depend on batching: what Triton has filled in when a
    model's ``auto_complete_config`` sees the config (which may change max_batch_size)."""
    if not config.name:
        config.name = model_name
    if not config.backend and not config.platform:
        config.backend = PYTHON_BACKEND
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.platform == ENSEMBLE_PLATFORM:
        # no model file, instances or optimization: the steps' models have those
        config.model_transaction_policy.SetInParent()
        return
    if config.backend != PYTHON_BACKEND:  # a Python-based backend's model, as Triton shows it
        config.runtime = config.runtime or BACKEND_RUNTIME
    elif not config.default_model_filename:
        config.default_model_filename = DEFAULT_MODEL_FILENAME
    optimization = config.optimization
    for pinned in ("input_pinned_memory", "output_pinned_memory"):
        if not optimization.HasField(pinned):  # (also beside other optimization settings)
            getattr(optimization, pinned).enable = True
    if not config.instance_group:
        group = config.instance_group.add()
        group.name = config.name
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.count < 1:  # (Triton runs one instance for 0 and for a negative count)
            group.count = 1
        if group.kind == InstanceGroup.KIND_AUTO:
            if gpu_count > 0:
                group.kind = InstanceGroup.KIND_GPU
                if not group.gpus:
                    group.gpus.extend(range(gpu_count))
            else:
                group.kind = InstanceGroup.KIND_CPU


def _check_tensors(config: mc.ModelConfig, kind: str, tensors: Any) -> None:
    """Each input's or output's name, data type, dims and reshape, in Triton's words."""
    seen: set[str] = set()
    for tensor in tensors:
        if not tensor.name:
            raise InvalidArgumentError(f"model {kind} must specify 'name' for {config.name}")
        if tensor.name in seen:
            raise InvalidArgumentError(f"model '{config.name}': {kind} '{tensor.name}' is declared twice")
        seen.add(tensor.name)
        prefix = f"model {kind} '{tensor.name}'"
        if tensor.data_type == mc.TYPE_INVALID:
            raise InvalidArgumentError(f"{prefix} must specify 'data_type' for {config.name}")
        if not tensor.dims and config.platform != ENSEMBLE_PLATFORM:
            raise InvalidArgumentError(f"{prefix} must specify 'dims' for {config.name}")
        if tensor.HasField("reshape") and not tensor.reshape.shape and config.max_batch_size == 0:
            raise InvalidArgumentError(
                f"{prefix} cannot have empty reshape for non-batching "
                f"model as scalar tensors are not supported for {config.name}"
            )
        if any(dim < -1 or dim == 0 for dim in tensor.dims):
            raise InvalidArgumentError(
                f"{prefix} dimension must be integer >= 1, or -1 to indicate a variable-size "
                f"dimension for {config.name}"
            )
        if tensor.HasField("reshape"):
            why = _reshape_problem(list(tensor.dims), list(tensor.reshape.shape))
            if why:
                raise InvalidArgumentError(f"{prefix} {why} for {config.name}")
        if tensor.is_shape_tensor:
            raise InvalidArgumentError(
                f"shape tensors are only supported for TensorRT platform for {config.name}"
            )


def _reshape_problem(dims: list[int], shape: list[int]) -> str:
    """Why ``reshape`` cannot stand for ``dims`` (Triton's rule and words), or "". Both
    must hold as many elements; an empty reshape stands for dims of one element; with
    variable (-1) dimensions the runs of fixed ones between them must match, run by run
    ([2, 4, -1, 6] as [8, -1, 1, 6], not as [2, -1, 24])."""
    if any(dim < -1 or dim == 0 for dim in shape):
        return (
            "reshape dimensions must be integer >= 1, or -1 to indicate a variable-size dimension"
        )

    def runs(values: list[int]) -> list[int]:
        products = [1]
        for value in values:
            if value == -1:
                products.append(1)
            else:
                products[-1] *= value
        return products

    dims_runs, shape_runs = runs(dims), runs(shape)
    variable = len(dims_runs) > 1
    if variable != (len(shape_runs) > 1):
        return "has different size for dims and reshape"
    if not variable:
        count = dims_runs[0] if dims else 0
        if count != (shape_runs[0] if shape else 0) and (shape or count != 1):
            return "has different size for dims and reshape"
        return ""
    if len(dims_runs) != len(shape_runs):
        return "has different number of variable-size dimensions for dims and reshape"
    if dims_runs != shape_runs:
        return "has different size for dims and reshape"
    return ""


def validate(config: mc.ModelConfig, model_name: str, gpu_count: int = 0) -> None:
    """Reject a completed config Triton would reject, or that dlserve cannot serve."""
    if config.name != model_name:
        raise InvalidArgumentError(
            f"model '{model_name}': config.pbtxt 'name' is '{config.name}', but it must "
            "match the model's folder name"
        )
    if config.max_batch_size < 0:
        raise InvalidArgumentError(
            f"model '{model_name}': max_batch_size must be >= 0, got {config.max_batch_size}"
        )
    _check_tensors(config, "input", config.input)
    _check_tensors(config, "output", config.output)
    for group in config.instance_group:
        where = f"model '{model_name}', instance_group '{group.name}'"
        if group.kind == InstanceGroup.KIND_GPU:
            if gpu_count == 0:
                raise InvalidArgumentError(  # (Triton 2.51's words)
                    f"instance group {group.name} of model {model_name} has kind KIND_GPU "
                    "but no GPUs are available"
                )
            bad = [g for g in group.gpus if g < 0 or g >= gpu_count]
            if bad:
                raise InvalidArgumentError(
                    f"{where}: gpus {bad} do not exist (this machine has {gpu_count} GPUs)"
                )
        elif group.gpus and group.kind == InstanceGroup.KIND_CPU:
            raise InvalidArgumentError(  # (Triton 2.51's words)
                f"instance group {group.name} of model {model_name} has kind KIND_CPU but specifies "
                "one or more GPUs"
            )
        if group.profile:  # (refused as Triton refuses it for Python models, in its words)
            raise InvalidArgumentError(
                f"instance group {group.name} of model {model_name} and platform specifies "
                "profile field which is only supported for TensorRT models"
            )
    parameters = config.parameters
    force_cpu = parameters.get("FORCE_CPU_ONLY_INPUT_TENSORS")
    if force_cpu is not None and force_cpu.string_value not in ("yes", "no"):
        raise UnsupportedError(  # (Triton's code and first words)
            f"Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: '{force_cpu.string_value}' "
            "(it takes 'yes' or 'no')"
        )
    try:
        inline_allowed(config)
    except ValueError as exc:
        raise InvalidArgumentError(f"model '{model_name}': {exc}") from None
    concurrency = parameters.get("ASYNC_EXECUTE_CONCURRENCY")
    if concurrency is not None and not (
        concurrency.string_value.isdigit() and int(concurrency.string_value) >= 1
    ):
        raise InvalidArgumentError(
            f"model '{model_name}': parameter ASYNC_EXECUTE_CONCURRENCY must be a positive "
            f"integer, got '{concurrency.string_value}'"
        )
    check_response_cache(config, model_name)
    ensemble = config.platform == ENSEMBLE_PLATFORM
    if ensemble and config.model_warmup:
        raise InvalidArgumentError(f"model_warmup can not be specified for ensemble '{model_name}'")
    if ensemble != config.HasField("ensemble_scheduling"):
        raise InvalidArgumentError(
            f"model '{model_name}': ensemble_scheduling goes with platform \"ensemble\", and "
            "an ensemble needs it"
        )
    if config.HasField("dynamic_batching"):
        _check_dynamic_batching(config.dynamic_batching, config.max_batch_size)
    _check_batch_inputs_and_outputs(config)
    if config.HasField("sequence_batching"):
        names = {t.name for t in config.input}
        kinds: set[int] = set()
        for spec in config.sequence_batching.control_input:
            if spec.name in names:
                raise InvalidArgumentError(
                    f"model '{model_name}': control input '{spec.name}' is also a model input"
                )
            control = ControlInput.parse(model_name, spec)
            if control is None:
                continue
            if control.kind in kinds:
                kind = mc.ModelSequenceBatching.Control.Kind.Name(control.kind)
                raise InvalidArgumentError(f"sequence batching specifies multiple {kind} tensors")
            kinds.add(control.kind)
        oldest = config.sequence_batching.oldest
        if any(size > config.max_batch_size for size in oldest.preferred_batch_size):
            raise InvalidArgumentError(  # (Triton's words, side by side)
                f"sequence batching preferred batch size must be <= max batch size for {model_name}"
            )


def check_response_cache(config: mc.ModelConfig, model_name: str) -> None:
    """A response cache on a decoupled or sequence model is refused (Triton's words);
    run again on an ensemble once its steps have made it decoupled."""
    if not config.response_cache.enable:
        return
    if config.model_transaction_policy.decoupled:
        unsupported = "with 'decoupled' transaction policy"
    elif config.HasField("sequence_batching"):
        unsupported = "with sequence batching scheduler"
    else:
        return
    raise InvalidArgumentError(
        f"Response Cache does not currently support model {model_name} {unsupported}. "
        "Please disable the response cache."
    )


def _check_batch_inputs_and_outputs(config: mc.ModelConfig) -> None:
    """What Triton refuses of ``batch_input`` / ``batch_output`` at load, in its words.
    (Its Python backend then passes neither to the model, and neither does dlserve.)"""
    name = config.name
    inputs = {tensor.name for tensor in config.input}
    outputs = {tensor.name for tensor in config.output}
    for spec in config.batch_input:
        kind = mc.BatchInput.Kind.Name(spec.kind)
        if spec.data_type == mc.TYPE_INVALID:
            raise InvalidArgumentError("unexpected batch input data type 'TYPE_INVALID'")
        if spec.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            raise InvalidArgumentError(f"batch input data type must be TYPE_INT32 or TYPE_FP32 for {name}")
        _check_batch_sources(f"batch input kind '{kind}'", spec.source_input, inputs, name)
    for spec in config.batch_output:
        kind = mc.BatchOutput.Kind.Name(spec.kind)
        if not spec.target_name:  # (Triton 2.51's server crashed on this one)
            raise InvalidArgumentError(f"batch output kind '{kind}' names no target output for {name}")
        for target in spec.target_name:
            if target not in outputs:
                raise InvalidArgumentError(f"unknown target output name '{target}' for {name}")
        _check_batch_sources(f"batch output kind '{kind}'", spec.source_input, inputs, name)


def _check_batch_sources(what: str, sources: Any, inputs: set[str], name: str) -> None:
    if len(sources) != 1:
        raise InvalidArgumentError(f"{what} expects 1 source input, got {len(sources)} for {name}")
    if sources[0] not in inputs:
        raise InvalidArgumentError(f"unknown source input name '{sources[0]}' for {name}")


def _check_dynamic_batching(batching: mc.ModelDynamicBatching, max_batch_size: int) -> None:
    """What Triton refuses of ``dynamic_batching`` at load, in its words."""
    for size in batching.preferred_batch_size:
        if size <= 0:
            raise InvalidArgumentError("dynamic batching preferred size must be positive")
        if size > max_batch_size:
            raise InvalidArgumentError("dynamic batching preferred size must be <= max batch size")
    levels = batching.priority_levels
    if batching.preserve_ordering and levels > 1:
        raise InvalidArgumentError("Only one priority level is allowed when 'preserve_ordering' is true")
    if levels:
        if not 1 <= batching.default_priority_level <= levels:
            raise InvalidArgumentError(f"default priority level must be in range [1, {levels}]")
        if any(not 1 <= level <= levels for level in batching.priority_queue_policy):
            raise InvalidArgumentError(
                f"priority queue policy must have priority level in range [1, {levels}]"
            )

