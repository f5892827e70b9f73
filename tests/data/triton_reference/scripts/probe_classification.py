"""Ask a server for outputs as classifications (class_count) over tritonclient HTTP and
gRPC; prints what it answered per case as JSON (how classification.json was made:
python probe_classification.py HTTP_URL GRPC_URL against Triton serving
tests/models/classifier and classifier_nobatch)."""

import json, sys
import numpy as np
import tritonclient.http as http
import tritonclient.grpc as grpc
from tritonclient.utils import InferenceServerException
def run(url_http, url_grpc, model, data, outputs):
    res = {}
    for name, mod, url in (("http", http, url_http), ("grpc", grpc, url_grpc)):
        c = mod.InferenceServerClient(url)
        i = mod.InferInput("SCORES", list(data.shape), "FP32"); i.set_data_from_numpy(data)
        outs = [mod.InferRequestedOutput(o, class_count=k) if name == "grpc" else mod.InferRequestedOutput(o, binary_data=b, class_count=k) for o, k, b in outputs]
        try:
            r = c.infer(model, [i], outputs=outs)
            res[name] = {o: (r.as_numpy(o).tolist() if r.as_numpy(o).dtype != object else [x.decode() if isinstance(x, bytes) else x for x in r.as_numpy(o).reshape(-1)], list(r.as_numpy(o).shape), r.get_output(o)["datatype"] if name == "http" else r.get_output(o).datatype) for o, _, _ in outputs}
        except InferenceServerException as e:
            res[name] = f"error {e.status()}: {e.message()}"
    return res
a = np.array([[0.1, 0.7, -0.3, 0.7, 0.05], [3, 1, 2, 5, 4]], np.float32)
cases = {
  "batched k=2 binary": ("classifier", a, [("PROBS", 2, True)]),
  "batched k=2 json": ("classifier", a, [("PROBS", 2, False)]),
  "batched k=7 (more than elements)": ("classifier", a, [("PROBS", 7, True)]),
  "no labels output k=3": ("classifier", a, [("LOGITS", 3, True)]),
  "both outputs, one classified": ("classifier", a, [("PROBS", 1, True), ("LOGITS", 0, True)]),
  "nobatch k=2": ("classifier_nobatch", a, [("PROBS", 2, True)]),
}
out = {k: run(sys.argv[1], sys.argv[2], m, d, o) for k, (m, d, o) in cases.items()}
print(json.dumps(out, indent=1))
