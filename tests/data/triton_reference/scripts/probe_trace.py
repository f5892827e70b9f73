"""What a server writes into its trace files and answers on the trace-setting endpoints
(how trace.json was made: python probe_trace.py HTTP_URL GRPC_URL TRACE_DIR against
Triton 2.51 serving examples/models pipeline, add_sub and identity and
tests/models/bls_traced, started with
--trace-config triton,file=TRACE_DIR/trace.json --trace-config level=TIMESTAMPS
--trace-config rate=1 --trace-config triton,log-frequency=1, so that each trace is in a
file of its own as soon as it is complete). Timestamps are left out: only the event
names of each trace, its model and its parent.

With a fourth argument, "tensors", against the same Triton started with level=TENSORS
(instead of TIMESTAMPS) and examples/models string_upper added: the tensor entries it
writes for add_sub and string_upper requests (its "tensors" part)."""

import glob, json, sys, time, urllib.error, urllib.request
import numpy as np
import tritonclient.grpc as grpc
import tritonclient.http as http

url_http, url_grpc, trace_dir = sys.argv[1:4]
a = np.arange(4, dtype=np.float32)


def written():
    """Every entry of the numbered trace files, in file order."""
    paths = sorted(glob.glob(f"{trace_dir}/trace.json.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
    return [entry for path in paths for entry in json.load(open(path))]


if sys.argv[4:] == ["tensors"]:
    client = http.InferenceServerClient(url_http)
    x = np.array([0.5, 1.25, -3.0, 1e-7], np.float32)
    inputs = [http.InferInput("INPUT0", [4], "FP32"), http.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(x * 3)
    client.infer("add_sub", inputs, request_id="tensors-add_sub")
    text = http.InferInput("INPUT0", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"ab", b"c,d"], dtype=np.object_))
    client.infer("string_upper", [text], request_id="tensors-string_upper")
    time.sleep(1)
    entries = [{k: v for k, v in e.items() if k != "id"} for e in written() if "tensor" in e]
    print(json.dumps(entries, indent=1))
    sys.exit(0)


def infer(module, url, model, request_id):
    client = module.InferenceServerClient(url)
    inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return client.infer(model, inputs, request_id=request_id)


def setting(method, path, body=None):
    request = urllib.request.Request(
        f"http://{url_http}{path}", data=None if body is None else json.dumps(body).encode(), method=method
    )
    try:
        return 200, json.loads(urllib.request.urlopen(request).read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


infer(http, url_http, "add_sub", "http-add_sub")
infer(grpc, url_grpc, "add_sub", "grpc-add_sub")
infer(http, url_http, "pipeline", "http-pipeline")
context = infer(http, url_http, "bls_traced", "http-bls").as_numpy("TRACE_CONTEXT")[0].decode()
time.sleep(1)
traces = []
for path in sorted(glob.glob(f"{trace_dir}/trace.json.*"), key=lambda p: int(p.rsplit(".", 1)[1])):
    by_id = {}
    for entry in json.load(open(path)):
        trace = by_id.setdefault(entry["id"], {"events": []})
        if "model_name" in entry:
            trace.update({k: v for k, v in entry.items() if k not in ("id",)})
        for stamp in entry.get("timestamps", []):
            trace["events"].append(stamp["name"])
    ids = {i: n for n, i in enumerate(sorted(by_id))}
    for i, trace in sorted(by_id.items()):
        if "parent_id" in trace:
            trace["parent_id"] = "set"
        trace["events"].sort()
        traces.append(trace)
settings = [
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/models/add_sub/trace/setting", {"trace_rate": "2"}),
    ("POST", "/v2/trace/setting", {"trace_rate": "5", "trace_count": "7"}),
    ("GET", "/v2/models/add_sub/trace/setting", None),
    ("GET", "/v2/models/identity/trace/setting", None),
    ("POST", "/v2/models/add_sub/trace/setting", {"trace_rate": None}),
    ("POST", "/v2/trace/setting", {"trace_rate": None}),
    ("POST", "/v2/trace/setting", {"trace_count": "-5"}),
    ("POST", "/v2/trace/setting", {"trace_rate": "x"}),
    ("POST", "/v2/trace/setting", {"trace_file": "/tmp/elsewhere.json"}),
    ("POST", "/v2/models/nosuch/trace/setting", {"trace_rate": "3"}),
    ("POST", "/v2/trace/setting", {"trace_level": ["OFF"]}),
]
answers = [[method, path, body, *setting(method, path, body)] for method, path, body in settings]
print(json.dumps({"traces": traces, "bls_trace_context": context, "settings": answers}, indent=1))
