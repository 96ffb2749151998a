"""The planner's throughput terms on hand-computed cases: compute with recompute, each
collective's bytes over the link its ranks use, the overlap rule, the hardware table, and what
of the cross-group sum replica groups leave exposed."""

import pytest

from kiln.config import JobConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.metrics.mfu import PEAK_BF16_FLOPS
from kiln.model import count_params, flops_per_token
from kiln.plan.fault_tolerance import FailureInputs, as_dict, fault_tolerance
from kiln.plan.hardware import (
    COMPUTE_EFFICIENCY,
    GPUS,
    NETWORK_EFFICIENCY,
    NVLINK_EFFICIENCY,
    find_gpu,
    make_cluster,
)
from kiln.plan.search import evaluate
from kiln.plan.throughput import (
    compute_seconds,
    cp_exposed_seconds,
    cp_seconds,
    ep_seconds,
    fsdp_seconds,
    pp_seconds,
    recompute_factor,
    span,
    step_time,
    tp_seconds,
)

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
H100 = find_gpu("h100")
NVLINK = 450e9 * NVLINK_EFFICIENCY
NETWORK = 50e9 * NETWORK_EFFICIENCY


def job(ac: str = "full", **train) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden_dim=1024
        )
    )
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.activation_checkpointing = 1024, 2, ac
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_the_peaks_are_the_mfu_table_s():
    names = {"h100": "H100 SXM", "h200": "H200", "a100": "A100", "b200": "B200"}
    for key, gpu in GPUS.items():
        assert gpu.peak_flops == PEAK_BF16_FLOPS[names[key]]


def test_compute_is_the_honest_flops_plus_the_recompute_at_the_achievable_rate():
    cfg = job("full", grad_accum_steps=3)
    cluster = make_cluster(H100, 8, 8)
    assert recompute_factor(cfg, ONE) == pytest.approx(4 / 3)
    assert recompute_factor(job("selective"), ONE) == pytest.approx(1 + 4 / 8 / 3)
    assert recompute_factor(job("none"), ONE) == 1
    tokens = 3 * 2 * 1024
    flops = tokens * flops_per_token(cfg.model, 1024) * 4 / 3
    expected = flops / (989e12 * COMPUTE_EFFICIENCY)
    assert compute_seconds(cfg, ONE, cluster) == pytest.approx(expected)
    # tp, cp and pp ranks share a data rank's work.
    split = {**ONE, "tp": 2, "cp": 2, "pp": 2}
    assert compute_seconds(cfg, split, cluster) == pytest.approx(expected / 8)


def test_a_collective_runs_on_nvlink_inside_a_node_and_on_the_network_across():
    cluster = make_cluster(H100, 16, 8)
    layout = {**ONE, "dp_shard": 4, "tp": 2, "pp": 2}
    assert span(layout, "tp") == 2 and span(layout, "dp_shard") == 8 and span(layout, "pp") == 16
    assert cluster.bandwidth(8) == NVLINK and cluster.bandwidth(16) == NETWORK


def test_fsdp_gathers_bf16_weights_twice_and_reduces_fp32_gradients_each_micro_batch():
    cfg = job("full", grad_accum_steps=2)
    params = count_params(cfg.model).total
    layout = {**ONE, "dp_shard": 4}
    seconds = fsdp_seconds(cfg, layout, make_cluster(H100, 4, 8))
    share = params * 3 / 4  # a ring sends (n − 1)/n of the whole
    assert seconds["fsdp_all_gather"] == pytest.approx(2 * 2 * 2 * share / NVLINK)
    assert seconds["fsdp_reduce_scatter"] == pytest.approx(2 * 4 * share / NVLINK)
    # Over two nodes of two GPUs: the network's rate.
    across = fsdp_seconds(cfg, layout, make_cluster(H100, 4, 2))
    assert across["fsdp_reduce_scatter"] == pytest.approx(2 * 4 * share / NETWORK)
    # HSDP: the shards are all-reduced across the replicas.
    hsdp = fsdp_seconds(cfg, {**ONE, "dp_shard": 2, "dp_replicate": 2}, make_cluster(H100, 4, 8))
    assert hsdp["hsdp_all_reduce"] == pytest.approx(2 * 2 * 4 * params / 2 / 2 / NVLINK)
    assert fsdp_seconds(cfg, ONE, make_cluster(H100, 1, 8)) == {}


def test_tensor_parallel_moves_the_residual_stream_four_times_a_layer_each_pass():
    cfg = job("full")
    cluster = make_cluster(H100, 2, 8)
    # 8 layers × 4 collectives × (forward, backward, recompute) + the embeddings' and head's 4,
    # each half of 2048 tokens × 512 × 2 bytes.
    collectives = 8 * 4 * 3 + 4
    expected = collectives * 2048 * 512 * 2 / 2 / NVLINK
    assert tp_seconds(cfg, {**ONE, "tp": 2}, cluster) == pytest.approx(expected)
    assert tp_seconds(cfg, ONE, cluster) == 0


def test_context_parallel_gathers_keys_and_values_each_layer_and_pass():
    cfg = job("none")
    cluster = make_cluster(H100, 4, 8)
    # 2 sequences × 1024 tokens, k and v of 512, bf16: 3/4 of it arrives, 8 layers, 2 passes.
    whole = 2 * 2 * 512 * 2048
    expected = whole * 3 / 4 * 8 * 2 / NVLINK
    assert cp_seconds(cfg, {**ONE, "cp": 4}, cluster) == pytest.approx(expected)


def test_the_ring_hides_its_sends_behind_each_block_s_attention_and_recomputes_it():
    cfg = job("none")
    cfg.distributed.cp_mode = "ring"
    cp4, cluster = {**ONE, "cp": 4}, make_cluster(H100, 4, 8)
    # Each of 8 layers: 3 sends of a 1 MiB block (512 tokens × k and v of 512, bf16) forward;
    # backward 3 again and 4 of its fp32 gradient (2 MiB).
    block = 2**20 / NVLINK
    assert cp_seconds(cfg, cp4, cluster) == pytest.approx(8 * (3 + 3 + 4 * 2) * block)
    # Causal attention forward, per token and layer: 1024 keys / 2 × 8 heads × (64 + 64) × 2.
    forward = 1024 * 8 * 128
    # Its backward runs each block's attention forward again: 8 layers more per token.
    ring = compute_seconds(cfg, cp4, cluster)
    cfg.distributed.cp_mode = "all_gather"
    extra = 2048 * 8 * forward / 4 / (989e12 * COMPUTE_EFFICIENCY)
    assert ring == pytest.approx(compute_seconds(cfg, cp4, cluster) + extra)
    cfg.distributed.cp_mode = "ring"
    # A step attends one block: 512 queries, a quarter of a layer's forward; at 1k tokens it is
    # shorter than a send, which shows the difference (3 steps forward, 3 backward with 3 MiB
    # beside 3 blocks' attention, and the last gradient home with nothing beside it).
    attend = 512 * forward / 4 / (989e12 * COMPUTE_EFFICIENCY)
    expected = 8 * (3 * (block - attend) + 3 * 3 * (block - attend) + 2 * block)
    assert cp_exposed_seconds(cfg, cp4, cluster) == pytest.approx(expected)
    # At 128k tokens (one sequence) a block's attention outlasts its send: only the last
    # gradient is left, 2 × 32768 tokens × 1024 × 2 bytes a layer.
    cfg.train.seq_len, cfg.train.batch_size = 131072, 1
    home = 8 * 2 * 32768 * 1024 * 2 / NVLINK
    assert cp_exposed_seconds(cfg, cp4, cluster) == pytest.approx(home)
    step = step_time(cfg, cp4, cluster)
    assert step.comm["cp"] == cp_seconds(cfg, cp4, cluster) > home
    # FSDP's gathers over the 4 cp ranks hide behind the compute: the step waits for that only.
    assert step.exposed == pytest.approx(home)


def test_expert_parallel_sends_every_routed_copy_there_and_back():
    cfg = job("none")
    cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.ffn_hidden_dim = 8, 2, 256
    cluster = make_cluster(H100, 2, 8)
    # 2048 tokens × top-2 rows of 512, bf16, dispatch and combine, half of them leave, 8 MoE
    # layers, forward and backward.
    expected = 2 * 2 * 2048 * 2 * 512 * 1 / 2 * 8 * 2 / NVLINK
    assert ep_seconds(cfg, {**ONE, "ep": 2}, cluster) == pytest.approx(expected)


def test_pipeline_sends_activations_and_gradients_and_pays_its_bubble():
    cfg = job("none", batch_size=8)
    layout = {**ONE, "pp": 2}
    cluster = make_cluster(H100, 2, 1)  # the two stages on two nodes
    # 8 micro-batches of one sequence: 1024 × 512 bf16 forward and back, one stage per rank.
    assert pp_seconds(cfg, layout, cluster) == pytest.approx(2 * 8 * 1024 * 512 * 2 / NETWORK)
    cfg.distributed.pp = 2
    step = step_time(cfg, layout, cluster)
    # 1F1B's bubble (p − 1)/(m + p − 1) = 1/9 of the pass.
    assert step.bubble == pytest.approx(step.compute * (1 / 9) / (8 / 9))


def test_fsdp_hides_behind_compute_the_rest_adds():
    cfg = job("full")
    layout = {**ONE, "dp_shard": 2, "tp": 2}
    cluster = make_cluster(H100, 4, 8)
    step = step_time(cfg, layout, cluster)
    fsdp = step.comm["fsdp_all_gather"] + step.comm["fsdp_reduce_scatter"]
    assert step.exposed == pytest.approx(max(0, fsdp - step.compute) + step.comm["tp"])
    assert step.tokens == 2 * 2 * 1024
    assert step.tokens_per_sec == pytest.approx(step.tokens / step.seconds)
    expected_mfu = step.tokens_per_sec * flops_per_token(cfg.model, 1024) / (4 * 989e12)
    assert step.mfu == pytest.approx(expected_mfu)


def test_a_gpu_outside_the_table_needs_its_numbers():
    with pytest.raises(ConfigError, match=r"knows h100, h200, a100, b200.*--peak-tflops"):
        find_gpu("v100")
    custom = find_gpu("v100", peak_tflops=125, memory_gb=32, nvlink_gbps=150)
    assert (custom.peak_flops, custom.memory_bytes) == (125e12, 32e9)
    assert find_gpu("H200", memory_gb=100).memory_bytes == 100e9


def test_gpus_must_fill_whole_nodes():
    with pytest.raises(ConfigError, match=r"not a multiple of --gpus-per-node 4.*use 4 or 8"):
        make_cluster(H100, 6, 4)
    assert make_cluster(H100, 2, 8).gpus_per_node == 2  # less than a node: one partial node
    with pytest.raises(ConfigError, match="unknown --network"):
        make_cluster(H100, 8, 8, "token-ring")


def test_replica_groups_sum_in_the_backward_only_under_fsdp_without_expert_parallel():
    """Every-step sync's cost o: where FSDP wraps a group (more than one GPU, no expert
    parallel) the cross-group sum overlaps the backward as HSDP's all-reduce does, but for the
    root unit's share; with expert parallel or one-GPU groups it all runs after the backward. A
    layout without dp_replicate has no groups."""
    cfg = job("full", batch_size=32)  # enough compute to hide every transfer beside it
    cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.ffn_hidden_dim = 8, 2, 256
    cluster = make_cluster(H100, 8, 8)
    inputs = FailureInputs(2e-5, 600.0, 500, 600.0, 10.0, 5.0, 100)
    # The root unit (embeddings and head, untied) of the parameters, sharded alike.
    root = 2 * 1000 * 512 / count_params(cfg.model).total
    layouts = [  # layout, whether the hook serves it
        ({**ONE, "dp_replicate": 2, "dp_shard": 4}, True),
        ({**ONE, "dp_replicate": 2, "tp": 4}, True),  # FSDP over a mesh of one rank
        ({**ONE, "dp_replicate": 2, "dp_shard": 2, "ep": 2}, False),
        ({**ONE, "dp_replicate": 8}, False),  # one-GPU groups: no FSDP
    ]
    for layout, hooked in layouts:
        ft = fault_tolerance(evaluate(cfg, layout, cluster), cluster, inputs)
        step, whole = ft.candidate.step, ft.candidate.step.comm["hsdp_all_reduce"]
        assert sum(v for k, v in step.comm.items() if k.startswith(("fsdp", "hsdp"))) < step.compute
        assert ft.sum_in_backward == hooked and ft.sum_seconds == whole
        # Float reassociation only.
        assert ft.after_backward == pytest.approx(whole * root if hooked else whole, rel=1e-12)
        # The quorum's 5 ms on top; the rest of the step as the plan has it (all else hidden).
        assert ft.modes["every_step"].seconds == pytest.approx(ft.after_backward + 0.005, rel=1e-12)
    plain = fault_tolerance(evaluate(cfg, {**ONE, "dp_shard": 8}, cluster), cluster, inputs)
    out = as_dict(plain)
    assert plain.modes is None and out["every_step"] is None and out["break_even_gpus"] is None
    assert out["note"].startswith("no replica groups: the layout dp_shard=8 has dp_replicate = 1")
