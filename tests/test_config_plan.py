"""ModelConfig.from_hf, InferenceConfig validation, make_plan, JSON (de)serialization, sampling."""

import json
import warnings

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from neuronfx.config import (
    InferenceConfig,
    KVLayout,
    ModelConfig,
    RopeScaling,
    TensorSpec,
    make_plan,
    plan_from_json,
    plan_to_json,
    structure,
    unstructure,
)
from neuronfx.config.extras import Gemma3Extras, GraniteExtras, Llama4Extras
from neuronfx.config.serialization import plan_from_dict, plan_to_dict
from neuronfx.errors import ConfigError, UnsupportedModelError

TINY = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)


def tiny_model(**overrides) -> ModelConfig:
    fields = dict(model_type="llama", vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5)
    fields.update(overrides)
    return ModelConfig(**fields)


# ---------------------------------------------------------------------------------------------
# ModelConfig.from_hf
# ---------------------------------------------------------------------------------------------


def test_from_hf_llama():
    hf = LlamaConfig(**TINY, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=1024,
                     tie_word_embeddings=True, eos_token_id=2)
    m = ModelConfig.from_hf(hf)
    assert m == ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=50000.0, rope_scaling=None,
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        max_position_embeddings=1024, sliding_window=None, eos_token_ids=(2,),
    )


def test_from_hf_llama3_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072)
    m = ModelConfig.from_hf(hf)
    assert m.rope_theta == 500000.0
    assert m.rope_scaling == RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)
    assert m.max_position_embeddings == 131072


def test_from_hf_linear_rope_scaling_uses_defaults_for_missing_keys():
    hf = LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    m = ModelConfig.from_hf(hf)
    assert m.rope_scaling is not None
    assert (m.rope_scaling.rope_type, m.rope_scaling.factor) == ("linear", 2.0)


def test_from_hf_mistral_keeps_sliding_window():
    hf = MistralConfig(**TINY, sliding_window=4096)
    m = ModelConfig.from_hf(hf)
    assert (m.model_type, m.sliding_window, m.attention_bias, m.qk_norm, m.head_dim) == ("mistral", 4096, False, False, 16)


def test_from_hf_qwen2_has_attention_bias_and_ignores_unused_sliding_window():
    hf = Qwen2Config(**TINY, use_sliding_window=False, sliding_window=64)
    m = ModelConfig.from_hf(hf)
    assert m.model_type == "qwen2"
    assert m.attention_bias is True  # qwen2 always has q/k/v biases
    assert m.qk_norm is False
    assert m.sliding_window is None  # only used when use_sliding_window is set
    assert m.head_dim == 16


def test_from_hf_qwen3_explicit_head_dim_and_qk_norm():
    # head_dim 32 != hidden_size / num_attention_heads = 16: the explicit field must win.
    hf = Qwen3Config(**TINY, head_dim=32, attention_bias=False, tie_word_embeddings=True)
    m = ModelConfig.from_hf(hf)
    assert (m.model_type, m.head_dim, m.qk_norm, m.attention_bias) == ("qwen3", 32, True, False)
    assert m.tie_word_embeddings is True


def test_from_hf_eos_ids_prefer_generation_config():
    hf = LlamaConfig(**TINY, eos_token_id=2)
    assert ModelConfig.from_hf(hf).eos_token_ids == (2,)
    assert ModelConfig.from_hf(hf, GenerationConfig(eos_token_id=[128001, 128009])).eos_token_ids == (128001, 128009)
    assert ModelConfig.from_hf(hf, GenerationConfig()).eos_token_ids == (2,)  # falls back to the config
    assert ModelConfig.from_hf(LlamaConfig(**TINY, eos_token_id=None)).eos_token_ids == ()


def test_from_hf_unsupported_model_type():
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        ModelConfig.from_hf(GPT2Config(n_layer=1, n_head=2, n_embd=8))


def test_from_hf_unsupported_activation_and_rope():
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(LlamaConfig(**TINY, hidden_act="gelu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = LlamaConfig(**TINY, rope_scaling={"rope_type": "proportional", "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="rope_type='proportional'"):
        ModelConfig.from_hf(hf)


def test_heads_not_divisible_by_kv_heads():
    hf = LlamaConfig(vocab_size=100, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                     num_key_value_heads=4, intermediate_size=96)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf(hf)
    assert "num_key_value_heads=4" in str(info.value)
    assert "num_attention_heads=6" in str(info.value)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=3 must divide num_attention_heads=4"):
        tiny_model(num_key_value_heads=3)


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("head_dim", -1), ("model_type", "gpt2"),
                                          ("rope_theta", 0.0), ("rms_norm_eps", -1.0)])
def test_model_config_field_validators(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_model(**{field: value})


# ---------------------------------------------------------------------------------------------
# InferenceConfig
# ---------------------------------------------------------------------------------------------


def test_inference_defaults_are_valid():
    inf = InferenceConfig()
    assert (inf.batch_size, inf.max_context_length, inf.sequence_length) == (1, 256, 512)
    assert inf.prefill_buckets is None and inf.decode_buckets is None


def test_inference_converts_bucket_lists_to_tuples():
    inf = InferenceConfig(prefill_buckets=[64, 256], decode_buckets=[512])
    assert inf.prefill_buckets == (64, 256) and inf.decode_buckets == (512,)


@pytest.mark.parametrize("field, limit_field, buckets", [
    ("prefill_buckets", "max_context_length=256", (64, 128)),
    ("decode_buckets", "sequence_length=512", (256,)),
])
def test_inference_buckets_must_reach_limit(field, limit_field, buckets):
    # A prompt of 200 tokens passes max_context_length=256 but would find no bucket in (64, 128).
    with pytest.raises(ConfigError) as e:
        InferenceConfig(**{field: buckets})
    assert field in str(e.value) and limit_field in str(e.value) and str(buckets[-1]) in str(e.value)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(max_context_length=1024, sequence_length=512), ["max_context_length=1024", "sequence_length=512"]),
        (dict(prefill_buckets=(128, 512)), ["prefill_buckets", "512", "max_context_length=256"]),
        (dict(decode_buckets=(128, 1024)), ["decode_buckets", "1024", "sequence_length=512"]),
        (dict(prefill_buckets=(128, 257)), ["prefill_buckets", "257", "max_context_length=256"]),  # limit + 1
        (dict(decode_buckets=(513,)), ["decode_buckets", "513", "sequence_length=512"]),
        (dict(prefill_buckets=(256, 128)), ["prefill_buckets=(256, 128)", "strictly increasing"]),
        (dict(decode_buckets=(128, 128)), ["decode_buckets=(128, 128)", "strictly increasing"]),
        (dict(prefill_buckets=()), ["prefill_buckets=()"]),
        (dict(decode_buckets=(0, 128)), ["decode_buckets", "0"]),
        (dict(decode_buckets=(128.0,)), ["decode_buckets", "128.0"]),
        (dict(prefill_buckets=(True, 128)), ["prefill_buckets", "True"]),
        (dict(on_device_sampling=False, output_logits=False), ["on_device_sampling=False", "output_logits=False"]),
    ],
)
def test_inference_cross_field_errors(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        InferenceConfig(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("max_topk", -1), ("dtype", "int8"), ("backend", "cuda"),
                                          ("sequence_length", "512"), ("enable_bucketing", 1)])
def test_inference_field_validators(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        InferenceConfig(**{field: value})


def test_inference_limits_inclusive():
    # A bucket equal to its limit and max_context_length == sequence_length are fine.
    inf = InferenceConfig(max_context_length=512, sequence_length=512, prefill_buckets=(512,), decode_buckets=(512,))
    assert inf.prefill_buckets == (512,)
    assert InferenceConfig(on_device_sampling=False, output_logits=True).output_logits


# ---------------------------------------------------------------------------------------------
# make_plan
# ---------------------------------------------------------------------------------------------

SAMPLER_INPUTS = ("sampling_params", "output_counts", "prompt_mask", "logits_bias", "rand", "token_bitmask")
PREFILL_INPUTS = ("input_ids", "position_ids", "seq_ids", "block_table", "prompt_lens", *SAMPLER_INPUTS)
DECODE_INPUTS = ("input_ids", "position_ids", "seq_ids", "block_table", *SAMPLER_INPUTS)
GREEDY_INPUTS = DECODE_INPUTS[:4]  # the argmax twin reads no sampler


def test_make_plan_defaults():
    plan = make_plan(tiny_model(), InferenceConfig(batch_size=3, dtype="bfloat16", max_topk=4096))
    assert plan.prefill_buckets == (128, 256)
    assert plan.decode_buckets == (128, 256, 512)
    assert plan.batch_buckets == (1, 2, 3)
    assert [g.key for g in plan.graphs] == [
        ("prefill", b, k) for b in (1, 2, 3) for k in (128, 256)
    ] + [(phase, b, k) for phase in ("decode", "greedy") for b in (1, 2, 3) for k in (128, 256, 512)]
    assert plan.kv == KVLayout(num_layers=3, num_slots=4, num_kv_heads=2, sequence_length=512, head_dim=16,
                               dtype="bfloat16")
    assert plan.kv.scratch_slot == 3
    assert plan.topk_width == 1000  # min(max_topk=4096, vocab_size=1000)
    assert plan.checkpoint is None

    sampler = (
        TensorSpec("sampling_params", (3, 7), "float32"),
        TensorSpec("output_counts", (3, 1000), "int32"),
        TensorSpec("prompt_mask", (3, 1000), "bool"),
        TensorSpec("logits_bias", (3, 1000), "float32"),
        TensorSpec("rand", (3,), "float32"),
        TensorSpec("token_bitmask", (3, 32), "int32"),  # ceil(1000 / 32) words
    )
    prefill = plan.graph("prefill", 3, 256)
    assert (prefill.phase, prefill.bucket, prefill.batch_size) == ("prefill", 256, 3)
    assert prefill.inputs == (
        TensorSpec("input_ids", (3, 256), "int32"),
        TensorSpec("position_ids", (3, 256), "int32"),
        TensorSpec("seq_ids", (3,), "int32"),
        TensorSpec("block_table", (3, 1), "int32"),  # the slots layout: one block, the slot
        TensorSpec("prompt_lens", (3,), "int32"),
    ) + sampler
    decode = plan.graph("decode", 3, 512)
    assert decode.inputs == (
        TensorSpec("input_ids", (3, 1), "int32"),
        TensorSpec("position_ids", (3, 1), "int32"),
        TensorSpec("seq_ids", (3,), "int32"),
        TensorSpec("block_table", (3, 1), "int32"),
    ) + sampler
    assert plan.graph("decode", 1, 128).inputs[0] == TensorSpec("input_ids", (1, 1), "int32")
    with pytest.raises(KeyError, match="decode graph for batch size 3 and bucket 300"):
        plan.graph("decode", 3, 300)
    with pytest.raises(KeyError):
        plan.graph("speculate", 3, 128)


def test_make_plan_topk_width_capped_by_max_topk():
    assert make_plan(tiny_model(vocab_size=50000), InferenceConfig(max_topk=64)).topk_width == 64


def test_make_plan_without_bucketing_has_one_bucket_per_phase():
    plan = make_plan(tiny_model(), InferenceConfig(enable_bucketing=False, max_context_length=300,
                                                   sequence_length=1000))
    assert (plan.prefill_buckets, plan.decode_buckets) == ((300,), (1000,))
    assert [g.key for g in plan.graphs] == [("prefill", 1, 300), ("decode", 1, 1000), ("greedy", 1, 1000)]


def test_batch_buckets_derived_explicit_and_unbucketed():
    assert make_plan(tiny_model(), InferenceConfig(batch_size=8)).batch_buckets == (1, 2, 4, 8)
    assert make_plan(tiny_model(), InferenceConfig(batch_size=6)).batch_buckets == (1, 2, 4, 6)
    assert make_plan(tiny_model(), InferenceConfig(batch_size=6, enable_bucketing=False)).batch_buckets == (6,)
    assert make_plan(tiny_model(), InferenceConfig(batch_size=6, batch_buckets=(2, 6))).batch_buckets == (2, 6)
    with pytest.raises(ConfigError, match="batch_buckets ends at 4 < batch_size=6"):
        InferenceConfig(batch_size=6, batch_buckets=(2, 4))
    with pytest.raises(ConfigError, match="batch_buckets"):
        InferenceConfig(batch_size=6, batch_buckets=(4, 2, 6))


@pytest.mark.parametrize("enable_bucketing", [True, False])
def test_make_plan_explicit_buckets_win(enable_bucketing):
    inf = InferenceConfig(enable_bucketing=enable_bucketing, max_context_length=1024, sequence_length=2048,
                          prefill_buckets=(100, 1024), decode_buckets=(2048,))
    plan = make_plan(tiny_model(), inf)
    assert (plan.prefill_buckets, plan.decode_buckets) == ((100, 1024), (2048,))


def test_make_plan_one_explicit_list_other_derived():
    plan = make_plan(tiny_model(), InferenceConfig(max_context_length=1000, sequence_length=2000,
                                                   decode_buckets=(64, 2000)))
    assert plan.prefill_buckets == (128, 256, 512, 1000)
    assert plan.decode_buckets == (64, 2000)


def test_make_plan_small_limits_below_min_bucket():
    plan = make_plan(tiny_model(), InferenceConfig(max_context_length=16, sequence_length=100))
    assert (plan.prefill_buckets, plan.decode_buckets) == ((16,), (100,))


def test_make_plan_accepts_windows_shorter_than_the_cache():
    # Sliding layers are masked to their window (config.masks), so any window plans.
    plan = make_plan(tiny_model(sliding_window=16, layer_types=("sliding_attention",) * 3), InferenceConfig(sequence_length=512))
    assert plan.kv.sequence_length == 512
    mistral = ModelConfig.from_hf(MistralConfig(**TINY, sliding_window=64))
    assert mistral.layer_types == ("sliding_attention",) * TINY["num_hidden_layers"]


def test_layer_types_are_checked():
    with pytest.raises(ConfigError, match="layer_types has 1 entries for num_hidden_layers=3"):
        tiny_model(layer_types=("full_attention",))
    with pytest.raises(ConfigError, match="'sliding_attention' layers but sliding_window is None"):
        tiny_model(layer_types=("full_attention", "sliding_attention", "full_attention"))
    with pytest.raises(UnsupportedModelError, match=r"layer_types \['linear_attention'\] are not supported"):
        tiny_model(layer_types=("full_attention", "linear_attention", "full_attention"))
    with pytest.raises(ConfigError, match="rope_layers has 2 entries"):
        tiny_model(rope_layers=(True, False))


# ---------------------------------------------------------------------------------------------
# Strategies: valid configs
# ---------------------------------------------------------------------------------------------


@st.composite
def bucket_lists(draw, limit):
    # The largest explicit bucket must equal its limit (see test_inference_buckets_must_reach_limit).
    return draw(st.none() | st.lists(st.integers(1, max(1, limit - 1)), max_size=5, unique=True)
                .map(lambda xs: tuple(sorted(set(xs) - {limit})) + (limit,)))


@st.composite
def inference_configs(draw):
    seq = draw(st.integers(min_value=1, max_value=8192))
    ctx = draw(st.integers(min_value=1, max_value=seq))
    on_device = draw(st.booleans())
    return InferenceConfig(
        batch_size=draw(st.integers(1, 64)),
        max_context_length=ctx,
        sequence_length=seq,
        enable_bucketing=draw(st.booleans()),
        prefill_buckets=draw(bucket_lists(ctx)),
        decode_buckets=draw(bucket_lists(seq)),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        on_device_sampling=on_device,
        max_topk=draw(st.integers(1, 1 << 17)),
        output_logits=True if not on_device else draw(st.booleans()),
        greedy_graphs=draw(st.booleans()),
        backend=draw(st.sampled_from(["eager", "export", "neuron"])),
    )


model_configs = st.builds(
    tiny_model,
    model_type=st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]),
    vocab_size=st.integers(1, 200000),
    rope_theta=st.floats(1.0, 1e7, allow_nan=False),
    rope_scaling=st.none() | st.builds(RopeScaling, rope_type=st.sampled_from(["linear", "llama3"]),
                                       factor=st.floats(0.5, 64.0), low_freq_factor=st.floats(0.5, 2.0),
                                       high_freq_factor=st.floats(2.0, 8.0),
                                       original_max_position_embeddings=st.integers(1, 1 << 17)),
    rms_norm_eps=st.floats(1e-8, 1e-3),
    tie_word_embeddings=st.booleans(),
    attention_bias=st.booleans(),
    qk_norm=st.booleans(),
    eos_token_ids=st.lists(st.integers(0, 200000), max_size=3).map(tuple),
)


@given(inference_configs())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_make_plan_invariants(inf):
    plan = make_plan(tiny_model(), inf)
    for ladder, limit, explicit in ((plan.prefill_buckets, inf.max_context_length, inf.prefill_buckets),
                                    (plan.decode_buckets, inf.sequence_length, inf.decode_buckets)):
        assert all(a < b for a, b in zip(ladder, ladder[1:]))
        assert ladder[-1] <= limit
        if explicit is not None:
            assert ladder == explicit
        else:
            assert ladder[-1] == limit  # derived ladders cover the whole limit
            assert len(ladder) == 1 or inf.enable_bucketing
    assert plan.batch_buckets[-1] == inf.batch_size
    greedy = inf.on_device_sampling and inf.greedy_graphs  # greedy graphs over the decode buckets
    assert len(plan.graphs) == len(plan.batch_buckets) * (len(plan.prefill_buckets) + (1 + greedy) * len(plan.decode_buckets))
    assert {g.key[1:] for g in plan.graphs if g.phase == "greedy"} == ({g.key[1:] for g in plan.graphs if g.phase == "decode"}
                                                                       if greedy else set())
    assert len({g.key for g in plan.graphs}) == len(plan.graphs)
    for g in plan.graphs:
        names = tuple(t.name for t in g.inputs)
        n = g.bucket if g.phase == "prefill" else 1
        assert names == {"prefill": PREFILL_INPUTS, "greedy": GREEDY_INPUTS}.get(g.phase, DECODE_INPUTS)
        assert g.inputs[0].shape == g.inputs[1].shape == (g.batch_size, n)
        assert g.batch_size in plan.batch_buckets
        assert plan.graph(g.phase, g.batch_size, g.bucket) is g
    assert plan.kv.shape == (inf.batch_size + 1, 2, inf.sequence_length, 16)
    assert plan.kv.dtype == inf.dtype


# ---------------------------------------------------------------------------------------------
# Serialization
# ---------------------------------------------------------------------------------------------


@given(inference_configs(), model_configs, st.none() | st.text(max_size=20))
@example(InferenceConfig(), tiny_model(), None)
@example(InferenceConfig(max_context_length=1, prefill_buckets=(1,), decode_buckets=(1, 512)), tiny_model(eos_token_ids=(0,)), "/m.gguf")
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_plan_json_round_trip(inf, model, checkpoint):
    plan = make_plan(model, inf, checkpoint=checkpoint)
    text = plan_to_json(plan)
    back = plan_from_json(text)
    assert back == plan
    assert plan_to_json(back) == text  # stable text
    assert structure(unstructure(inf), InferenceConfig) == inf
    assert structure(unstructure(model), ModelConfig) == model


def _plan_dict() -> dict:
    model = tiny_model(rope_scaling=RopeScaling(rope_type="llama3", factor=8.0))
    return json.loads(plan_to_json(make_plan(model, InferenceConfig())))


@pytest.mark.parametrize(
    "path, cls_name",
    [((), "Plan"), (("inference",), "InferenceConfig"), (("model",), "ModelConfig"),
     (("model", "rope_scaling"), "ModelConfig")],
)
def test_unknown_key_is_an_error(path, cls_name):
    data = _plan_dict()
    target = data
    for key in path:
        target = target[key]
    target["max_batch_sizee"] = 4
    with pytest.raises(ConfigError) as info:
        plan_from_json(json.dumps(data))
    msg = str(info.value)
    assert "max_batch_sizee" in msg
    assert cls_name in msg
    if path == ("model", "rope_scaling"):
        assert "rope_scaling" in msg


def test_missing_and_malformed_input():
    data = _plan_dict()
    del data["model"]
    with pytest.raises(ConfigError, match="missing key 'model'"):
        plan_from_dict(data)
    with pytest.raises(ConfigError, match="does not parse"):
        plan_from_json("{not json")
    with pytest.raises(ConfigError, match="plan must be a JSON object"):
        plan_from_json("[1, 2]")
    data = _plan_dict()
    data["inference"] = [1]
    with pytest.raises(ConfigError, match="InferenceConfig must be a JSON object"):
        plan_from_dict(data)
    data = _plan_dict()
    del data["inference"]["batch_size"]  # fields with defaults may be omitted
    assert plan_from_dict(data).inference.batch_size == 1
    data = _plan_dict()
    del data["model"]["vocab_size"]  # required fields may not
    with pytest.raises(ConfigError, match="ModelConfig"):
        plan_from_dict(data)


@pytest.mark.parametrize(
    "section, key, value, needles",
    [
        ("inference", "sequence_length", 100, ["max_context_length=256", "sequence_length=100"]),
        ("inference", "decode_buckets", [512, 128], ["decode_buckets=(512, 128)"]),
        ("inference", "batch_size", 0, ["batch_size", "0"]),
        ("inference", "dtype", "int8", ["dtype", "int8"]),
        # cattrs would coerce these silently ("false" -> True, 2.7 -> 2); they must be errors.
        ("inference", "enable_bucketing", "false", ["enable_bucketing", "'false'"]),
        ("inference", "batch_size", 2.7, ["batch_size", "2.7"]),
        ("inference", "batch_size", "3", ["batch_size", "'3'"]),
        ("inference", "prefill_buckets", [128, 256.5], ["prefill_buckets", "256.5"]),
        ("model", "eos_token_ids", [1, "2"], ["eos_token_ids", "'2'"]),
        ("model", "num_key_value_heads", 3, ["num_key_value_heads=3", "num_attention_heads=4"]),
        ("model", "model_type", "gpt2", ["model_type", "gpt2"]),
    ],
)
def test_bad_values_from_json(section, key, value, needles):
    data = _plan_dict()
    data[section][key] = value
    with pytest.raises(ConfigError) as info:
        plan_from_dict(data)
    for needle in needles:
        assert needle in str(info.value)


def test_json_ints_accepted_for_float_fields():
    data = _plan_dict()
    data["model"]["rope_theta"] = 500000
    assert plan_from_dict(data).model.rope_theta == 500000.0


EXTRAS = {
    "granite": GraniteExtras(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0),
    "gemma3_text": Gemma3Extras(query_pre_attn_scalar=256.0, final_logit_softcapping=30.0),
    "llama4_text": Llama4Extras(qk_l2_norm=True, attn_temperature_tuning=True, floor_scale=4096.0, attn_scale=0.2),
}
FAMILY_FIELDS = {"granite": {}, "gemma3_text": {"hidden_act": "gelu_pytorch_tanh"},
                 "llama4_text": {"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32}}


@pytest.mark.parametrize("model_type", sorted(EXTRAS))
def test_family_extras_round_trip(model_type):
    """A family's extras record travels in the plan's JSON under model.extras, keyed by the
    family's own field names, and comes back as the same record; left out, it is the record's
    defaults (a ModelConfig built by hand gets them too)."""
    model = tiny_model(model_type=model_type, extras=EXTRAS[model_type], **FAMILY_FIELDS[model_type])
    plan = make_plan(model, InferenceConfig())
    text = plan_to_json(plan)
    data = json.loads(text)
    assert data["model"]["extras"] == unstructure(EXTRAS[model_type]) and plan_from_json(text) == plan
    del data["model"]["extras"]
    assert plan_from_dict(data).model.extras == type(EXTRAS[model_type])()
    assert tiny_model(model_type=model_type, **FAMILY_FIELDS[model_type]).extras == type(EXTRAS[model_type])()
    assert tiny_model().extras is None and json.loads(plan_to_json(make_plan(tiny_model(), InferenceConfig())))["model"]["extras"] is None


@pytest.mark.parametrize("model_type, extras, needles", [
    ("llama", GraniteExtras(), ["extras=GraniteExtras", "model_type='llama'", "must be None"]),
    ("granite", Gemma3Extras(), ["extras=Gemma3Extras", "must be a GraniteExtras"]),
    ("granite", None, ["extras=None", "must be a GraniteExtras"]),
])
def test_extras_of_another_family_are_an_error(model_type, extras, needles):
    with pytest.raises(ConfigError) as info:
        tiny_model(model_type=model_type, extras=extras)
    assert all(n in str(info.value) for n in needles), info.value


@pytest.mark.parametrize("model_type, extras, needles", [
    ("llama", {"logits_scaling": 2.0}, ["has no extras", "model_type='llama'"]),
    ("granite", {"logits_scalin": 2.0}, ["unknown key", "logits_scalin"]),
    ("granite", {"logits_scaling": -2.0}, ["GraniteExtras.logits_scaling=-2.0", "finite number > 0"]),
    ("gemma3_text", {"final_logit_softcapping": "30"}, ["final_logit_softcapping", "'30'"]),
])
def test_bad_extras_from_json(model_type, extras, needles):
    data = json.loads(plan_to_json(make_plan(tiny_model(model_type=model_type, **FAMILY_FIELDS.get(model_type, {})),
                                             InferenceConfig())))
    data["model"]["extras"] = extras
    with pytest.raises(ConfigError) as info:
        plan_from_dict(data)
    assert all(n in str(info.value) for n in needles), info.value


def test_plan_to_dict_holds_only_sources():
    plan = make_plan(tiny_model(), InferenceConfig(), checkpoint="ckpt")
    assert set(plan_to_dict(plan)) == {"model", "inference", "checkpoint", "rank"}
    assert plan_to_dict(plan)["inference"]["prefill_buckets"] is None


def test_layer_period_of_mixed_dense_and_moe_layers():
    from neuronfx.config.attention import layer_kinds, layer_period
    from neuronfx.graphs.backends.inductor_parts import layer_group_size

    moe = dict(model_type="llama4_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    m = tiny_model(**moe, num_hidden_layers=6, moe_layers=(1, 3, 5), dense_intermediate_size=96)
    assert layer_kinds(m) == ("dense", "moe") * 3
    assert layer_period(m, 6) == 2 and layer_period(m, 1) == 1  # a 1-layer draft repeats trivially
    assert layer_group_size(48, period=2) == 8 and layer_group_size(6, period=2) == 6 and layer_group_size(30) == 10
    assert layer_period(tiny_model(**moe, num_hidden_layers=6, moe_layers=(1, 2), dense_intermediate_size=96), 6) == 6
    assert layer_period(tiny_model(), 3) == 1
    with pytest.raises(ConfigError, match="moe_layers="):
        tiny_model(**moe, moe_layers=(3,), dense_intermediate_size=96)
