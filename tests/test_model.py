"""The model's math: cached decode equals a full forward, for every architecture variant, in fp32."""

import pytest
import torch

from llmrun.kv_cache import KVCache
from llmrun.models.config import ModelConfig, RopeScaling, rope_inv_freq

from .tiny import CONFIGS, decode_in_steps, random_model

T = 19  # prompt + decoded tokens, longer than Mistral's tiny window of 5


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("prefill", [1, 7, T])
def test_cached_decode_equals_full_forward(arch, prefill):
    cfg = CONFIGS[arch]
    model = random_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)[0]  # (T, V), no cache
    torch.testing.assert_close(decode_in_steps(model, tokens, prefill), full, atol=1e-4, rtol=1e-4)


def test_last_only_and_chunked_prefill_match():
    cfg = CONFIGS["qwen2"]
    model = random_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache.for_model(cfg, 16, torch.float32, "cpu")
        a = model(tokens[:, :5], 0, cache, last_only=True)[0]
        cache.length = 5
        b = model(tokens[:, 5:], 5, cache, last_only=True)[0]
    torch.testing.assert_close(a[0], full[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b[0], full[11], atol=1e-4, rtol=1e-4)


def test_sliding_window_limits_attention():
    """With a window of 5, the first token cannot influence logits 5 or more positions later."""
    cfg = CONFIGS["mistral"]
    model = random_model(cfg)
    a = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    b = a.clone()
    b[0, 0] = (a[0, 0] + 1) % cfg.vocab_size
    with torch.no_grad():
        la, lb = model(a)[0], model(b)[0]
    # The window is per layer, so influence spreads 4 positions per layer: 2 layers reach position 8.
    assert not torch.allclose(la[1], lb[1])
    torch.testing.assert_close(la[2 * 4 + 1 :], lb[2 * 4 + 1 :])


def test_a_window_from_a_later_layer_leaves_the_first_layers_whole():
    """Qwen2's max_window_layers: layer 0 attends to the whole context, layer 1 within 5 positions. The model
    equals its layers run by hand with those windows (the CPU's whole-stack call, one window for all, is not
    used), and the first token reaches every later logit, where windowing both layers would cut it off."""
    from dataclasses import replace

    cfg = replace(CONFIGS["qwen2"], sliding_window=5, sliding_window_from=1)
    model = random_model(cfg)
    a = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    b = a.clone()
    b[0, 0] = (a[0, 0] + 1) % cfg.vocab_size
    with torch.no_grad():
        x = model.embed(a)
        cos, sin = (t[:12] for t in model._rope_tables(12, x.device))
        for layer, window in zip(model.layers, (None, 5)):
            x = layer(x, cos, sin, 0, None, window)
        torch.testing.assert_close(model(a), model.lm_head(model.norm(x)).float())  # (Qwen2: an untied head)
        la, lb = model(a)[0], model(b)[0]
        assert not torch.allclose(la[-1], lb[-1])
        every = replace(cfg, sliding_window_from=0)
        windowed = random_model(every)
        torch.testing.assert_close(windowed(a)[0][9:], windowed(b)[0][9:])
    torch.testing.assert_close(decode_in_steps(model, a, 4), la, atol=1e-4, rtol=1e-4)


def test_gqa_matches_repeated_kv_heads():
    """A GQA model equals the same model with its K/V heads repeated into a multi-head one."""
    cfg = CONFIGS["smollm2"]  # 9 query heads, 3 kv heads
    gqa = random_model(cfg)
    mha_cfg = ModelConfig(**{**cfg.__dict__, "n_kv_heads": cfg.n_heads})
    mha = random_model(mha_cfg)
    state = gqa.state_dict()
    rep = cfg.n_heads // cfg.n_kv_heads
    for i in range(cfg.n_layers):
        q, k, v = state[f"layers.{i}.attn.qkv.weight"].split([cfg.n_heads * cfg.head_dim, *[cfg.n_kv_heads * cfg.head_dim] * 2])
        k, v = (w.view(cfg.n_kv_heads, cfg.head_dim, cfg.dim).repeat_interleave(rep, 0).reshape(-1, cfg.dim) for w in (k, v))
        state[f"layers.{i}.attn.qkv.weight"] = torch.cat((q, k, v))
    mha.load_state_dict(state)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), atol=1e-5, rtol=1e-5)


def test_llama3_rope_scaling_bands():
    cfg = CONFIGS["llama3.1"]
    rs = cfg.rope_scaling
    plain = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = rope_inv_freq(cfg)
    import math

    for f, s in zip(plain, scaled):
        wavelen = 2 * math.pi / f
        if wavelen < rs.original_max_position / rs.high_freq_factor:
            assert s == f  # short wavelengths untouched
        elif wavelen > rs.original_max_position / rs.low_freq_factor:
            assert s == pytest.approx(f / rs.factor)  # long wavelengths slowed by the factor
        else:
            assert f / rs.factor < s < f


def test_linear_rope_scaling_divides_positions():
    base = CONFIGS["llama"]
    scaled_cfg = ModelConfig(**{**base.__dict__, "rope_scaling": RopeScaling("linear", 2.0)})
    plain, scaled = random_model(base), random_model(scaled_cfg)
    cos_p, _ = plain._rope_tables(64, torch.device("cpu"))
    cos_s, _ = scaled._rope_tables(64, torch.device("cpu"))
    torch.testing.assert_close(cos_s[10], cos_p[5])


def test_kv_cache_truncate_and_overflow():
    cfg = CONFIGS["llama"]
    cache = KVCache.for_model(cfg, 8, torch.float32, "cpu")
    k = torch.randn(1, 6, cfg.n_kv_heads, cfg.head_dim)  # (B, T, Hkv, D)
    kk, vv, mass = cache.update(0, 0, k, k)
    assert kk.shape[2] == 6 and mass is None
    cache.length = 6
    cache.truncate(2)
    assert cache.length == 2
    from llmrun.errors import ContextOverflowError

    cache.update(0, 2, k, k)  # positions 2..7: fits exactly
    with pytest.raises(ContextOverflowError):
        cache.update(0, 3, k, k)
    with pytest.raises(ValueError):
        cache.truncate(5)
