"""A worker for the launcher tests: a linear model fitted by hand-written gradients.

    numpy_worker.py ITERATIONS [SLEEP_S]

Every iteration pushes the gradient and pulls the next parameters (push_pull); prints
`started` once the model is registered, so a test knows training runs.
"""

import sys
import time

import numpy as np

import elasticps

iterations = int(sys.argv[1])
sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
w = elasticps.init()
rng = np.random.default_rng(w.rank)
true_w = np.linspace(-1, 1, 64, dtype=np.float32)
params = {"w": np.zeros(64, np.float32), "big": np.zeros(256 * 1024, np.float32)}
w.register_model(params)
print("started", flush=True)
for t in range(iterations):
    x = rng.standard_normal((32, 64), dtype=np.float32)
    err = x @ params["w"] - x @ true_w
    grads = {"w": (x.T @ err / len(err)).astype(np.float32), "big": np.zeros_like(params["big"])}
    w.push_pull(t, grads, params)
    elasticps.log(step=t + 1, total=iterations, loss=float((err**2).mean()))
    if sleep_s:
        time.sleep(sleep_s)
elasticps.finish()
