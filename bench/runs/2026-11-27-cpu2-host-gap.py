"""A speculative step's host work between its verification and the next block's forward, on the CPU: the embedded
model with prompt lookup on the code-edit prompt, 200 tokens, greedy and at T 0.8 (the second of two runs each),
the wall time from `verify` returning to the next `Engine.forward` starting (rollback, the policy's choice, the
tokens' text and stop checks, the lookup). On a GPU the device waits through it.

    python bench/runs/2026-11-27-cpu2-host-gap.py   # > bench/runs/2026-11-27-cpu2-host-gap.out
"""

import statistics
import time

import torch

from llmrun import bench, generate
from llmrun.loading import open_model
from llmrun.sampling import SamplingParams
from llmrun.speculative import make_speculator
from llmrun.workloads import make_workload

torch.set_num_threads(2)
engine = bench.open_engine(open_model("smollm2"), bench.resolve(bench.Settings(ctx=1024), 1024))
prompt = list(make_workload(engine.tokenizer, kind="code-edit").prompt)
engine.speculator = make_speculator(engine, ngram=3)
marks = []
verify, forward = generate.verify, generate.Engine.forward

def timed_verify(*args, **kwargs):
    result = verify(*args, **kwargs)
    marks.append(("verified", time.perf_counter()))
    return result


def timed_forward(self, *args, **kwargs):
    marks.append(("forward", time.perf_counter()))
    return forward(self, *args, **kwargs)


generate.verify, generate.Engine.forward = timed_verify, timed_forward
for temperature in (0.0, 0.8):
    params = SamplingParams(temperature=temperature, max_new_tokens=200, ignore_eos=True, seed=0)
    for _ in range(2):
        marks.clear()
        engine.reset()
        list(engine.generate(prompt, params))
    gaps = [b - a for (what, a), (nxt, b) in zip(marks, marks[1:]) if what == "verified" and nxt == "forward"]
    print(f"T {temperature:g}: verification to the next forward, median {statistics.median(gaps) * 1e6:.0f} us"
          f" (quartiles {statistics.quantiles(gaps)[0] * 1e6:.0f}-{statistics.quantiles(gaps)[2] * 1e6:.0f}),"
          f" {len(gaps)} steps")
