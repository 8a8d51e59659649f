"""The draft-length policy before and after a3ff319, on the real Qwen pair (CPU, 2 threads) and simulated.

Before, a model draft whose acceptance estimate made no K pay was off for the rest of the reply; after, it stays on
while its optimistic acceptance (the estimate plus one standard error) would still pay. "old" below is the policy
with the optimistic estimate replaced by the point estimate, which is the rule before a3ff319.

    python bench/runs/2026-11-26-cpu2-policy-ab.py real 8 3   # 8 HumanEval problems, 3 seeds: per seed a plain
        # run, then old and new speculative runs in alternating order (2026-11-26-cpu2-policy-ab-real.out, made by
        # this script's first draft, which differed only in layout)
    python bench/runs/2026-11-26-cpu2-policy-ab.py simulate bench/runs/2026-11-25-cpu2-replay-costs-gguf.json
        # no model runs: bench/replay.py simulate's table, once per policy
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, "bench")

from llmrun.speculative import DraftLength  # noqa: E402

NEW = DraftLength.optimistic_acceptance
OLD = property(lambda self: self.acceptance)


def real(problems: int, repeat: int) -> None:
    import replay

    from llmrun import bench
    from llmrun.bench_speculative import time_generation
    from llmrun.sampling import SamplingParams

    models = f"{Path.home()}/.cache/llmrun/models/"  # bench/fetch_models.py's
    settings = bench.resolve(bench.Settings("cpu", "auto", "auto", 2, 1024), default_ctx=1024)
    _, groups = replay.read_traces(replay.DEFAULT_TRACE)
    out = []
    with bench.torch_threads(2):
        eng, spec = replay.engines(models + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                   models + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", settings)
        labels = list(dict.fromkeys(label for label, _ in groups))[:problems]
        for (label, temp), traces in groups.items():
            if label not in labels:
                continue
            prompt = list(traces[0].prompt)

            def params(seed):
                return SamplingParams(temperature=temp, max_new_tokens=128, ignore_eos=True, seed=seed)

            time_generation(eng, prompt, params(0))
            time_generation(eng, prompt, params(0), spec)
            rates = {"plain": [], "old": [], "new": []}
            drafted = {"old": 0, "new": 0}
            for seed in range(repeat):
                rates["plain"].append(time_generation(eng, prompt, params(seed)).stats.decode_tok_s)
                for which in ("old", "new") if seed % 2 == 0 else ("new", "old"):
                    DraftLength.optimistic_acceptance = OLD if which == "old" else NEW
                    r = time_generation(eng, prompt, params(seed), spec)
                    rates[which].append(r.stats.decode_tok_s)
                    drafted[which] += r.stats.drafted
                DraftLength.optimistic_acceptance = NEW
            med = {k: statistics.median(v) for k, v in rates.items()}
            row = {"prompt": label, "T": temp, **{k: round(v, 1) for k, v in med.items()},
                   "old_x": round(med["old"] / med["plain"], 3), "new_x": round(med["new"] / med["plain"], 3),
                   "drafted_old": drafted["old"], "drafted_new": drafted["new"]}
            print(json.dumps(row), flush=True)
            out.append(row)
    print("median old", statistics.median(r["old_x"] for r in out), "new", statistics.median(r["new_x"] for r in out),
          "mean old", round(statistics.mean(r["old_x"] for r in out), 3),
          "new", round(statistics.mean(r["new_x"] for r in out), 3))


def simulate(costs: str) -> None:
    for which in ("old", "new"):
        code = ("import runpy, sys; from llmrun.speculative import DraftLength; "
                + ("DraftLength.optimistic_acceptance = property(lambda self: self.acceptance); " if which == "old"
                   else "")
                + f"sys.argv = ['bench/replay.py', 'simulate', '--costs', {costs!r}]; "
                  "runpy.run_path('bench/replay.py', run_name='__main__')")
        print(f"\n## {which} policy\n", flush=True)
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    if sys.argv[1] == "real":
        real(int(sys.argv[2]), int(sys.argv[3]))
    else:
        simulate(sys.argv[2])
