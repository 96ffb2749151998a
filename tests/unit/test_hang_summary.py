"""The flight recorder's summary and the health check's verdict on synthetic per-rank records: who
is behind in which collective, who is late or slow, what fails the start-up."""

import pytest

from kiln.config import config_from_dict
from kiln.config.sections import ResilienceConfig
from kiln.errors import ConfigError
from kiln.resilience.hang_summary import summarize
from kiln.resilience.health import assess

HOSTS = ["node-a", "node-a", "node-b", "node-b"]
WORLD = {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]}}
MESH = {
    **WORLD,
    "1": {"desc": "mesh_dp_shard", "ranks": [0, 2]},
    "2": {"desc": "mesh_dp_shard", "ranks": [1, 3]},
    "3": {"desc": "mesh_tp", "ranks": [0, 1]},
    "4": {"desc": "mesh_tp", "ranks": [2, 3]},
}


def entry(group: str, seq: int, *, op="all_reduce", record_id=0, p2p=False, retired=True):
    return {
        "record_id": record_id,
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "is_p2p": p2p,
        "process_group": [group, ""],
        "profiling_name": f"gloo:{op}",
        "input_sizes": [[4]],
        "state": "scheduled",
        "retired": retired,
        "time_created_ns": 1_000_000_000 * (10 + seq),
    }


def dump(rank: int, entries: list[dict], groups=WORLD, reason="step 3 ran past") -> dict:
    for i, e in enumerate(entries):
        e["record_id"] = e["record_id"] or i
    mine = {name: g for name, g in groups.items() if rank in g["ranks"]}
    return {
        "rank": rank,
        "reason": reason,
        "time_ns": 20 * 10**9,
        "groups": mine,
        "entries": entries,
    }


def world_dump(rank: int, last: int, **kw) -> dict:
    return dump(rank, [entry("0", s, retired=s < last) for s in range(1, last + 1)], **kw)


def test_the_rank_that_never_entered_a_collective_is_named_with_its_host():
    dumps = [world_dump(0, 5), world_dump(1, 4), world_dump(2, 5), world_dump(3, 5)]
    text = summarize(dumps, world_size=4, hosts=HOSTS)
    first = text.splitlines()[0]
    assert first.startswith(
        "rank 1 (node-a) never entered all_reduce #5 on the world (ranks 0,1,2,3)"
    )
    assert "ranks 0,2,3 waited in it" in first
    assert "rank 0 (node-a): step 3 ran past; last entered all_reduce #5 on the world" in text
    assert "(in flight), 5.0 s before the dump" in text  # dump at 20 s, #5 entered at 15 s


def test_a_rank_without_a_dump_is_named_and_ranks_further_behind_come_first():
    dumps = [world_dump(0, 7), world_dump(1, 5), world_dump(2, 6)]
    lines = summarize(dumps, world_size=4, hosts=HOSTS).splitlines()
    assert lines[0].startswith("rank 1 (node-a) never entered all_reduce #6")
    assert lines[0].endswith("rank 0 went on to #7")
    assert lines[1].startswith("rank 2 (node-b) never entered all_reduce #7")
    assert lines[2].startswith("rank 3 (node-b) wrote no dump")


def test_the_lagging_rank_is_found_in_its_mesh_dimension():
    # Rank 3 never entered the tp all-gather #3 its tp peer (rank 2) waits in; every other group
    # agrees on where it stands.
    def ranks_entries(rank, tp_last):
        dp = "1" if rank in (0, 2) else "2"
        tp = "3" if rank in (0, 1) else "4"
        return [entry("0", 1), entry(dp, 1), entry(dp, 2)] + [
            entry(tp, s, op="all_gather") for s in range(1, tp_last + 1)
        ]

    dumps = [dump(r, ranks_entries(r, 2 if r == 3 else 3), groups=MESH) for r in range(4)]
    lines = summarize(dumps, world_size=4, hosts=HOSTS).splitlines()
    assert lines[0] == (
        "rank 3 (node-b) never entered all_gather #3 on tp (ranks 2,3), sizes [[4]] (its last "
        "there: #2); rank 2 waited in it"
    )
    assert lines[1] == "where each rank was:"


def test_ranks_that_agree_everywhere_are_not_blamed():
    dumps = [world_dump(r, 4) for r in range(4)]
    assert summarize(dumps, world_size=4, hosts=HOSTS).startswith("no rank is behind")


def test_point_to_point_operations_and_dropped_records_do_not_count():
    # Rank 1's ring buffer dropped its oldest entries (record ids start past 0), so it has no
    # entry of group 0 left: not "behind" there. Pipeline sends number themselves apart.
    sends = [entry("0", 9, p2p=True, record_id=500 + i) for i in range(3)]
    dumps = [world_dump(0, 2), dump(1, sends)]
    assert summarize(dumps, world_size=2, hosts=HOSTS).startswith("no rank is behind")


def reports_with_waits(seconds: list[float]) -> list[dict]:
    return [{"waits": {"the world": ([0, 1, 2, 3], s)}} for s in seconds]


def test_a_late_rank_is_the_one_that_waited_least():
    cfg = ResilienceConfig(preflight_slow_s=1.0)
    failures, slow = assess(reports_with_waits([3.1, 0.01, 3.0, 3.2]), HOSTS, cfg)
    assert failures == []
    assert slow == [
        "rank 1 (node-a): the others waited 3.1 s for it in the all-reduce over the world "
        "(resilience.preflight_slow_s = 1)"
    ]
    # A loaded machine's skew below the threshold names nobody.
    assert assess(reports_with_waits([0.4, 0.01, 0.3, 0.5]), HOSTS, cfg) == ([], [])
    # One rank in a process group of its own (torchrun --nproc-per-node=1 with a mesh) has
    # nobody to be late for.
    alone = [{"waits": {"the world": ([0], 0.2)}}]
    assert assess(alone, HOSTS, cfg) == ([], [])


def test_a_failing_gpu_fails_the_check_and_a_slow_one_is_named():
    cfg = ResilienceConfig()
    gpu = {"peak_tflops": 989.0, "ecc": 0}
    reports = [
        {**gpu, "tflops": 700.0},
        {"error": "a bf16 matmul of finite inputs gave a non-finite result on this GPU"},
        {**gpu, "tflops": 690.0},
        {**gpu, "tflops": 300.0, "ecc": 2},
    ]
    failures, slow = assess(reports, HOSTS, cfg)
    assert failures == [
        "rank 1 (node-a): a bf16 matmul of finite inputs gave a non-finite result on this GPU"
    ]
    # 300 of a median of 690: under 0.8 of it (the default), though above a quarter of the peak.
    assert slow[0].startswith("rank 3 (node-b): bf16 matmul at 300 TFLOP/s, 43% of the ranks'")
    assert slow[1] == "rank 3 (node-b): 2 uncorrected ECC errors on its GPU"


def test_a_gpu_far_below_its_datasheet_rate_is_named_even_when_all_are():
    reports = [{"tflops": 200.0, "peak_tflops": 989.0, "ecc": None}] * 2
    _, slow = assess(reports, HOSTS, ResilienceConfig())
    assert slow == [f"rank {r} (node-a): bf16 matmul at 200 of 989 TFLOP/s" for r in (0, 1)]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("preflight_timeout_s", 0, "resilience.preflight_timeout_s and"),
        ("preflight_slow_s", -1.0, "resilience.preflight_timeout_s and"),
        ("preflight_slow_matmul", 1.5, "resilience.preflight_slow_matmul must be in (0, 1]"),
    ],
)
def test_bad_preflight_thresholds_are_config_errors(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        config_from_dict({"resilience": {key: value}}, world_size=1)
