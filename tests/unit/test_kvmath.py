"""KV memory arithmetic (exporter/kvmath/): exact bytes for real architectures, budgets, the CLI.

Every architecture test names where its numbers come from. The config.json fixtures under
tests/fixtures/models/ carry the published configs' numbers (only the keys that matter here).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devtools import harness
from kvcache_exporter.kvmath import ArchitectureError, KVLayout, layout_from_config_json, layout_from_mapping
from kvcache_exporter.commands.kv_math import main
from kvcache_exporter.units import format_bytes

MODELS = harness.FIXTURES / "models"
KiB, MiB, GiB = 2**10, 2**20, 2**30


def model(name: str) -> KVLayout:
    return layout_from_config_json(MODELS / name / "config.json")


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


# ------------------------------------------------------------------ full attention (GQA, MQA)

def test_8b_class_gqa_numbers_of_the_brief():
    # 32 layers, 8 KV heads, head dim 128, BF16 (the Llama 3 8B / Mistral 7B shape).
    layout = layout_from_mapping({"layers": 32, "kv_heads": 8, "head_dim": 128, "model_dtype": "bf16"})
    assert layout.bytes_per_token() == 131072 == 128 * KiB
    assert layout.bytes_per_sequence(8192) == 1 * GiB
    assert 32 * layout.bytes_per_sequence(8192) == 32 * GiB
    assert layout.sequences_in_budget(32 * GiB, 8192) == 32
    assert layout.sequences_in_budget(32 * GiB - 1, 8192) == 31


def test_llama_3_70b_gqa():
    # Llama 3 paper (arXiv 2407.21783), Table 3: the 70B model has 80 layers, model dimension 8192,
    # 64 attention heads and 8 KV heads (head dim 8192 / 64 = 128); config.json of
    # meta-llama/Meta-Llama-3-70B has no head_dim, so it is derived. 2 x 80 x 8 x 128 x 2 B = 320 KiB.
    layout = model("llama-3-70b")
    assert (layout.layers, layout.kv_heads, layout.head_dim) == (80, 8, 128)
    assert layout.bytes_per_token() == 327680 == 320 * KiB
    assert layout.bytes_per_sequence(8192) == 2.5 * GiB


def test_tensor_parallel_splits_kv_heads_and_replicates_below_one_head_per_rank():
    # Same Llama 3 70B: 8 KV heads over TP 4 = 2 heads per GPU; over TP 16 every GPU holds one
    # head (each head on two ranks), so a GPU holds 1/8 of the KV, not 1/16.
    layout = model("llama-3-70b")
    assert layout.kv_heads_per_gpu(4) == 2
    assert layout.bytes_per_token(tp=4) == 81920 == 80 * KiB
    assert layout.kv_heads_per_gpu(8) == 1
    assert layout.kv_heads_per_gpu(16) == 1
    assert layout.bytes_per_token(tp=16) == layout.bytes_per_token(tp=8) == 40 * KiB
    # Budget is per GPU: 40 GiB on each of 4 GPUs holds 64 sequences of 8k (2.5 GiB / 4 each).
    assert layout.sequences_in_budget(40 * GiB, 8192, tp=4) == 64
    with pytest.raises(ArchitectureError, match=r"^tp: 8 KV heads cannot be split evenly over 3 ranks$"):
        layout.bytes_per_token(tp=3)
    with pytest.raises(ArchitectureError, match=r"^tp: 8 KV heads cannot be replicated evenly over 12 ranks$"):
        layout.bytes_per_token(tp=12)


def test_missing_head_dim_is_hidden_size_over_heads_and_qwen2_window_is_off():
    # Qwen/Qwen2-7B-Instruct config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads, no
    # head_dim (3584 / 28 = 128); sliding_window 131072 but use_sliding_window false.
    layout = model("qwen2-7b-instruct")
    assert (layout.kv_heads, layout.head_dim) == (4, 128)
    assert layout.sliding_attention_layers == 0
    assert layout.bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 56 * KiB
    assert layout.bytes_per_sequence(200_000) == 56 * KiB * 200_000


def test_qwen2_sliding_window_starts_at_max_window_layers_when_enabled():
    # Hugging Face's Qwen2 code: with use_sliding_window, layers from max_window_layers on slide.
    cfg = config("qwen2-7b-instruct") | {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21}
    layout = layout_from_config_json(cfg)
    assert (layout.full_attention_layers, layout.sliding_attention_layers) == (21, 7)
    per_layer_token = 2 * 4 * 128 * 2
    assert layout.bytes_per_sequence(10_000) == per_layer_token * (21 * 10_000 + 7 * 4096)


def test_mqa_one_kv_head_replicated_on_every_rank():
    # Gemma paper (arXiv 2403.08295), Table 1: the 2B model has 18 layers, 8 heads, 1 KV head
    # (multi-query attention), head size 256: 2 x 18 x 1 x 256 x 2 B = 18 KiB per token.
    layout = model("gemma-2b")
    assert layout.bytes_per_token() == 18432 == 18 * KiB
    assert layout.kv_heads_per_gpu(4) == 1
    assert layout.bytes_per_token(tp=4) == 18 * KiB  # the one head is copied, not split


def test_mqa_multi_query_flag_and_gpt_style_key_names():
    # StarCoder paper (arXiv 2305.06161): 40 layers, 48 heads, hidden 6144, multi-query attention;
    # its gpt_bigcode config.json spells them n_layer, n_head, n_embd and multi_query.
    layout = layout_from_config_json(
        {"model_type": "gpt_bigcode", "n_layer": 40, "n_head": 48, "n_embd": 6144, "multi_query": True,
         "torch_dtype": "float32"}
    )
    assert (layout.kv_heads, layout.head_dim) == (1, 128)
    assert layout.bytes_per_token() == 2 * 40 * 1 * 128 * 4  # auto = the model's float32
    assert layout.bytes_per_token("bf16") == 20 * KiB


@pytest.mark.parametrize("name", sorted(path.name for path in MODELS.iterdir()))
def test_cache_dtype_scales_bytes_per_element(name):
    layout = model(name)
    bf16 = layout.bytes_per_token("bf16")
    assert layout.bytes_per_token() == bf16  # every fixture's torch_dtype is bfloat16
    assert layout.bytes_per_token("fp8") * 2 == bf16
    assert layout.bytes_per_token("fp8_e4m3") == layout.bytes_per_token("fp8_e5m2") == bf16 // 2
    assert layout.bytes_per_token("int8") == bf16 // 2
    assert layout.bytes_per_token("fp32") == 2 * bf16
    assert layout.bytes_per_token("float16") == bf16
    assert layout.bytes_per_sequence(4096, "fp8") * 2 == layout.bytes_per_sequence(4096, "bf16")


def test_kv_cache_dtype_of_the_layout_applies_unless_overridden():
    layout = layout_from_mapping({"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_cache_dtype": "fp8_e5m2"})
    assert layout.resolve_kv_dtype() == "fp8_e5m2"
    assert layout.bytes_per_token() == 64 * KiB
    assert layout.bytes_per_token("auto") == 128 * KiB  # auto = model dtype (bf16 by default)
    with pytest.raises(ArchitectureError, match=r"^kv_cache_dtype: unknown dtype 'fp4'"):
        layout.bytes_per_token("fp4")


# ------------------------------------------------------------------ sliding windows

def test_mistral_7b_every_layer_slides_over_4096_tokens():
    # Mistral 7B paper (arXiv 2310.06825), section 2: window W = 4096, and the rolling buffer
    # cache "reduces the cache memory usage by 8x" on a sequence of 32k tokens.
    layout = model("mistral-7b-v0.1")
    assert (layout.sliding_attention_layers, layout.sliding_window) == (32, 4096)
    assert layout.describe() == "32 layers: 32 sliding window (4096 tokens); 8 KV heads x head dim 128; model dtype bf16"
    full_attention_bytes = layout.bytes_per_token() * 32768
    assert full_attention_bytes == 8 * layout.bytes_per_sequence(32768)
    assert layout.bytes_per_sequence(32768) == 512 * MiB
    assert layout.bytes_per_sequence(1000) == 1000 * 128 * KiB  # inside the window: every token
    # A pool of 100,000 tokens holds 100000 // 4096 sequences of 32k, not 100000 // 32768.
    assert layout.sequences_in_capacity(100_000, 32768) == 24
    assert layout.sequences_in_capacity(100_000, 2000) == 50


def test_gemma_3_27b_interleaves_five_local_layers_per_global_one():
    # Gemma 3 technical report (arXiv 2503.19786), section 2.1: 5 local layers for every global
    # layer, starting with a local one, local span 1024 tokens. config.json of google/gemma-3-27b-it
    # nests the text model: 62 layers, 16 KV heads, head_dim 128, sliding_window_pattern 6,
    # torch_dtype at the top level. Layers 5, 11, ..., 59 are global: 10 of 62.
    layout = model("gemma-3-27b")
    assert (layout.layers, layout.full_attention_layers, layout.sliding_attention_layers) == (62, 10, 52)
    assert (layout.kv_heads, layout.head_dim, layout.sliding_window) == (16, 128, 1024)
    assert layout.bytes_per_token() == 2 * 62 * 16 * 128 * 2 == 496 * KiB
    per_layer_token = 2 * 16 * 128 * 2
    assert layout.bytes_per_sequence(32768) == per_layer_token * (10 * 32768 + 52 * 1024) == 3_120_562_176
    assert layout.bytes_per_sequence(1024) == layout.bytes_per_token() * 1024


def test_gemma_3_pattern_layer_types_and_model_default_agree():
    from_pattern = model("gemma-3-27b")
    explicit = config("gemma-3-27b")
    explicit["text_config"].pop("sliding_window_pattern")
    explicit["text_config"]["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
    ]
    assert layout_from_config_json(explicit) == from_pattern
    # Without the pattern, gemma3_text's own default (6) applies, as in Hugging Face's code.
    defaulted = config("gemma-3-27b")
    defaulted["text_config"].pop("sliding_window_pattern")
    assert layout_from_config_json(defaulted) == from_pattern


def test_gemma_2_alternates_local_and_global_layers():
    # Gemma 2 paper (arXiv 2408.00118): local sliding-window (4096) and global attention in
    # every other layer; google/gemma-2-9b config.json: 42 layers, 8 KV heads, head_dim 256,
    # no layer_types, so model_type gemma2 decides the alternation.
    layout = layout_from_config_json(
        {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096, "torch_dtype": "bfloat16"}
    )
    assert (layout.full_attention_layers, layout.sliding_attention_layers) == (21, 21)
    per_layer_token = 2 * 8 * 256 * 2
    assert layout.bytes_per_sequence(8192) == per_layer_token * (21 * 8192 + 21 * 4096)


# ------------------------------------------------------------------ MLA

def test_deepseek_v3_mla_caches_one_576_element_latent_per_layer():
    # DeepSeek-V3 technical report (arXiv 2412.19437), section 4.2: 61 layers, KV compression
    # dimension d_c = 512, decoupled RoPE key dimension d_h^R = 64. DeepSeek-V2 paper
    # (arXiv 2405.04434), Table 1: MLA caches (d_c + d_h^R) x layers elements per token, "equal
    # to GQA with only 2.25 groups" at head dim 128. config.json: kv_lora_rank 512,
    # qk_rope_head_dim 64, num_key_value_heads 128 (not what the cache holds).
    layout = model("deepseek-v3")
    assert layout.mla_latent_dim == 576
    assert layout.elements_per_layer_token() == 576 == 2.25 * 2 * 128
    assert layout.bytes_per_token() == 576 * 61 * 2 == 70272
    assert format_bytes(layout.bytes_per_token()) == "68.62 KiB"
    assert layout.bytes_per_token("fp8") == 35136
    assert layout.bytes_per_sequence(131072) == 70272 * 131072
    # The latent is replicated on every TP rank.
    assert layout.bytes_per_token(tp=8) == layout.bytes_per_token(tp=16) == 70272
    with pytest.raises(ArchitectureError, match=r"^kv_heads: an MLA model caches a latent"):
        layout.kv_heads_per_gpu(8)


def test_mla_from_explicit_numbers():
    layout = layout_from_mapping({"layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert layout == model("deepseek-v3")


# ------------------------------------------------------------------ hybrid models

def test_jamba_only_attention_layers_hold_kv():
    # Jamba paper (arXiv 2403.19887), Table 1: KV cache of 4GB at 256K context in 16 bit, 8x less
    # than Mixtral (32GB). ai21labs/Jamba-v0.1 config.json: 32 layers, attention where
    # i % attn_layer_period (8) == attn_layer_offset (4), i.e. 4 layers; 8 KV heads, head dim 128.
    layout = model("jamba-v0.1")
    assert (layout.full_attention_layers, layout.recurrent_layers) == (4, 28)
    assert layout.bytes_per_token() == 16 * KiB
    assert layout.bytes_per_sequence(256 * 1024) == 4 * GiB
    all_attention = layout_from_mapping({"layers": 32, "kv_heads": 8, "head_dim": 128})
    assert all_attention.bytes_per_sequence(256 * 1024) == 32 * GiB == 8 * layout.bytes_per_sequence(256 * 1024)


def test_jamba_mamba_state_counts_per_sequence_in_a_budget():
    # Mamba1 state per layer (vLLM's shapes): conv (d_conv - 1) x d_inner + ssm d_inner x d_state,
    # d_inner = mamba_expand (2) x hidden 4096 = 8192, d_state 16, d_conv 4; bf16; 28 layers.
    layout = model("jamba-v0.1")
    state = 28 * (3 * 8192 + 8192 * 16) * 2
    assert layout.recurrent_state_bytes() == state == 8_716_288
    assert layout.recurrent_state_bytes(tp=2) == state // 2
    # 80 GiB holds 20 KV caches of 256K tokens, but not their 20 states on top: 19 sequences.
    assert layout.sequences_in_budget(80 * GiB, 256 * 1024) == 19
    assert layout.sequences_in_capacity(20 * 256 * 1024, 256 * 1024) == 20  # a token pool holds KV only


def test_nemotron_h_pattern_mamba2_state_and_tp_group_replication():
    # nvidia/Nemotron-H-8B-Base-8K config.json: 52 layers in hybrid_override_pattern, 4 '*'
    # attention, 24 'M' Mamba2, 24 '-' MLP; 8 KV heads, attention_head_dim 128; mamba_num_heads
    # 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4; bf16.
    layout = model("nemotron-h-8b")
    assert (layout.full_attention_layers, layout.recurrent_layers, layout.layers) == (4, 24, 52)
    assert layout.describe().startswith("52 layers: 4 full attention, 24 recurrent (mamba2), 24 without cache;")
    assert layout.bytes_per_token() == 2 * 4 * 8 * 128 * 2 == 16 * KiB
    # State shapes as vLLM allocates them: conv (conv_kernel - 1) x (heads x head_dim + 2 x groups
    # x state), ssm heads x head_dim x state: per layer 3 x 10240 + 128 x 64 x 128 elements.
    per_layer = (3 * (8192 + 2 * 8 * 128) + 128 * 64 * 128) * 2
    assert per_layer == 2_158_592
    assert layout.recurrent_state_bytes() == 24 * per_layer == 51_806_208
    assert layout.recurrent_state_bytes(tp=2) == 51_806_208 // 2
    # TP 16 > 8 groups: the groups are replicated up to 16, so the conv state does not shrink 16x.
    assert layout.recurrent_state_bytes(tp=16) == 24 * (3 * (8192 + 2 * 16 * 128) // 16 + 8 * 64 * 128) * 2
    assert layout.bytes_per_token(tp=16) == 2 * 4 * 1 * 128 * 2


def test_qwen3_next_gated_deltanet_layers_hold_state_not_kv():
    # Qwen/Qwen3-Next-80B-A3B config.json: 48 layers, full_attention_interval 4 (layers 3, 7, ...
    # are full attention: 12), 2 KV heads, head_dim 256; Gated DeltaNet layers with 16 key heads,
    # 32 value heads, head dims 128, conv kernel 4.
    layout = model("qwen3-next-80b-a3b")
    assert (layout.full_attention_layers, layout.recurrent_layers) == (12, 36)
    assert layout.bytes_per_token() == 2 * 12 * 2 * 256 * 2 == 24 * KiB
    per_layer = (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    assert layout.recurrent_state_bytes() == 36 * per_layer == 39_518_208
    explicit = config("qwen3-next-80b-a3b") | {
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    }
    assert layout_from_config_json(explicit) == layout


def test_recurrent_state_unknown_when_the_config_does_not_size_it():
    cfg = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64,
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    layout = layout_from_config_json(cfg)
    assert layout.recurrent_layers == 3 and layout.recurrent_state is None
    assert layout.recurrent_state_bytes() is None
    kv_per_sequence = 2 * 2 * 64 * 2 * 100
    assert layout.bytes_per_sequence(100) == kv_per_sequence
    assert layout.sequences_in_budget(2 * kv_per_sequence, 100) == 2  # KV only: nothing else is known


def test_ssm_state_dtype_from_the_config():
    # Nemotron 3 Super's config.json sets mamba_ssm_cache_dtype float32: the ssm part doubles.
    layout = layout_from_config_json(config("nemotron-h-8b") | {"mamba_ssm_cache_dtype": "float32"})
    assert layout.recurrent_state_bytes() == 24 * (3 * 10240 * 2 + 128 * 64 * 128 * 4)


# ------------------------------------------------------------------ budgets, as properties

@st.composite
def layouts(draw):
    layers = draw(st.integers(1, 128))
    sliding = draw(st.integers(0, layers - 1))
    return KVLayout(
        layers=layers,
        full_attention_layers=layers - sliding,
        sliding_attention_layers=sliding,
        sliding_window=draw(st.integers(1, 8192)) if sliding else None,
        kv_heads=draw(st.sampled_from([1, 2, 4, 8, 16])),
        head_dim=draw(st.sampled_from([64, 96, 128, 256])),
        model_dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
    )


@settings(max_examples=200, derandomize=True, deadline=None)
@given(layout=layouts(), seq_len=st.integers(1, 300_000), budget=st.integers(0, 2**40))
def test_sequences_in_budget_is_the_largest_count_that_fits(layout, seq_len, budget):
    per_sequence = layout.bytes_per_sequence(seq_len)
    count = layout.sequences_in_budget(budget, seq_len)
    assert count * per_sequence <= budget < (count + 1) * per_sequence
    assert layout.bytes_per_sequence(seq_len + 1) >= per_sequence
    assert per_sequence <= layout.bytes_per_token() * seq_len
    if not layout.sliding_attention_layers:
        assert per_sequence == layout.bytes_per_token() * seq_len
        assert layout.sequences_in_capacity(budget, seq_len) == budget // seq_len


@settings(max_examples=100, derandomize=True, deadline=None)
@given(layout=layouts(), seq_len=st.integers(1, 300_000), capacity=st.integers(0, 10**7))
def test_capacity_in_tokens_and_in_bytes_agree(layout, seq_len, capacity):
    # A pool of N tokens is N x bytes per token of memory.
    assert layout.sequences_in_capacity(capacity, seq_len) == layout.sequences_in_budget(
        capacity * layout.bytes_per_token(), seq_len
    )


# ------------------------------------------------------------------ loading and errors

def test_loads_from_a_snapshot_directory_and_from_a_dict():
    assert layout_from_config_json(MODELS / "llama-3-70b") == model("llama-3-70b")
    assert layout_from_config_json(config("llama-3-70b")) == model("llama-3-70b")


def test_mapping_config_json_relative_to_base_dir_with_dtype_overrides():
    layout = layout_from_mapping(
        {"config_json": "llama-3-70b/config.json", "kv_cache_dtype": "fp8"}, base_dir=MODELS
    )
    assert layout.bytes_per_token() == 160 * KiB
    assert layout_from_mapping({"config_json": "gemma-2b", "model_dtype": "fp32"}, base_dir=MODELS).bytes_per_token() == 36 * KiB


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({}, "num_hidden_layers: missing"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers: must be an integer >= 1, got '32'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers: must be an integer >= 1, got 0"),
        ({"text_config": {"hidden_size": 8}}, "text_config.num_hidden_layers: missing"),
        ({"text_config": [1]}, "text_config: must be an object"),
        ({"num_hidden_layers": 2, "head_dim": 64}, "num_key_value_heads: missing, and no num_attention_heads to default to"),
        ({"num_hidden_layers": 2, "num_attention_heads": 24, "hidden_size": 4096},
         "hidden_size: 4096 is not a multiple of num_attention_heads (24)"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8}, "head_dim: missing, and no hidden_size to derive it from"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "qk_rope_head_dim: missing"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8, "torch_dtype": "float64"},
         "torch_dtype: unknown dtype 'float64'"),
        ({"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["full_attention"] * 3},
         "layer_types: must list one entry per layer: 3 entries for 4 layers"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["full_attention", "bogus"]},
         "layer_types[1]: unknown layer type 'bogus'"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8,
          "layer_types": ["full_attention", "sliding_attention"]},
         "sliding_window: missing, but layer_types has sliding layers"),
        ({"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["mamba", "mamba"]},
         "attention_layers: no layer holds KV"),
        ({"num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 8, "hybrid_override_pattern": "M*"},
         "hybrid_override_pattern: must have one character per layer (3)"),
        ({"num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 8, "hybrid_override_pattern": "M*X"},
         "hybrid_override_pattern: unknown layer character 'X'"),
        ({"num_hidden_layers": 8, "num_key_value_heads": 1, "head_dim": 8, "attn_layer_period": 4, "attn_layer_offset": 4},
         "attn_layer_offset: must be an integer in [0, attn_layer_period), got 4"),
        ({"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8, "full_attention_interval": 2,
          "linear_num_value_heads": 4}, "linear_num_key_heads: missing"),
    ],
)
def test_bad_configs_name_the_key(cfg, message):
    with pytest.raises(ValueError) as caught:
        layout_from_config_json(cfg)
    assert str(caught.value).startswith(message)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ArchitectureError, match=r"^config_json: cannot read .*nope\.json"):
        layout_from_config_json(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ArchitectureError, match=r"^config_json: .*broken\.json is not valid JSON"):
        layout_from_config_json(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ArchitectureError, match=r"^config_json: .*list\.json holds a JSON list, not an object"):
        layout_from_config_json(tmp_path / "list.json")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"kv_heads": 8, "head_dim": 128}, "m.layers: missing"),
        ({"layers": 32, "kv_heads": "eight", "head_dim": 128}, "m.kv_heads: must be an integer >= 1, got 'eight'"),
        ({"layers": 32, "kv_heads": 8, "head_dim": 128, "heads": 32}, "m.heads: unknown key"),
        ({"layers": 32, "config_json": "x.json"}, "m.layers: cannot be combined with config_json"),
        ({"layers": 4, "kv_heads": 1, "head_dim": 8, "sliding_window_layers": 2}, "m.sliding_window: missing"),
        ({"layers": 4, "kv_heads": 1, "head_dim": 8, "sliding_window": 16, "sliding_window_layers": 5},
         "m.sliding_window_layers: 5 is more than the 4 attention layers"),
        ({"layers": 4, "attention_layers": 3, "recurrent_layers": 2, "kv_heads": 1, "head_dim": 8},
         "m.layers: 4 layers cannot hold 3 attention and 2 recurrent layers"),
        ({"layers": 4, "kv_heads": 1, "head_dim": 8, "model_dtype": "int4"}, "m.model_dtype: unknown dtype 'int4'"),
        ({"config_json": "gemma-2b", "kv_cache_dtype": "fp8", "model_dtype": "x"}, "m.model_dtype: unknown dtype 'x'"),
        ({"config_json": "no-such-model"}, "m.config_json: cannot read"),
    ],
)
def test_bad_mappings_name_the_key(values, message):
    with pytest.raises(ArchitectureError) as caught:
        layout_from_mapping(values, base_dir=MODELS, prefix="m.")
    assert str(caught.value).startswith(message)


def test_bad_key_inside_a_referenced_config_json_names_file_and_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ArchitectureError) as caught:
        layout_from_mapping({"config_json": "config.json"}, base_dir=tmp_path, prefix="targets.a.model_architecture.")
    assert caught.value.key == "targets.a.model_architecture.config_json"
    assert caught.value.problem == f"{tmp_path / 'config.json'}: num_key_value_heads: missing, and no num_attention_heads to default to"


def test_hybrid_explicit_numbers():
    layout = layout_from_mapping({"layers": 32, "recurrent_layers": 28, "kv_heads": 8, "head_dim": 128})
    assert layout.attention_layers == 4 and layout.bytes_per_token() == 16 * KiB
    assert layout.recurrent_state_bytes() is None


def test_layouts_are_frozen_and_validate_direct_construction():
    layout = model("llama-3-70b")
    with pytest.raises(AttributeError):
        layout.layers = 1  # type: ignore[misc]
    with pytest.raises(ArchitectureError, match=r"^kv_heads: missing$"):
        KVLayout(layers=2, full_attention_layers=2, head_dim=8)
    assert KVLayout(layers=1, full_attention_layers=1, kv_heads=1, head_dim=8, model_dtype="bfloat16").model_dtype == "bf16"


# ------------------------------------------------------------------ kvcache-exporter kv-math

def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_explicit_numbers_human_output(capsys):
    code, out, err = run(
        capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
        "--seq-len", "8192", "--budget", "32GiB",
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "model: 32 layers: 32 full attention; 8 KV heads x head dim 128; model dtype bf16",
        "KV cache dtype: bf16 (2 B per element)",
        "bytes per token: 131072 (128 KiB)",
        "bytes per sequence of 8192 tokens: 1073741824 (1 GiB)",
        "sequences of 8192 tokens in 32 GiB: 32",
    ]


def test_cli_offload_tier_in_tokens_and_sequences(capsys):
    # Llama-3.1-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131072 B per token; 8 GiB / 131072 = 65536
    # tokens = 8 sequences of 8192. In fp8 over TP 2, 100 GB / 65536 B = 1525878.90625: 1525878 tokens.
    code, out, err = run(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
                         "--seq-len", "8192", "--offload-size", "8GiB")
    assert (code, err) == (0, "")
    assert out.splitlines()[-2:] == ["offload tier of 8 GiB: 65536 tokens",
                                     "sequences of 8192 tokens in the offload tier: 8"]
    code, out, _ = run(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp8",
                       "--tp", "2", "--offload-size", "100GB", "--json")
    report = json.loads(out)
    assert (code, report["offload_bytes"], report["offload_tokens"]) == (0, 100 * 10**9, 1525878)
    assert report["sequences_in_offload"] is None  # no --seq-len


def test_cli_json_output_numbers(capsys):
    code, out, err = run(
        capsys, "--config-json", str(MODELS / "llama-3-70b"), "--tp", "4", "--seq-len", "8192",
        "--budget", "40GiB", "--capacity-tokens", "100000", "--json",
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["bytes_per_token"] == 327680
    assert report["bytes_per_token_per_gpu"] == 81920
    assert report["bytes_per_sequence"] == 2684354560
    assert report["bytes_per_sequence_per_gpu"] == 671088640
    assert report["budget_bytes_per_gpu"] == 40 * GiB
    assert report["sequences_in_budget"] == 64
    assert report["sequences_in_capacity"] == 12
    assert report["kv_cache_dtype"] == "bf16" and report["bytes_per_element"] == 2
    assert report["layout"]["kv_heads"] == 8 and report["recurrent_state_bytes_per_sequence"] == 0


def test_cli_hybrid_fp8_per_gpu_state(capsys):
    code, out, _ = run(
        capsys, "--config-json", str(MODELS / "jamba-v0.1"), "--dtype", "fp8", "--tp", "2",
        "--seq-len", "262144", "--json",
    )
    report = json.loads(out)
    assert code == 0
    assert report["bytes_per_sequence"] == 2 * GiB
    assert report["bytes_per_sequence_per_gpu"] == GiB
    assert report["recurrent_state_bytes_per_sequence"] == 8_716_288
    assert report["recurrent_state_bytes_per_sequence_per_gpu"] == 4_358_144
    code, out, _ = run(capsys, "--config-json", str(MODELS / "jamba-v0.1"), "--tp", "2")
    assert "recurrent state per sequence per GPU at TP 2: 4358144 (4.16 MiB)" in out.splitlines()


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --config-json PATH, or the model's numbers"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--layers", "x"], "argument --layers: must be an integer >= 1, got 'x'"),
        (["--layers", "32", "--head-dim", "128"], "--kv-heads: missing, and no attention_heads to default to"),
        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--tp", "3"],
         "--tp: 8 KV heads cannot be split evenly over 3 ranks"),
        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp4"], "--dtype: unknown dtype 'fp4'"),
        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--budget", "3XB"], "argument --budget: not a size"),
        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--budget", "3GB"], "--budget needs --seq-len"),
        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--capacity-tokens", "5", "--target", "http://x"],
         "argument --target: not allowed with argument --capacity-tokens"),
        (["--config-json", "/nonexistent/config.json"], "--config-json: cannot read /nonexistent/config.json"),
        (["--config-json", str(MODELS / "gemma-2b"), "--layers", "3"], "--config-json cannot be combined with --layers"),
        (["--config-json", str(MODELS / "nemotron-h-8b"), "--tp", "3"], "--tp: 8 KV heads cannot be split evenly"),
        (["--config-json", str(MODELS / "gemma-2b"), "--model-dtype", "fp64"], "--model-dtype: unknown dtype 'fp64'"),
        (["--layers", "4", "--kv-heads", "1", "--head-dim", "8", "--sliding-window-layers", "2"],
         "--sliding-window: missing, but sliding_window_layers is set"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvcache-exporter kv-math: error: {message}")


def test_cli_bad_key_in_config_json_names_file_and_key(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_key_value_heads": 2}))
    code, _, err = run(capsys, "--config-json", str(path))
    assert code == 2
    assert err == f"kvcache-exporter kv-math: error: --config-json: {path}: head_dim: missing, and no hidden_size to derive it from\n"


def test_cli_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "--capacity-tokens" in out and "--config-json" in out


def test_cli_reads_a_live_targets_capacity(capsys):
    """`--target`: the capacity a running engine reports (vllm-v1 fixture: 29126 blocks x 16 tokens)."""
    from devtools.harness import PageServer, page

    fixture = harness.FIXTURES / "vllm-v1.txt"
    with PageServer({"/metrics": page(fixture.read_text())}) as server:
        args = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "8192", "--json"]
        assert main(args + ["--target", server.url("/metrics")]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["capacity_tokens"] == 466016
        assert answer["sequences_in_capacity"] == 466016 // 8192 == 56
        assert main(args + ["--target", server.url("/missing")]) == 1
        failed = capsys.readouterr()
        assert failed.out == ""
        assert failed.err.strip().endswith("poll failed (http_status)")
        assert failed.err.count("\n") == 1


def test_the_docs_examples_run_as_written_from_the_repository(monkeypatch, capsys):
    """docs/kv-math.md's `$ kvcache-exporter kv-math ...` lines, run from a checkout, print what follows them."""
    import re
    import shlex

    text = (harness.REPO / "docs" / "kv-math.md").read_text()
    examples = re.findall(r"^\$ kvcache-exporter kv-math (.*)\n((?:[^$`\n].*\n)+)", text, re.MULTILINE)
    assert len(examples) == 3
    monkeypatch.chdir(harness.REPO)
    for argv, printed in examples:
        assert main(shlex.split(argv)) == 0, argv
        assert capsys.readouterr().out == printed, argv
