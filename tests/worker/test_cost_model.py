"""The roofline cost model: bounds, orders and memory arithmetic that any calibration must keep."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.worker.sim.cost_model import (
    ACTIVATION_RESERVE_BYTES,
    MAX_TP,
    CostModel,
    Efficiency,
    min_tp,
)
from sgl_fair.worker.sim.hardware import GPUS, MODELS, get_gpu, get_model

PERFECT = Efficiency(flops=1.0, bandwidth=1.0, attention_flops=1.0, step_overhead_s=0.0)


def _fitting_configs() -> list[tuple[str, str, int]]:
    """Every (GPU, model, tp) with a power-of-two tp from the smallest that fits up to MAX_TP."""
    configs = []
    for gpu_name, gpu in GPUS.items():
        for model_name, model in MODELS.items():
            tp = min_tp(gpu, model)
            assert tp is not None, f"{model_name} fits nowhere on {gpu_name}"
            while tp <= MAX_TP:
                if model.num_heads % tp == 0:
                    configs.append((gpu_name, model_name, tp))
                tp *= 2
    return configs


FITTING = _fitting_configs()
DEFAULT_MODELS = [CostModel.from_names(g, m) for g in GPUS for m in MODELS]
deterministic = settings(derandomize=True, max_examples=150, deadline=None)
cost_models = st.sampled_from(DEFAULT_MODELS)
lengths = st.integers(min_value=0, max_value=40_000)


# ---- specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS.values(), ids=list(MODELS))
def test_published_param_count_matches_architecture(model):
    assert model.num_params_from_architecture() == model.num_params


def test_known_kv_sizes():
    # Llama-2-7B: 32 layers x 32 KV heads x 128 x 2 (K, V) x 2 bytes; Llama-3.1-8B has 8 KV heads.
    assert CostModel.from_names("A100", "Llama-2-7B").kv_bytes_per_token == 512 * 1024
    assert CostModel.from_names("A100", "Llama-3.1-8B").kv_bytes_per_token == 128 * 1024


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("a10g", "A10G-24GB"), ("A100-80G", "A100-80GB"), ("h100-sxm", "H100-80GB"),
     ("H200-141GB", "H200"), ("h100-80gb", "H100-80GB")],
)  # fmt: skip
def test_gpu_aliases_case_insensitive(alias, canonical):
    assert get_gpu(alias).name == canonical


def test_model_lookup_by_name_and_hf_id():
    assert get_model("llama-3.1-8b").name == "Llama-3.1-8B"
    assert get_model("meta-llama/Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"
    assert get_model("MISTRAL-7B").name == "Mistral-7B"


@pytest.mark.parametrize(
    ("lookup", "table", "kind"), [(get_gpu, GPUS, "GPU"), (get_model, MODELS, "model")]
)
def test_unknown_name_raises_naming_the_choices(lookup, table, kind):
    with pytest.raises(ValueError) as info:
        lookup("TPU-v9")
    message = str(info.value)
    assert message.startswith(f"unknown {kind} 'TPU-v9'")
    assert "\n" not in message
    assert all(name in message for name in table)


def test_from_names_rejects_unknown_names():
    with pytest.raises(ValueError, match="choose one of"):
        CostModel.from_names("B200", "Llama-2-7B")
    with pytest.raises(ValueError, match="choose one of"):
        CostModel.from_names("H100", "GPT-5")


# ---- tensor parallelism and memory -------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["A100-80GB", "H100-80GB"])
def test_70b_needs_tp_on_80gb_parts(gpu):
    assert CostModel.from_names(gpu, "Llama-3-70B").tp > 1
    with pytest.raises(ValueError, match=r"Llama-3-70B does not fit on .* tp=1.*use tp=2"):
        CostModel.from_names(gpu, "Llama-3-70B", tp=1)


def test_small_models_pick_tp1():
    for gpu in GPUS:
        assert CostModel.from_names(gpu, "Llama-3.2-3B").tp == 1


def test_tp_must_divide_heads_and_be_positive():
    with pytest.raises(ValueError, match="does not divide"):
        CostModel.from_names("H100", "Llama-3.2-3B", tp=16)  # 24 heads
    with pytest.raises(ValueError, match="positive"):
        CostModel.from_names("H100", "Llama-3.2-3B", tp=0)


@pytest.mark.parametrize(("gpu", "model", "tp"), FITTING)
def test_kv_capacity_positive_and_within_memory(gpu, model, tp):
    cm = CostModel.from_names(gpu, model, tp=tp)
    capacity = cm.kv_capacity_tokens()
    assert capacity > 0
    per_gpu_budget = cm.gpu.mem_bytes * 0.88 - cm.weight_bytes / tp - ACTIVATION_RESERVE_BYTES
    assert capacity * cm.kv_bytes_per_token_per_gpu <= per_gpu_budget
    assert (capacity + 1) * cm.kv_bytes_per_token_per_gpu > per_gpu_budget
    assert cm.kv_capacity_tokens(0.80) < capacity


@pytest.mark.parametrize("model", list(MODELS))
def test_kv_capacity_orders(model):
    h100, h200 = CostModel.from_names("H100", model), CostModel.from_names("H200", model)
    same_tp_h200 = CostModel.from_names("H200", model, tp=h100.tp)
    assert same_tp_h200.kv_capacity_tokens() > h100.kv_capacity_tokens()
    assert h200.kv_capacity_tokens() > 0
    doubled = CostModel.from_names("H100", model, tp=2 * h100.tp)
    assert doubled.kv_capacity_tokens() > h100.kv_capacity_tokens()


def test_describe_is_a_json_report():
    report = CostModel.from_names("H100", "Llama-3-70B").describe()
    assert report["tp"] == 2 and report["gpu"] == "H100-80GB" and report["model"] == "Llama-3-70B"
    assert report["kv_capacity_tokens"] > 0
    assert set(report["efficiency"]) >= {"flops", "bandwidth", "attention_flops", "step_overhead_s"}
    json.dumps(report)


# ---- time: bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize(("gpu", "model", "tp"), FITTING)
@pytest.mark.parametrize("efficiency", [None, PERFECT], ids=["default", "perfect"])
def test_decode_never_beats_streaming_the_weights(gpu, model, tp, efficiency):
    cm = CostModel.from_names(gpu, model, tp=tp, efficiency=efficiency)
    floor = cm.weight_bytes / (tp * cm.gpu.mem_bw)
    for batch, context in [(1, 0), (1, 1), (8, 128), (256, 4096)]:
        assert cm.decode_time([context] * batch) >= floor


def test_perfect_efficiency_decode_is_the_memory_roofline():
    # One GPU, batch 1, no context: the step is exactly the weights streamed at peak bandwidth
    # plus writing one token's KV. Catches dropped or double-counted weight traffic.
    gpu, model = get_gpu("H100"), get_model("Llama-3.1-8B")
    cm = CostModel(gpu, model, efficiency=PERFECT)
    expected = (model.weight_bytes + cm.kv_bytes_per_token) / gpu.mem_bw
    assert cm.decode_time([0]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("context", [0, 16_384])
def test_perfect_efficiency_prefill_is_the_compute_roofline(context):
    gpu, model = get_gpu("A100"), get_model("Llama-2-7B")
    cm = CostModel(gpu, model, efficiency=PERFECT)
    new = 4096
    linear = 2 * model.num_nonembedding_params * new + 2 * model.num_lm_head_params
    attention = 4 * model.num_layers * model.q_size * new * (context + new / 2)  # causal
    assert cm.prefill_time([(new, context)]) == pytest.approx((linear + attention) / gpu.peak_flops)


def test_perfect_efficiency_huge_decode_batch_is_compute_bound():
    # Every decode runs all layers and one row of logits.
    gpu, model = get_gpu("A100"), get_model("Llama-2-7B")
    cm = CostModel(gpu, model, efficiency=PERFECT)
    batch = 8192
    linear = 2 * (model.num_nonembedding_params + model.num_lm_head_params) * batch
    kv_write_s = batch * cm.kv_bytes_per_token / gpu.mem_bw  # dominates attention to itself
    assert cm.decode_time([0] * batch) == pytest.approx(linear / gpu.peak_flops + kv_write_s)


def test_one_overhead_per_step_however_large():
    overhead = 0.01
    slow = Efficiency(flops=1.0, bandwidth=1.0, attention_flops=1.0, step_overhead_s=overhead)
    with_overhead = CostModel.from_names("H100", "Llama-3.1-8B", efficiency=slow)
    without = CostModel.from_names("H100", "Llama-3.1-8B", efficiency=PERFECT)
    for step in (
        {"decode_context_lens": [7]},
        {"decode_context_lens": [512] * 200},
        {"prefill_chunks": [(300, 0), (20, 4000), (1, 0)], "decode_context_lens": [9] * 50},
    ):
        extra = with_overhead.step_time(**step) - without.step_time(**step)
        assert extra == pytest.approx(overhead)


def test_context_costs_time():
    # Monotone is not enough: attention over a long context must actually be paid for.
    for cm in DEFAULT_MODELS:
        assert cm.prefill_time([(512, 0)]) < cm.prefill_time([(512, 32_000)])
        assert cm.decode_time([0] * 64) < cm.decode_time([32_000] * 64)


@pytest.mark.parametrize(("gpu", "tp"), [("A10G", 8), ("A100", 2), ("H100", 4), ("H200", 8)])
def test_tensor_parallel_all_reduces_are_paid(gpu, tp):
    # Batch-1 decode at perfect efficiency: the weight stream splits tp ways, but each of the
    # two all-reduces per layer still costs at least the link's latency.
    cm = CostModel.from_names(gpu, "Llama-3-70B", tp=tp, efficiency=PERFECT)
    streaming = (cm.weight_bytes / tp + cm.kv_bytes_per_token_per_gpu) / cm.gpu.mem_bw
    all_reduces = 2 * cm.model.num_layers * cm.gpu.allreduce_latency_s
    assert cm.decode_time([0]) >= streaming + all_reduces


def test_kv_heads_are_replicated_not_split_below_one():
    # Llama-3-70B has 8 KV heads: at tp=16 each GPU still holds one whole head.
    at_8 = CostModel.from_names("A100", "Llama-3-70B", tp=8)
    at_16 = CostModel.from_names("A100", "Llama-3-70B", tp=16)
    assert at_16.kv_bytes_per_token_per_gpu == at_8.kv_bytes_per_token_per_gpu
    assert (
        at_16.kv_bytes_per_token == at_8.kv_bytes_per_token == 8 * at_8.kv_bytes_per_token_per_gpu
    )


def test_empty_steps_cost_nothing():
    cm = CostModel.from_names("A10G", "Llama-2-7B")
    assert cm.step_time() == 0.0
    assert cm.prefill_time([]) == 0.0
    assert cm.decode_time([]) == 0.0


@given(cm=cost_models, context=lengths, decodes=st.lists(lengths, max_size=8))
@deterministic
def test_chunk_without_new_tokens_adds_nothing(cm, context, decodes):
    assert cm.prefill_time([(0, context)]) == cm.step_time() == 0.0
    with_idle_chunk = cm.step_time(prefill_chunks=[(0, context)], decode_context_lens=decodes)
    assert with_idle_chunk == cm.step_time(decode_context_lens=decodes)


@pytest.mark.parametrize("cm", DEFAULT_MODELS, ids=repr)
def test_cached_prefix_is_free_through_linear_layers(cm):
    # 1000 cached tokens cost only attention; recomputing them runs them through every GEMM.
    cached = cm.prefill_time([(100, 1000)])
    recomputed = cm.prefill_time([(1100, 0)])
    assert cached < 0.5 * recomputed


@given(cm=cost_models, context=lengths)
@deterministic
def test_decode_is_a_one_token_chunk(cm, context):
    assert cm.decode_time([context]) == cm.prefill_time([(1, context)])


@given(
    cm=cost_models,
    chunks=st.lists(st.tuples(st.integers(1, 4096), lengths), min_size=1, max_size=4),
    decodes=st.lists(lengths, min_size=1, max_size=64),
)
@deterministic
def test_mixed_step_shares_weights_and_overhead(cm, chunks, decodes):
    prefill, decode = cm.prefill_time(chunks), cm.decode_time(decodes)
    mixed = cm.step_time(prefill_chunks=chunks, decode_context_lens=decodes)
    assert max(prefill, decode) <= mixed
    assert mixed <= prefill + decode - cm.efficiency.step_overhead_s


@pytest.mark.parametrize(("gpu", "tp"), [("A100", 2), ("A100", 4), ("H100", 2), ("H100", 4)])
def test_doubling_tp_helps_but_at_most_halves_a_step(gpu, tp):
    narrow = CostModel.from_names(gpu, "Llama-3-70B", tp=tp)
    wide = CostModel.from_names(gpu, "Llama-3-70B", tp=2 * tp)
    for step in ({"decode_context_lens": [1024] * 32}, {"prefill_chunks": [(2048, 0)]}):
        assert 0.5 * narrow.step_time(**step) < wide.step_time(**step) < narrow.step_time(**step)


# ---- time: monotonicity ----------------------------------------------------------------------


@given(cm=cost_models, new=st.integers(0, 32_768), extra=st.integers(1, 4096), context=lengths)
@deterministic
def test_prefill_monotone_in_new_tokens(cm, new, extra, context):
    assert cm.prefill_time([(new, context)]) <= cm.prefill_time([(new + extra, context)])


@given(cm=cost_models, new=st.integers(0, 8192), context=lengths, extra=st.integers(1, 40_000))
@deterministic
def test_prefill_monotone_in_context(cm, new, context, extra):
    assert cm.prefill_time([(new, context)]) <= cm.prefill_time([(new, context + extra)])


@given(cm=cost_models, contexts=st.lists(lengths, max_size=256), added=lengths)
@deterministic
def test_decode_monotone_in_batch_size(cm, contexts, added):
    assert cm.decode_time(contexts) <= cm.decode_time([*contexts, added])


@given(
    cm=cost_models,
    contexts=st.lists(lengths, min_size=1, max_size=256),
    index=st.integers(0, 255),
    extra=st.integers(1, 40_000),
)
@deterministic
def test_decode_monotone_in_context(cm, contexts, index, extra):
    longer = list(contexts)
    longer[index % len(longer)] += extra
    assert cm.decode_time(contexts) <= cm.decode_time(longer)


def test_efficiency_rejects_out_of_range_factors():
    with pytest.raises(ValueError, match="bandwidth"):
        Efficiency(flops=0.6, bandwidth=1.2, attention_flops=0.5, step_overhead_s=1e-3)
    with pytest.raises(ValueError, match="step_overhead_s"):
        Efficiency(flops=0.6, bandwidth=0.8, attention_flops=0.5, step_overhead_s=-1.0)
