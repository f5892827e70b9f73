import http.client, json, struct, sys
import numpy as np

OUT = "/work/main/tests/data/triton_reference/"
results = []

def req(label, method, path, body=None, headers=None, port=18000, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    hdrs = dict(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    elif isinstance(body, str):
        body = body.encode()
    c.request(method, path, body=body, headers=hdrs)
    try:
        r = c.getresponse()
    except TimeoutError:
        results.append({"label": label, "method": method, "path": path, "request_body": body.decode(),
                        "status": None, "response_body": "NO RESPONSE: client timed out after %ss" % timeout})
        print("==", label, "-> TIMEOUT after", timeout)
        return None, None
    data = r.read()
    try:
        text = data.decode()
        btext = None
    except UnicodeDecodeError:
        text = None
        btext = repr(data)
    rec = {"label": label, "method": method, "path": path,
           "request_headers": hdrs,
           "request_body": (body.decode(errors="replace") if body and len(body) < 3000 else (repr(body[:200]) if body else None)),
           "status": r.status, "reason": r.reason,
           "response_headers": r.getheaders(),
           "response_body": text if text is not None else btext}
    results.append(rec)
    print("==", label, method, path, "->", r.status, r.reason)
    print("  ", dict(r.getheaders()))
    print("  ", (text if text is not None else btext)[:1500])
    c.close()
    return r, data

f16 = list(map(float, range(16)))
ones = [1.0] * 16
good = {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]}
S = "/v2/models/%s/infer"

# ---- successful infers
req("add_sub ok (json)", "POST", S % "add_sub", good)
req("add_sub ok with id + parameters", "POST", S % "add_sub", dict(good, id="my-req-1", parameters={"p_int": 5, "p_str": "s", "p_bool": True}))
req("add_sub ok, outputs requested with binary_data=true", "POST", S % "add_sub", dict(good, outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}]))
req("add_sub ok, request-level binary_data_output=true", "POST", S % "add_sub", dict(good, parameters={"binary_data_output": True}))
req("add_sub ok, only OUTPUT1 requested", "POST", S % "add_sub", dict(good, outputs=[{"name": "OUTPUT1"}]))
req("add_sub ok, versioned path /versions/1", "POST", "/v2/models/add_sub/versions/1/infer", good)
# binary input
hdr = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "parameters": {"binary_data_size": 64}},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}],
    "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
body = hdr + np.arange(16, dtype=np.float32).tobytes()
req("add_sub ok, binary input", "POST", S % "add_sub", body,
    {"Inference-Header-Content-Length": str(len(hdr)), "Content-Type": "application/octet-stream"})
# nested data
req("add_sub ok, nested data list [[..]] for shape [16]", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": [f16]},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": [ones]}]})
# ints in FP32 data
req("add_sub ok, integer JSON values in FP32 data", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": list(range(16))},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": [1] * 16}]})

# ---- error cases
req("unknown model infer", "POST", S % "nope", good)
req("unknown version infer", "POST", "/v2/models/add_sub/versions/7/infer", good)
req("wrong datatype (INT32 for FP32 input)", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "INT32", "data": list(range(16))},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("wrong shape ([2,8] for [16])", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [2, 8], "datatype": "FP32", "data": f16},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("wrong shape ([8] with 8 elems for [16])", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [8], "datatype": "FP32", "data": f16[:8]},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("missing input", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16}]})
req("unexpected extra input", "POST", S % "add_sub", {"inputs": good["inputs"] + [
    {"name": "INPUT9", "shape": [16], "datatype": "FP32", "data": f16}]})
req("wrong number of elements in data (15 for shape [16])", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16[:15]},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("too many elements in data (17 for shape [16])", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": f16 + [1.0]},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("string in FP32 data", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": ["a"] * 16},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("unknown datatype string", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FLOAT", "data": f16},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("malformed JSON", "POST", S % "add_sub", "{not json", {"Content-Type": "application/json"})
req("empty body", "POST", S % "add_sub", "", {"Content-Type": "application/json"})
req("JSON without inputs", "POST", S % "add_sub", {"outputs": []})
req("input missing 'data'", "POST", S % "add_sub", {"inputs": [
    {"name": "INPUT0", "shape": [16], "datatype": "FP32"},
    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": ones}]})
req("unknown output requested", "POST", S % "add_sub", dict(good, outputs=[{"name": "OUTPUT9"}]))
req("duplicate input name", "POST", S % "add_sub", {"inputs": good["inputs"] + [good["inputs"][0]]})
req("batch: args_probe shape [2,3] ok", "POST", S % "args_probe", {"inputs": [
    {"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]})
req("batch: args_probe with optional input", "POST", S % "args_probe", {"inputs": [
    {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
    {"name": "OPT_IN", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]})
req("batch: args_probe batch 9 > max_batch_size 8", "POST", S % "args_probe", {"inputs": [
    {"name": "INPUT0", "shape": [9, 1], "datatype": "FP32", "data": list(range(9))}]})
req("batch: args_probe missing batch dim (shape [3])", "POST", S % "args_probe", {"inputs": [
    {"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]})

x4 = lambda v: {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [float(v), 0, 0, 0]}]}
req("raiser", "POST", S % "raiser", x4(0))
req("bad_return_notlist", "POST", S % "bad_return_notlist", x4(0))
req("bad_return_len", "POST", S % "bad_return_len", x4(0))
req("bad_return_none", "POST", S % "bad_return_none", x4(0), timeout=15)
names = {0: "default code", 1: "NOT_FOUND", 2: "INVALID_ARG", 3: "INTERNAL", 4: "UNAVAILABLE", 5: "UNSUPPORTED", 6: "ALREADY_EXISTS", 7: "UNKNOWN", 8: "CANCELLED", 9: "NOT_FOUND with output tensors"}
for k, n in names.items():
    req("per_request_error %s" % n, "POST", S % "per_request_error", x4(k))

# bytes
req("bytes_model ok", "POST", S % "bytes_model", {"inputs": [
    {"name": "INPUT0", "shape": [3], "datatype": "BYTES", "data": ["hello", "", "ünï"]}]})
req("bytes_model ok binary output", "POST", S % "bytes_model", {"inputs": [
    {"name": "INPUT0", "shape": [2], "datatype": "BYTES", "data": ["ab", "c"]}], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]})
req("bytes_model number in BYTES data", "POST", S % "bytes_model", {"inputs": [
    {"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [5]}]})
bhdr = json.dumps({"inputs": [{"name": "INPUT0", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 4 + 2 + 4 + 3}}]}).encode()
bbody = bhdr + struct.pack("<I", 2) + b"xy" + struct.pack("<I", 3) + b"\x00\xff\x01"
req("bytes_model binary input (incl non-utf8 bytes), json output", "POST", S % "bytes_model", bbody,
    {"Inference-Header-Content-Length": str(len(bhdr)), "Content-Type": "application/octet-stream"})

# params_echo
req("params_echo", "POST", S % "params_echo", {"id": "rid-42", "parameters": {"p_int": 5, "p_str": "s", "p_bool": True, "p_float": 1.5},
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}],
    "outputs": [{"name": "OUTPUT0"}]})
req("params_echo no id/params", "POST", S % "params_echo", {
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
req("params_echo sequence params/timeout/priority", "POST", S % "params_echo", {"id": "seq", "parameters": {"sequence_id": 7, "sequence_start": True, "sequence_end": False, "timeout": 123456, "priority": 0},
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
req("params_echo nested object parameter", "POST", S % "params_echo", {"parameters": {"obj": {"a": 1}},
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
req("params_echo binary_data_output request param", "POST", S % "params_echo", {"parameters": {"binary_data_output": True},
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})

# ready / metadata / misc
for m in ["add_sub", "nope", "broken_config", "name_mismatch", "version_abc"]:
    req("ready %s" % m, "GET", "/v2/models/%s/ready" % m)
req("ready add_sub version 7", "GET", "/v2/models/add_sub/versions/7/ready")
req("ready add_sub version 1", "GET", "/v2/models/add_sub/versions/1/ready")
for m in ["nope", "broken_config", "version_abc"]:
    req("metadata %s" % m, "GET", "/v2/models/%s" % m)
    req("config %s" % m, "GET", "/v2/models/%s/config" % m)
req("metadata add_sub version 7", "GET", "/v2/models/add_sub/versions/7")
req("stats unknown model", "GET", "/v2/models/nope/stats")
req("GET on infer path", "GET", S % "add_sub")
req("PUT on infer path", "PUT", S % "add_sub", good)
req("POST on metadata path", "POST", "/v2/models/add_sub", good)
req("unknown path", "GET", "/v2/foo")
req("unknown path /", "GET", "/")
req("health live", "GET", "/v2/health/live")
req("health ready (strict, with failed models)", "GET", "/v2/health/ready")
req("load in mode none", "POST", "/v2/repository/models/add_sub/load", "")
req("unload in mode none", "POST", "/v2/repository/models/add_sub/unload", "")
req("load unknown model in mode none", "POST", "/v2/repository/models/nope/load", "")
req("index GET (not POST)", "GET", "/v2/repository/index")
req("index POST ready=true", "POST", "/v2/repository/index", {"ready": True})
req("all stats", "GET", "/v2/models/stats")
req("trace setting", "GET", "/v2/trace/setting")
req("logging", "GET", "/v2/logging")

json.dump(results, open(OUT + "http_cases.json", "w"), indent=1, ensure_ascii=False)
