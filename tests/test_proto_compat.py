"""Wire-compatibility checks for dlserve's Triton-compatible .proto modules.

* the generated modules import, as package modules, next to tritonclient's
  own generated modules in the same process (private descriptor pools);
* config.pbtxt files parse with ``google.protobuf.text_format``;
* every message / enum / service in tritonclient's generated modules has an
  exact counterpart in ours (field name, number, type, label, type name,
  oneof membership, map-ness, enum values, RPC signatures) and vice versa;
* messages serialized with one side parse with the other and come out
  identical, in both directions.

The tritonclient-based checks are skipped when tritonclient is absent.
Regenerate the modules with ``scripts/gen_protos.sh``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:  # plain ``pytest`` (unlike ``python -m pytest``) may not put ROOT on sys.path
    import dlserve  # noqa: F401
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    sys.path.insert(0, str(ROOT))

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    json_format,
    text_format,
    unknown_fields,
)

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.frontends.proto import grpc_service_pb2 as gs
from dlserve.frontends.proto import grpc_service_pb2_grpc as gs_grpc
from dlserve.frontends.proto import health_pb2, health_pb2_grpc

ADD_SUB_PBTXT = pathlib.Path(
    "/work/shared/tools/reference-servers/models/add_sub/config.pbtxt"
)
TRITON_JSON_DIR = ROOT / "tests" / "data" / "triton_reference"

RICH_DYNAMIC_PBTXT = r"""
name: "rich_dynamic"
backend: "python"
max_batch_size: 16
version_policy: { specific: { versions: [ 1, 3 ] } }
input [
  {
    name: "IN"
    data_type: TYPE_FP16
    format: FORMAT_NCHW
    dims: [ 3, -1, -1 ]
    reshape: { shape: [ 3, 224, 224 ] }
    allow_ragged_batch: true
    optional: true
  }
]
output [
  { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] label_filename: "labels.txt" }
]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_INT32 source_input: "IN" }
]
batch_output [
  { target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "IN" }
]
instance_group [
  {
    name: "gpu_group"
    kind: KIND_GPU
    count: 2
    gpus: [ 0, 1 ]
    rate_limiter {
      resources [ { name: "R1" global: true count: 4 } ]
      priority: 2
    }
    secondary_devices [ { kind: KIND_NVDLA device_id: 1 } ]
    profile: [ "0", "1" ]
    host_policy: "gpu_0"
  },
  { kind: KIND_CPU count: 1 passive: true }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    timeout_action: DELAY
    default_timeout_microseconds: 5000
    allow_timeout_override: true
    max_queue_size: 32
  }
  priority_queue_policy {
    key: 1
    value { timeout_action: REJECT max_queue_size: 8 }
  }
}
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda {
    graphs: true
    busy_wait_events: true
    output_copy_stream: true
    graph_spec [
      {
        batch_size: 4
        input { key: "IN" value { dim: [ 3, 224, 224 ] } }
        graph_lower_bound {
          batch_size: 1
          input { key: "IN" value { dim: [ 3, 32, 32 ] } }
        }
      }
    ]
  }
  execution_accelerators {
    gpu_execution_accelerator [
      { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } }
    ]
    cpu_execution_accelerator [ { name: "openvino" } ]
  }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: true }
  gather_kernel_buffer_threshold: 2
  eager_batching: true
}
parameters [
  { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } },
  { key: "mode" value: { string_value: "fast" } }
]
cc_model_filenames { key: "8.0" value: "model_sm80.plan" }
metric_tags { key: "team" value: "vision" }
default_model_filename: "model.py"
model_warmup [
  {
    name: "warm"
    batch_size: 2
    count: 3
    inputs {
      key: "IN"
      value { data_type: TYPE_FP16 dims: [ 3, 224, 224 ] random_data: true }
    }
  }
]
model_operations { op_library_filename: [ "libcustom.so" ] }
model_transaction_policy { decoupled: true }
model_repository_agents {
  agents [ { name: "checksum" parameters { key: "MD5:1/model.py" value: "abc" } } ]
}
response_cache { enable: true }
model_metrics {
  metric_control [
    {
      metric_identifier { family: "nv_inference_first_response_histogram_ms" }
      histogram_options { buckets: [ 0.5, 1, 2.5, 10 ] }
    }
  ]
}
"""

RICH_SEQUENCE_PBTXT = r"""
name: "rich_sequence"
platform: "onnxruntime_onnx"
runtime: "libtriton_onnxruntime.so"
max_batch_size: 4
version_policy: { latest: { num_versions: 2 } }
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] is_shape_tensor: false } ]
output [ { name: "Y" data_type: TYPE_BF16 dims: [ 1 ] is_non_linear_format_io: false } ]
instance_group [ { kind: KIND_GPU count: 1 gpus: [ 2 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest {
    max_candidate_sequences: 8
    preferred_batch_size: [ 2, 4 ]
    max_queue_delay_microseconds: 50
    preserve_ordering: true
  }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "READY"
      control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ]
    },
    {
      name: "END"
      control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "CORRID"
      control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ]
    }
  ]
  state [
    {
      input_name: "STATE_IN"
      output_name: "STATE_OUT"
      data_type: TYPE_FP32
      dims: [ 1, 128 ]
      initial_state [ { name: "init" data_type: TYPE_FP32 dims: [ 1, 128 ] zero_data: true } ]
      use_same_buffer_for_input_output: true
      use_growable_memory: true
    }
  ]
  iterative_sequence: true
}
parameters { key: "k" value { string_value: "v" } }
model_transaction_policy { decoupled: false }
"""

RICH_ENSEMBLE_PBTXT = r"""
name: "rich_ensemble"
platform: "ensemble"
max_batch_size: 1
input [ { name: "RAW" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling {
  max_inflight_requests: 16
  step [
    {
      model_name: "decode"
      model_version: -1
      input_map { key: "BYTES" value: "RAW" }
      output_map { key: "IMAGE" value: "img" }
    },
    {
      model_name: "classify"
      model_version: 3
      input_map { key: "INPUT" value: "img" }
      output_map { key: "OUTPUT" value: "SCORES" }
    }
  ]
}
"""


def _parse_config(text: str, module=mc):
    return text_format.Parse(text, module.ModelConfig())


# --------------------------------------------------------------------------
# (a) the generated modules import and are wired together correctly


def test_generated_modules_import():
    assert mc.DESCRIPTOR.package == "inference"
    assert gs.DESCRIPTOR.package == "inference"
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
    # grpc_service depends on model_config inside one shared private pool
    assert gs.DESCRIPTOR.pool is mc.DESCRIPTOR.pool
    assert mc.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert health_pb2.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert gs.ModelConfigResponse.DESCRIPTOR.fields_by_name["config"].message_type \
        is mc.ModelConfig.DESCRIPTOR
    # gRPC stubs / servicers exist for every RPC
    service = gs.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        assert hasattr(gs_grpc.GRPCInferenceServiceServicer, method.name)
    assert hasattr(gs_grpc, "GRPCInferenceServiceStub")
    assert hasattr(gs_grpc, "add_GRPCInferenceServiceServicer_to_server")
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert [m.name for m in health.methods] == ["Check", "Watch"]
    assert health.methods_by_name["Watch"].server_streaming
    assert hasattr(health_pb2_grpc, "HealthServicer")


def test_grpc_method_paths_match_triton():
    service = gs.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    expected = {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
        "ModelMetadata", "ModelInfer", "ModelStreamInfer", "ModelConfig",
        "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
        "RepositoryModelUnload", "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings",
    }
    assert {m.name for m in service.methods} == expected
    stream = service.methods_by_name["ModelStreamInfer"]
    assert stream.client_streaming and stream.server_streaming
    assert health_pb2.DESCRIPTOR.services_by_name["Health"].full_name == \
        "grpc.health.v1.Health"
    status = health_pb2.HealthCheckResponse.ServingStatus
    assert dict(status.items()) == {
        "UNKNOWN": 0, "SERVING": 1, "NOT_SERVING": 2, "SERVICE_UNKNOWN": 3,
    }


# --------------------------------------------------------------------------
# (b) config.pbtxt parsing


@pytest.mark.skipif(not ADD_SUB_PBTXT.exists(), reason="reference add_sub model absent")
def test_parse_add_sub_pbtxt():
    cfg = _parse_config(ADD_SUB_PBTXT.read_text())
    assert cfg.name == "add_sub"
    assert cfg.backend == "python"
    assert cfg.max_batch_size == 0
    assert [i.name for i in cfg.input] == ["INPUT0", "INPUT1"]
    assert [o.name for o in cfg.output] == ["OUTPUT0", "OUTPUT1"]
    assert all(t.data_type == mc.TYPE_FP32 and list(t.dims) == [16]
               for t in list(cfg.input) + list(cfg.output))
    assert len(cfg.instance_group) == 1
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert cfg.instance_group[0].count == 1
    assert cfg.WhichOneof("scheduling_choice") is None


def test_parse_rich_dynamic_config():
    cfg = _parse_config(RICH_DYNAMIC_PBTXT)
    assert cfg.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert cfg.version_policy.WhichOneof("policy_choice") == "specific"
    assert list(cfg.version_policy.specific.versions) == [1, 3]
    db = cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [4, 8]
    assert db.default_queue_policy.timeout_action == mc.ModelQueuePolicy.DELAY
    assert db.priority_queue_policy[1].max_queue_size == 8
    gpu_group, cpu_group = cfg.instance_group
    assert gpu_group.kind == mc.ModelInstanceGroup.KIND_GPU
    assert list(gpu_group.gpus) == [0, 1]
    assert gpu_group.rate_limiter.resources[0].name == "R1"
    assert getattr(gpu_group.rate_limiter.resources[0], "global") is True
    assert gpu_group.secondary_devices[0].device_id == 1
    assert cpu_group.passive and cpu_group.kind == mc.ModelInstanceGroup.KIND_CPU
    assert cfg.parameters["mode"].string_value == "fast"
    assert cfg.parameters["EXECUTION_ENV_PATH"].string_value.endswith("env.tar.gz")
    assert cfg.cc_model_filenames["8.0"] == "model_sm80.plan"
    assert cfg.metric_tags["team"] == "vision"
    assert cfg.model_transaction_policy.decoupled is True
    assert cfg.input[0].reshape.shape == [3, 224, 224]
    assert cfg.input[0].format == mc.ModelInput.FORMAT_NCHW
    spec = cfg.optimization.cuda.graph_spec[0]
    assert list(spec.input["IN"].dim) == [3, 224, 224]
    assert list(spec.graph_lower_bound.input["IN"].dim) == [3, 32, 32]
    accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert accel.parameters["precision_mode"] == "FP16"
    warm = cfg.model_warmup[0]
    assert warm.inputs["IN"].WhichOneof("input_data_type") == "random_data"
    assert cfg.model_metrics.metric_control[0].histogram_options.buckets == [0.5, 1, 2.5, 10]
    # text round trip is lossless
    again = _parse_config(text_format.MessageToString(cfg))
    assert again == cfg


def test_parse_rich_sequence_and_ensemble_configs():
    seq = _parse_config(RICH_SEQUENCE_PBTXT)
    assert seq.WhichOneof("scheduling_choice") == "sequence_batching"
    sb = seq.sequence_batching
    assert sb.WhichOneof("strategy_choice") == "oldest"
    assert sb.oldest.max_candidate_sequences == 8
    kinds = [ci.control[0].kind for ci in sb.control_input]
    assert kinds == [0, 1, 2, 3]
    assert sb.control_input[3].control[0].data_type == mc.TYPE_UINT64
    assert list(sb.control_input[1].control[0].bool_false_true) == [False, True]
    state = sb.state[0]
    assert state.initial_state[0].WhichOneof("state_data") == "zero_data"
    assert state.use_growable_memory and sb.iterative_sequence
    assert list(seq.instance_group[0].gpus) == [2]
    assert seq.version_policy.latest.num_versions == 2
    assert seq.model_transaction_policy.decoupled is False
    assert seq.output[0].data_type == mc.TYPE_BF16

    ens = _parse_config(RICH_ENSEMBLE_PBTXT)
    assert ens.WhichOneof("scheduling_choice") == "ensemble_scheduling"
    assert ens.ensemble_scheduling.max_inflight_requests == 16
    assert ens.ensemble_scheduling.step[0].model_version == -1
    assert ens.ensemble_scheduling.step[1].input_map["INPUT"] == "img"


def test_scheduling_choice_is_a_oneof():
    with pytest.raises(text_format.ParseError):
        _parse_config(
            'name: "x" dynamic_batching {} sequence_batching {}'
        )
    cfg = mc.ModelConfig()
    cfg.dynamic_batching.max_queue_delay_microseconds = 1
    cfg.sequence_batching.max_sequence_idle_microseconds = 1
    assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"
    assert not cfg.HasField("dynamic_batching")


@pytest.mark.skipif(not TRITON_JSON_DIR.is_dir(), reason="no captured Triton JSON")
def test_triton_json_configs_parse():
    # JSON model configs as returned by a real Triton server (HTTP /config).
    files = sorted(TRITON_JSON_DIR.glob("config_*.json"))
    if not files:
        pytest.skip("no captured Triton config JSON")
    for path in files:
        data = json.loads(path.read_text())
        cfg = json_format.ParseDict(data, mc.ModelConfig())
        assert cfg.name == data["name"]
        back = json_format.MessageToDict(
            cfg, preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        assert back["name"] == data["name"]
        assert len(back.get("input", [])) == len(data.get("input", []))


# --------------------------------------------------------------------------
# (c) compatibility with tritonclient's generated modules


def _tritonclient_modules():
    tc = pytest.importorskip("tritonclient.grpc.service_pb2")
    tc_mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    return tc, tc_mc


def _all_messages(file_desc):
    out = {}

    def walk(d):
        out[d.full_name] = d
        for n in d.nested_types:
            walk(n)

    for d in file_desc.message_types_by_name.values():
        walk(d)
    return out


def _all_enums(file_desc):
    out = {e.full_name: e for e in file_desc.enum_types_by_name.values()}
    for msg in _all_messages(file_desc).values():
        for e in msg.enum_types:
            out[e.full_name] = e
    return out


def _field_facts(msg_desc):
    """Per field number: everything that matters on the wire / in text."""
    proto = descriptor_pb2.DescriptorProto()
    msg_desc.CopyToProto(proto)
    oneofs = [o.name for o in proto.oneof_decl]
    facts = {}
    for f in proto.field:
        facts[f.number] = {
            "name": f.name,
            "type": descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
            "label": descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
            "type_name": f.type_name.lstrip("."),
            "oneof": oneofs[f.oneof_index]
            if f.HasField("oneof_index") and not f.proto3_optional else None,
            "proto3_optional": f.proto3_optional,
            "packed": f.options.packed if f.options.HasField("packed") else None,
        }
    extra = {
        "map_entry": proto.options.map_entry,
        "oneofs": sorted(oneofs),
        "reserved_ranges": sorted((r.start, r.end) for r in proto.reserved_range),
        "reserved_names": sorted(proto.reserved_name),
        "nested": sorted(n.name for n in proto.nested_type),
        "enums": sorted(e.name for e in proto.enum_type),
    }
    return facts, extra


def _compare_files(theirs, ours):
    problems = []
    if theirs.package != ours.package:
        problems.append(f"package {theirs.package!r} != {ours.package!r}")
    t_file, o_file = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
    theirs.CopyToProto(t_file)
    ours.CopyToProto(o_file)
    if t_file.syntax != o_file.syntax:
        problems.append(f"syntax {t_file.syntax!r} != {o_file.syntax!r}")

    t_msgs, o_msgs = _all_messages(theirs), _all_messages(ours)
    for name in sorted(set(t_msgs) - set(o_msgs)):
        problems.append(f"missing message {name}")
    for name in sorted(set(o_msgs) - set(t_msgs)):
        problems.append(f"extra message {name}")
    for name in sorted(set(t_msgs) & set(o_msgs)):
        t_fields, t_extra = _field_facts(t_msgs[name])
        o_fields, o_extra = _field_facts(o_msgs[name])
        for num in sorted(set(t_fields) | set(o_fields)):
            tf, of = t_fields.get(num), o_fields.get(num)
            if tf is None:
                problems.append(f"{name}: extra field #{num} {of['name']}")
            elif of is None:
                problems.append(f"{name}: missing field #{num} {tf['name']}")
            elif tf != of:
                diff = {k: (tf[k], of[k]) for k in tf if tf[k] != of[k]}
                problems.append(f"{name}: field #{num} differs (theirs, ours): {diff}")
        for key in t_extra:
            if t_extra[key] != o_extra[key]:
                problems.append(f"{name}: {key} {t_extra[key]} != {o_extra[key]}")

    t_enums, o_enums = _all_enums(theirs), _all_enums(ours)
    for name in sorted(set(t_enums) ^ set(o_enums)):
        problems.append(f"enum {name} only in {'theirs' if name in t_enums else 'ours'}")
    for name in sorted(set(t_enums) & set(o_enums)):
        tv = {v.name: v.number for v in t_enums[name].values}
        ov = {v.name: v.number for v in o_enums[name].values}
        if tv != ov:
            problems.append(f"enum {name}: {tv} != {ov}")

    t_svcs, o_svcs = theirs.services_by_name, ours.services_by_name
    for name in sorted(set(t_svcs) ^ set(o_svcs)):
        problems.append(f"service {name} only in {'theirs' if name in t_svcs else 'ours'}")
    for name in sorted(set(t_svcs) & set(o_svcs)):
        def sig(svc):
            return {
                m.name: (m.input_type.full_name, m.output_type.full_name,
                         m.client_streaming, m.server_streaming)
                for m in svc.methods
            }
        ts, os_ = sig(t_svcs[name]), sig(o_svcs[name])
        for m in sorted(set(ts) | set(os_)):
            if ts.get(m) != os_.get(m):
                problems.append(f"rpc {name}.{m}: {ts.get(m)} != {os_.get(m)}")
    return problems


def test_descriptors_match_tritonclient():
    tc, tc_mc = _tritonclient_modules()
    problems = _compare_files(tc_mc.DESCRIPTOR, mc.DESCRIPTOR)
    problems += _compare_files(tc.DESCRIPTOR, gs.DESCRIPTOR)
    assert not problems, "descriptor differences:\n  " + "\n  ".join(problems)


def _sample_infer_request(module):
    req = module.ModelInferRequest(model_name="add_sub", model_version="1", id="req-7")
    req.parameters["sequence_id"].uint64_param = 2**63 + 5
    req.parameters["sequence_start"].bool_param = True
    req.parameters["priority"].int64_param = -3
    req.parameters["note"].string_param = "héllo"
    req.parameters["scale"].double_param = 0.25
    inp = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    inp.parameters["shared_memory_region"].string_param = "r0"
    inp.contents.fp32_contents.extend([1.5, -2.0])
    typed = req.inputs.add(name="TYPED", datatype="INT32", shape=[3])
    typed.contents.int_contents.extend([1, -2, 3])
    typed.contents.int64_contents.append(-(2**40))
    typed.contents.uint_contents.append(7)
    typed.contents.uint64_contents.append(2**64 - 1)
    typed.contents.fp64_contents.append(3.25)
    typed.contents.bool_contents.extend([True, False])
    typed.contents.bytes_contents.append(b"\x00\xffraw")
    out = req.outputs.add(name="OUTPUT0")
    out.parameters["classification"].int64_param = 3
    req.raw_input_contents.append(bytes(range(64)))
    return req


def _sample_statistics(module):
    resp = module.ModelStatisticsResponse()
    st = resp.model_stats.add(
        name="add_sub", version="1", last_inference=1_700_000_000_000,
        inference_count=10, execution_count=4,
    )
    for i, field in enumerate(
        ["success", "fail", "queue", "compute_input", "compute_infer",
         "compute_output", "cache_hit", "cache_miss"], start=1
    ):
        dur = getattr(st.inference_stats, field)
        dur.count, dur.ns = i, i * 1000
    bs = st.batch_stats.add(batch_size=8)
    bs.compute_input.count, bs.compute_infer.ns, bs.compute_output.ns = 1, 2, 3
    st.memory_usage.add(type="GPU", id=0, byte_size=2**33)
    rs = st.response_stats["0"]
    for field in ["compute_infer", "compute_output", "success", "fail",
                  "empty_response", "cancel"]:
        getattr(rs, field).count = 9
    return resp


def _roundtrip(msg_ours, theirs_cls, ours_cls):
    """ours -> bytes -> theirs -> bytes -> ours; both sides must agree."""
    wire = msg_ours.SerializeToString(deterministic=True)
    theirs = theirs_cls.FromString(wire)
    assert theirs.SerializeToString(deterministic=True) == wire
    # identical field names => identical text / JSON renderings
    assert text_format.MessageToString(theirs) == text_format.MessageToString(msg_ours)
    assert json_format.MessageToDict(theirs) == json_format.MessageToDict(msg_ours)
    back = ours_cls.FromString(theirs.SerializeToString())
    assert back == msg_ours
    # nothing landed in unknown fields (text/JSON equality covers nested ones)
    assert len(unknown_fields.UnknownFieldSet(theirs)) == 0
    return theirs


def test_wire_roundtrip_infer_request_and_response():
    tc, _ = _tritonclient_modules()
    _roundtrip(_sample_infer_request(gs), tc.ModelInferRequest, gs.ModelInferRequest)
    # and starting from tritonclient's side
    theirs = _sample_infer_request(tc)
    ours = gs.ModelInferRequest.FromString(theirs.SerializeToString())
    assert ours.SerializeToString(deterministic=True) == \
        theirs.SerializeToString(deterministic=True)
    assert ours.parameters["sequence_id"].uint64_param == 2**63 + 5
    assert ours.inputs[1].contents.uint64_contents[0] == 2**64 - 1

    resp = gs.ModelInferResponse(model_name="m", model_version="2", id="x")
    o = resp.outputs.add(name="OUT", datatype="BYTES", shape=[2])
    o.parameters["binary_data_size"].int64_param = 12
    resp.raw_output_contents.append(b"\x02\x00\x00\x00hi\x00\x00\x00\x00")
    resp.parameters["triton_final_response"].bool_param = True
    _roundtrip(resp, tc.ModelInferResponse, gs.ModelInferResponse)
    stream = gs.ModelStreamInferResponse(error_message="", infer_response=resp)
    _roundtrip(stream, tc.ModelStreamInferResponse, gs.ModelStreamInferResponse)


def test_wire_roundtrip_model_config_response():
    tc, tc_mc = _tritonclient_modules()
    for text in (RICH_DYNAMIC_PBTXT, RICH_SEQUENCE_PBTXT, RICH_ENSEMBLE_PBTXT):
        ours = gs.ModelConfigResponse(config=_parse_config(text))
        theirs = _roundtrip(ours, tc.ModelConfigResponse, gs.ModelConfigResponse)
        # tritonclient's own text parser reads the same pbtxt to the same bytes
        tc_cfg = _parse_config(text, tc_mc)
        assert tc_cfg.SerializeToString(deterministic=True) == \
            theirs.config.SerializeToString(deterministic=True)


def test_wire_roundtrip_statistics_and_misc():
    tc, _ = _tritonclient_modules()
    _roundtrip(_sample_statistics(gs), tc.ModelStatisticsResponse, gs.ModelStatisticsResponse)
    theirs = _sample_statistics(tc)
    ours = gs.ModelStatisticsResponse.FromString(theirs.SerializeToString())
    assert ours.model_stats[0].response_stats["0"].cancel.count == 9
    assert ours.model_stats[0].memory_usage[0].byte_size == 2**33

    idx = gs.RepositoryIndexResponse()
    idx.models.add(name="a", version="1", state="READY", reason="")
    _roundtrip(idx, tc.RepositoryIndexResponse, gs.RepositoryIndexResponse)

    load = gs.RepositoryModelLoadRequest(model_name="a")
    load.parameters["config"].string_param = "{}"
    load.parameters["file:1/model.py"].bytes_param = b"print(1)"
    _roundtrip(load, tc.RepositoryModelLoadRequest, gs.RepositoryModelLoadRequest)

    meta = gs.ModelMetadataResponse(name="a", versions=["1"], platform="python")
    meta.inputs.add(name="I", datatype="FP32", shape=[-1, 3])
    _roundtrip(meta, tc.ModelMetadataResponse, gs.ModelMetadataResponse)

    shm = gs.SystemSharedMemoryStatusResponse()
    shm.regions["r"].key = "/shm_r"
    shm.regions["r"].byte_size = 64
    _roundtrip(shm, tc.SystemSharedMemoryStatusResponse, gs.SystemSharedMemoryStatusResponse)

    cuda = gs.CudaSharedMemoryRegisterRequest(
        name="c", raw_handle=b"\x01" * 64, device_id=1, byte_size=1024)
    _roundtrip(cuda, tc.CudaSharedMemoryRegisterRequest, gs.CudaSharedMemoryRegisterRequest)

    trace = gs.TraceSettingRequest(model_name="a")
    trace.settings["trace_level"].value.extend(["TIMESTAMPS", "TENSORS"])
    _roundtrip(trace, tc.TraceSettingRequest, gs.TraceSettingRequest)

    log = gs.LogSettingsResponse()
    log.settings["log_info"].bool_param = True
    log.settings["log_verbose_level"].uint32_param = 2
    log.settings["log_format"].string_param = "default"
    _roundtrip(log, tc.LogSettingsResponse, gs.LogSettingsResponse)


@pytest.mark.skipif(not TRITON_JSON_DIR.is_dir(), reason="no captured Triton JSON")
def test_triton_json_configs_match_tritonclient():
    _, tc_mc = _tritonclient_modules()
    files = sorted(TRITON_JSON_DIR.glob("config_*.json"))
    if not files:
        pytest.skip("no captured Triton config JSON")
    for path in files:
        data = json.loads(path.read_text())
        ours = json_format.ParseDict(data, mc.ModelConfig())
        theirs = json_format.ParseDict(data, tc_mc.ModelConfig())
        assert ours.SerializeToString(deterministic=True) == \
            theirs.SerializeToString(deterministic=True), path.name


def test_tritonclient_talks_to_our_generated_service():
    """End to end over a real gRPC channel: tritonclient's client against a
    tiny servicer built on our generated stubs (checks RPC paths too)."""
    pytest.importorskip("tritonclient.grpc")
    np = pytest.importorskip("numpy")
    import grpc
    from concurrent import futures

    import tritonclient.grpc as grpcclient

    config = _parse_config(RICH_DYNAMIC_PBTXT)

    class Servicer(gs_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return gs.ServerLiveResponse(live=True)

        def ModelConfig(self, request, context):
            return gs.ModelConfigResponse(config=config)

        def ModelStatistics(self, request, context):
            return _sample_statistics(gs)

        def ModelInfer(self, request, context):
            a = np.frombuffer(request.raw_input_contents[0], dtype=np.float32)
            b = np.frombuffer(request.raw_input_contents[1], dtype=np.float32)
            resp = gs.ModelInferResponse(model_name=request.model_name, id=request.id)
            resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=[a.size])
            resp.raw_output_contents.append((a + b).astype(np.float32).tobytes())
            return resp

        def ModelStreamInfer(self, request_iterator, context):
            for request in request_iterator:
                yield gs.ModelStreamInferResponse(infer_response=self.ModelInfer(request, context))

    class Health(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gs_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live()

        got = client.get_model_config("rich_dynamic").config
        assert got.SerializeToString(deterministic=True) == \
            config.SerializeToString(deterministic=True)
        assert got.dynamic_batching.default_queue_policy.max_queue_size == 32

        stats = client.get_inference_statistics("add_sub")
        assert stats.model_stats[0].response_stats["0"].empty_response.count == 9

        x = np.arange(16, dtype=np.float32)
        inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"),
                  grpcclient.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(x * 2)
        result = client.infer("add_sub", inputs, request_id="r1")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 3)
        assert result.get_response().id == "r1"

        # the health service is reachable under grpc.health.v1.Health/Check
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            assert check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        client.close()
    finally:
        server.stop(grace=None)
