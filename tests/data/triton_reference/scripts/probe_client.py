import json, numpy as np
import tritonclient.grpc as g, tritonclient.http as h
from tritonclient.utils import InferenceServerException
OUT = "/work/main/tests/data/triton_reference/"
res = []
def rec(proto, label, fn):
    try:
        r = fn()
        out = {"proto": proto, "label": label, "ok": True, "result": repr(r)[:2000]}
    except InferenceServerException as e:
        out = {"proto": proto, "label": label, "ok": False, "str": str(e), "status": e.status(), "message": e.message(), "debug_details": e.debug_details()}
    except Exception as e:
        out = {"proto": proto, "label": label, "ok": False, "other_exception": type(e).__name__ + ": " + str(e)}
    print(json.dumps(out)[:800]); res.append(out)

for proto, mod, url in [("grpc", g, "127.0.0.1:18001"), ("http", h, "127.0.0.1:18000")]:
    c = mod.InferenceServerClient(url)
    def inp(model, name="INPUT0", n=4, v=0.0):
        i = mod.InferInput(name, [n], "FP32"); i.set_data_from_numpy(np.array([v] + [0.0] * (n - 1), np.float32)); return [i]
    def addsub():
        ins = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
        ins[0].set_data_from_numpy(np.arange(16, dtype=np.float32)); ins[1].set_data_from_numpy(np.ones(16, np.float32)); return ins
    rec(proto, "is_server_ready", c.is_server_ready)
    rec(proto, "is_model_ready nope", lambda: c.is_model_ready("nope"))
    rec(proto, "get_model_metadata nope", lambda: c.get_model_metadata("nope"))
    rec(proto, "infer nope", lambda: c.infer("nope", addsub()))
    rec(proto, "infer add_sub version 7", lambda: c.infer("add_sub", addsub(), model_version="7"))
    rec(proto, "infer add_sub ok as_numpy", lambda: {k: c.infer("add_sub", addsub()).as_numpy(k).tolist() for k in ["OUTPUT0", "OUTPUT1"]})
    rec(proto, "infer add_sub get_response", lambda: c.infer("add_sub", addsub(), request_id="cid-1").get_response())
    rec(proto, "infer raiser", lambda: c.infer("raiser", inp("raiser")))
    rec(proto, "infer per_request_error NOT_FOUND", lambda: c.infer("per_request_error", inp("per_request_error", v=1.0)))
    rec(proto, "infer per_request_error UNSUPPORTED", lambda: c.infer("per_request_error", inp("per_request_error", v=5.0)))
    rec(proto, "load_model (mode none)", lambda: c.load_model("add_sub"))
    rec(proto, "get_model_repository_index", c.get_model_repository_index)
json.dump(res, open(OUT + "tritonclient_exceptions.json", "w"), indent=1)
