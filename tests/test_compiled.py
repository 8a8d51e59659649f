"""The compiled baseline (`llmrun.compiled`): the plain-PyTorch decode step made static (device positions and slots,
attention masked over the whole cache) is traced whole by torch.compile (fullgraph: a graph break fails) and gives
the eager plain path's logits, through rollbacks. On CUDA it runs as CUDA graphs (mode "reduce-overhead"); here
the trace runs eagerly (backend "eager") and, once, through Inductor's CPU code."""

import dataclasses

import pytest
import torch

from llmrun.compiled import CompiledDecode
from llmrun.generate import Engine
from llmrun.kv_cache import Eviction
from llmrun.loading import load_model

from .tiny import CONFIGS, random_model, write_gguf


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    path = write_gguf(tmp_path_factory.mktemp("c") / "tiny-smollm2-Q4_1.gguf", model, qtype="Q4_1")
    return load_model(str(path), DEVICE, "fp32", "dequant")  # the plain path: every op from kernels.ref


def greedy_logits(engine, prompt, steps, rollback_at=None):
    """Logits of a greedy run: the prompt, then `steps` decode steps; at step `rollback_at` the cache drops its
    last 3 tokens and decoding goes on from there with token 11."""
    logits, _ = engine.prefill(prompt)
    out = [logits]
    for i in range(steps):
        token = int(out[-1].argmax())
        if i == rollback_at:
            engine.rollback(len(engine.tokens) - 3)
            token = 11
        out.append(engine.decode(token))
    return torch.stack(out)


@pytest.mark.parametrize("rollback_at", [None, 6])
def test_the_compiled_step_is_the_plain_step(plain_model, rollback_at):
    plain, compiled = Engine(plain_model, 48), Engine(plain_model, 48)
    compiled.graphs = step = CompiledDecode(compiled.model, compiled.cache, backend="eager")
    calls = []
    traced = step.compiled
    step.compiled = lambda *args: calls.append(1) or traced(*args)
    prompt = [5, 17, 3, 99, 42, 7, 61]
    want = greedy_logits(plain, prompt, 12, rollback_at)
    torch.compiler.reset()
    got = greedy_logits(compiled, prompt, 12, rollback_at)
    assert len(calls) == 12  # every decode step ran the traced step (the prompt runs eagerly)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_compiled_step_takes_a_token_drawn_on_the_device(plain_model):
    """The baseline decodes as llmrun's engine does (`Engine.plain_steps`, gpt-fast's loop too): each step's token
    copied into the step's inputs on the device, the host reading it a step later: the tokens fed from the host."""
    from llmrun.sampling import Randomness, SamplingParams

    got = []
    for pipeline in (False, True):
        engine = Engine(plain_model, 48)
        engine.graphs, engine.pipeline = CompiledDecode(engine.model, engine.cache, backend="eager"), pipeline
        torch.compiler.reset()
        logits, _ = engine.prefill([5, 17, 3, 99, 42, 7, 61])
        first = int(logits.argmax())
        got.append(list(engine.plain_steps(first, SamplingParams(temperature=0), Randomness(0), 12)))
        assert engine.tokens[7:] == [first, *got[-1][:-1]]
    assert got[0] == got[1] and len(set(got[0])) > 3


def test_the_cache_is_a_static_input(plain_model):
    """Every input of the traced step that is (a view of) the KV cache, which the step writes in place, is marked
    static: Inductor replays a step as a CUDA graph only when each input it mutates is static, else it logs
    "skipping cudagraphs due to mutated inputs" and runs the step without one, which is not gpt-fast's baseline."""
    engine = Engine(plain_model, 48)
    inputs = []

    def backend(gm, example_inputs):
        for node, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if isinstance(x, torch.Tensor):
                inputs.append((node.name, x.untyped_storage().data_ptr(),
                               node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")))
        return gm.forward

    engine.graphs = CompiledDecode(engine.model, engine.cache, backend=backend)
    torch.compiler.reset()
    logits, _ = engine.prefill([5, 17, 3])
    engine.decode(int(logits.argmax()))
    cache = {buffer.untyped_storage().data_ptr() for buffer in engine.cache.dense}
    of_cache = [(name, static) for name, storage, static in inputs if storage in cache]
    assert len(of_cache) == 2 * plain_model.model.config.n_layers, inputs  # each layer's K and V
    assert all(static for _, static in of_cache), of_cache


@pytest.mark.slow
def test_inductor_compiles_the_step(plain_model):
    """Inductor's own kernels for the static step (C++ here; on CUDA Triton's, replayed as CUDA graphs): the
    plain path's logits."""
    plain, compiled = Engine(plain_model, 32), Engine(plain_model, 32)
    compiled.graphs = CompiledDecode(compiled.model, compiled.cache, mode="reduce-overhead" if DEVICE == "cuda"
                                     else "default")
    want = greedy_logits(plain, [5, 17, 3], 6)
    torch.compiler.reset()
    got = greedy_logits(compiled, [5, 17, 3], 6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_only_caches_that_hold_every_token(plain_model):
    engine = Engine(plain_model, 48, eviction=Eviction("window", 64))
    with pytest.raises(ValueError, match="holds every token"):
        CompiledDecode(engine.model, engine.cache, backend="eager")
