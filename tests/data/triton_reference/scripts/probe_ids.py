import json, http.client, numpy as np, grpc
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc
OUT = "/work/main/tests/data/triton_reference/"
res = []
def post(label, path, body):
    c = http.client.HTTPConnection("127.0.0.1", 18000, timeout=20)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse(); d = r.read().decode()
    rec = {"proto": "http", "label": label, "path": path, "request": body, "status": r.status, "headers": r.getheaders(), "body": d}
    print(json.dumps(rec)[:600]); res.append(rec)
f16 = list(range(16))
post("wrong datatype with id", "/v2/models/add_sub/infer", {"id": "req-7", "inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "INT32", "data": f16}, {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": f16}]})
post("unknown model with id", "/v2/models/nope/infer", {"id": "req-8", "inputs": []})
post("unknown output with id", "/v2/models/add_sub/infer", {"id": "req-9", "inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16}, {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": f16}], "outputs": [{"name": "X"}]})
post("raiser with id", "/v2/models/raiser/infer", {"id": "req-10", "inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [0, 0, 0, 0]}]})
post("per_request_error NOT_FOUND with id", "/v2/models/per_request_error/infer", {"id": "req-11", "inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 0, 0, 0]}]})
post("missing input with id", "/v2/models/add_sub/infer", {"id": "req-12", "inputs": [{"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16}]})
post("params_echo double param & negative int & empty string id", "/v2/models/params_echo/infer", {"id": "", "parameters": {"d": 2.0, "n": -3, "big": 2**40},
    "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}], "outputs": [{"name": "OUTPUT0"}]})
stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel("127.0.0.1:18001"))
def g(label, r):
    try:
        resp = stub.ModelInfer(r, timeout=20); rec = {"proto": "grpc", "label": label, "ok": True, "resp_id": resp.id}
    except grpc.RpcError as e:
        rec = {"proto": "grpc", "label": label, "ok": False, "code": e.code().name, "details": e.details()}
    print(json.dumps(rec)); res.append(rec)
r = pb.ModelInferRequest(model_name="add_sub", id="g-7")
r.inputs.add(name="INPUT0", datatype="INT32", shape=[16]); r.inputs.add(name="INPUT1", datatype="FP32", shape=[16])
r.raw_input_contents.extend([np.zeros(16, np.int32).tobytes(), np.zeros(16, np.float32).tobytes()])
g("grpc wrong datatype with id", r)
r = pb.ModelInferRequest(model_name="raiser", id="g-8"); r.inputs.add(name="INPUT0", datatype="FP32", shape=[4]); r.raw_input_contents.append(np.zeros(4, np.float32).tobytes())
g("grpc raiser with id", r)
json.dump(res, open(OUT + "cases_with_request_id.json", "w"), indent=1)
