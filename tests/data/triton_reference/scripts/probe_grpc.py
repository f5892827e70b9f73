import json, struct
import grpc
import numpy as np
from google.protobuf import text_format, json_format
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

OUT = "/work/main/tests/data/triton_reference/"
ch = grpc.insecure_channel("127.0.0.1:18001")
stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
results = []

def msg_dump(m):
    return {"text_format": text_format.MessageToString(m, as_utf8=True),
            "json": json_format.MessageToDict(m, preserving_proto_field_name=True)}

def call(label, method, request, timeout=20, save_as=None):
    rec = {"label": label, "rpc": method, "request_text": text_format.MessageToString(request, as_utf8=True)[:3000]}
    try:
        resp, callinfo = getattr(stub, method).with_call(request, timeout=timeout)
        rec["ok"] = True
        d = msg_dump(resp)
        rec["response_text"] = d["text_format"]
        rec["response_json"] = d["json"]
        rec["trailing_metadata"] = [tuple(x) for x in (callinfo.trailing_metadata() or [])]
        print("==", label, "-> OK")
        print(d["text_format"][:1500])
        if save_as:
            open(OUT + save_as + ".txtpb", "w").write(d["text_format"])
            json.dump(d["json"], open(OUT + save_as + ".json", "w"), indent=1)
    except grpc.RpcError as e:
        rec["ok"] = False
        rec["code"] = e.code().name
        rec["code_value"] = e.code().value[0]
        rec["details"] = e.details()
        rec["trailing_metadata"] = [tuple(x) for x in (e.trailing_metadata() or [])]
        print("==", label, "->", e.code().name, repr(e.details()))
    results.append(rec)

def tensor(name, dt, shape, arr=None, contents=None, params=None):
    t = pb.ModelInferRequest().InferInputTensor(name=name, datatype=dt, shape=shape)
    if contents:
        getattr(t.contents, contents[0]).extend(contents[1])
    if params:
        for k, v in params.items():
            setparam(t.parameters[k], v)
    return t

def setparam(p, v):
    if isinstance(v, bool): p.bool_param = v
    elif isinstance(v, int): p.int64_param = v
    elif isinstance(v, float): p.double_param = v
    else: p.string_param = v

def infer_req(model, inputs, raws=None, version="", id="", params=None, outputs=None):
    r = pb.ModelInferRequest(model_name=model, model_version=version, id=id)
    r.inputs.extend(inputs)
    if raws is not None:
        r.raw_input_contents.extend(raws)
    for k, v in (params or {}).items():
        setparam(r.parameters[k], v)
    for o in outputs or []:
        r.outputs.add(name=o)
    return r

a = np.arange(16, dtype=np.float32); b = np.ones(16, dtype=np.float32)
def addsub(**kw):
    return infer_req("add_sub", [tensor("INPUT0", "FP32", [16]), tensor("INPUT1", "FP32", [16])], [a.tobytes(), b.tobytes()], **kw)

call("ServerLive", "ServerLive", pb.ServerLiveRequest())
call("ServerReady (strict, failed models present)", "ServerReady", pb.ServerReadyRequest())
call("ServerMetadata", "ServerMetadata", pb.ServerMetadataRequest(), save_as="grpc_server_metadata")
call("ModelMetadata add_sub", "ModelMetadata", pb.ModelMetadataRequest(name="add_sub"), save_as="grpc_metadata_add_sub")
call("ModelMetadata args_probe", "ModelMetadata", pb.ModelMetadataRequest(name="args_probe"))
call("ModelConfig add_sub", "ModelConfig", pb.ModelConfigRequest(name="add_sub"), save_as="grpc_config_add_sub")
call("ModelConfig args_probe", "ModelConfig", pb.ModelConfigRequest(name="args_probe"), save_as="grpc_config_args_probe")
call("ModelConfig auto_complete", "ModelConfig", pb.ModelConfigRequest(name="auto_complete"), save_as="grpc_config_auto_complete")
call("RepositoryIndex", "RepositoryIndex", pb.RepositoryIndexRequest(), save_as="grpc_index")
call("RepositoryIndex ready=true", "RepositoryIndex", pb.RepositoryIndexRequest(ready=True))
call("ModelStatistics add_sub", "ModelStatistics", pb.ModelStatisticsRequest(name="add_sub"), save_as="grpc_stats_add_sub")

# successes
call("infer add_sub ok (raw_input_contents)", "ModelInfer", addsub(), save_as="grpc_infer_add_sub_ok")
call("infer add_sub ok with id + parameters", "ModelInfer", addsub(id="my-req-1", params={"p_int": 5, "p_str": "s", "p_bool": True}), save_as="grpc_infer_add_sub_id_params")
call("infer add_sub ok typed contents (fp32_contents)", "ModelInfer", infer_req("add_sub", [
    tensor("INPUT0", "FP32", [16], contents=("fp32_contents", a.tolist())), tensor("INPUT1", "FP32", [16], contents=("fp32_contents", b.tolist()))]), save_as="grpc_infer_add_sub_typed_contents")
call("infer add_sub only OUTPUT1 requested", "ModelInfer", addsub(outputs=["OUTPUT1"]))
call("infer add_sub version '1'", "ModelInfer", addsub(version="1"))
# errors
call("unknown model", "ModelInfer", infer_req("nope", [tensor("INPUT0", "FP32", [16]), tensor("INPUT1", "FP32", [16])], [a.tobytes(), b.tobytes()]))
call("unknown version 7", "ModelInfer", addsub(version="7"))
call("non-numeric version 'abc'", "ModelInfer", addsub(version="abc"))
call("wrong datatype", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "INT32", [16]), tensor("INPUT1", "FP32", [16])], [a.astype(np.int32).tobytes(), b.tobytes()]))
call("wrong shape [2,8]", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FP32", [2, 8]), tensor("INPUT1", "FP32", [16])], [a.tobytes(), b.tobytes()]))
call("missing input", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FP32", [16])], [a.tobytes()]))
call("unexpected extra input", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FP32", [16]), tensor("INPUT1", "FP32", [16]), tensor("INPUT9", "FP32", [16])], [a.tobytes(), b.tobytes(), a.tobytes()]))
call("raw content byte size mismatch (15 elems for [16])", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FP32", [16]), tensor("INPUT1", "FP32", [16])], [a[:15].tobytes(), b.tobytes()]))
call("typed contents count mismatch (15 for [16])", "ModelInfer", infer_req("add_sub", [
    tensor("INPUT0", "FP32", [16], contents=("fp32_contents", a.tolist()[:15])), tensor("INPUT1", "FP32", [16], contents=("fp32_contents", b.tolist()))]))
call("raw_input_contents count != inputs count", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FP32", [16]), tensor("INPUT1", "FP32", [16])], [a.tobytes()]))
call("mixed typed contents and raw_input_contents", "ModelInfer", infer_req("add_sub", [
    tensor("INPUT0", "FP32", [16], contents=("fp32_contents", a.tolist())), tensor("INPUT1", "FP32", [16])], [b.tobytes()]))
call("unknown datatype string", "ModelInfer", infer_req("add_sub", [tensor("INPUT0", "FLOAT", [16]), tensor("INPUT1", "FP32", [16])], [a.tobytes(), b.tobytes()]))
call("unknown output requested", "ModelInfer", addsub(outputs=["OUTPUT9"]))
call("args_probe batch 9 > 8", "ModelInfer", infer_req("args_probe", [tensor("INPUT0", "FP32", [9, 1])], [np.zeros(9, np.float32).tobytes()]))
x4 = lambda v: infer_req(m, [tensor("INPUT0", "FP32", [4])], [np.array([v, 0, 0, 0], np.float32).tobytes()])
for m in ["raiser", "bad_return_notlist", "bad_return_len"]:
    call(m, "ModelInfer", x4(0))
m = "bad_return_none"
call("bad_return_none (timeout 10s)", "ModelInfer", x4(0), timeout=10)
m = "per_request_error"
names = {0: "default code", 1: "NOT_FOUND", 2: "INVALID_ARG", 3: "INTERNAL", 4: "UNAVAILABLE", 5: "UNSUPPORTED", 6: "ALREADY_EXISTS", 7: "UNKNOWN", 8: "CANCELLED", 9: "NOT_FOUND with output tensors"}
for k, n in names.items():
    call("per_request_error %s" % n, "ModelInfer", x4(k))
# bytes
def bser(items):
    return b"".join(struct.pack("<I", len(s)) + s for s in items)
call("bytes_model raw", "ModelInfer", infer_req("bytes_model", [tensor("INPUT0", "BYTES", [3])], [bser([b"hello", b"", b"\x00\xff"])]), save_as="grpc_infer_bytes_model")
call("bytes_model typed bytes_contents", "ModelInfer", infer_req("bytes_model", [tensor("INPUT0", "BYTES", [2], contents=("bytes_contents", [b"ab", b"c"]))]))
# params_echo
call("params_echo with id, params, sequence, timeout, priority", "ModelInfer", infer_req("params_echo", [tensor("INPUT0", "FP32", [2])], [np.array([1, 2], np.float32).tobytes()], id="rid-g",
     params={"p_int": 5, "p_str": "s", "p_bool": True, "p_double": 1.5, "sequence_id": 9, "sequence_start": True, "timeout": 5000, "priority": 0}, outputs=["OUTPUT0"]), save_as="grpc_infer_params_echo")
call("params_echo string sequence_id", "ModelInfer", infer_req("params_echo", [tensor("INPUT0", "FP32", [2])], [np.array([1, 2], np.float32).tobytes()], params={"sequence_id": "abc", "sequence_end": True}))
call("params_echo uint64 param", "ModelInfer", (lambda r: (r.parameters["p_u"].__setattr__("uint64_param", 7), r)[1])(infer_req("params_echo", [tensor("INPUT0", "FP32", [2])], [np.array([1, 2], np.float32).tobytes()])))
# readiness / metadata errors
for name, ver in [("add_sub", ""), ("nope", ""), ("broken_config", ""), ("version_abc", ""), ("add_sub", "7")]:
    call("ModelReady %s v%r" % (name, ver), "ModelReady", pb.ModelReadyRequest(name=name, version=ver))
for name in ["nope", "broken_config", "version_abc"]:
    call("ModelMetadata %s" % name, "ModelMetadata", pb.ModelMetadataRequest(name=name))
    call("ModelConfig %s" % name, "ModelConfig", pb.ModelConfigRequest(name=name))
call("ModelMetadata add_sub v7", "ModelMetadata", pb.ModelMetadataRequest(name="add_sub", version="7"))
call("ModelStatistics nope", "ModelStatistics", pb.ModelStatisticsRequest(name="nope"))
call("RepositoryModelLoad (mode none)", "RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="add_sub"))
call("RepositoryModelUnload (mode none)", "RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="add_sub"))

# streaming
def stream(label, reqs):
    rec = {"label": label, "rpc": "ModelStreamInfer", "responses": []}
    try:
        for resp in stub.ModelStreamInfer(iter(reqs), timeout=20):
            rec["responses"].append({"error_message": resp.error_message, "infer_response_text": text_format.MessageToString(resp.infer_response, as_utf8=True)})
        rec["ok"] = True
    except grpc.RpcError as e:
        rec["ok"] = False; rec["code"] = e.code().name; rec["details"] = e.details()
    print("==", label, json.dumps(rec)[:1500])
    results.append(rec)
m = "raiser"
stream("stream: add_sub ok, raiser, unknown model, per_request_error NOT_FOUND", [addsub(id="s1"), (lambda r: (setattr(r, "id", "s2"), r)[1])(x4(0)),
       infer_req("nope", [tensor("INPUT0", "FP32", [4])], [np.zeros(4, np.float32).tobytes()], id="s3"),
       (lambda: (globals().__setitem__("m", "per_request_error"), x4(1))[1])()])

json.dump(results, open(OUT + "grpc_cases.json", "w"), indent=1, ensure_ascii=False)
