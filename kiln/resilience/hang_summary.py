"""Read the ranks' flight-recorder dumps (kiln/resilience/flight_recorder.py) together: which rank
is behind in which collective, and where each rank was last.

Each process group numbers its collectives on every rank in the same order (torch's
`collective_seq_id`), so the ranks of a group that stopped at a lower number than the others
never entered the next one, and the others are waiting in it (or failed there). Only sequence
numbers are compared across ranks: clocks on different hosts are not comparable, and a time is
only ever set against another of the same rank.
"""

from __future__ import annotations


def summarize(dumps: list[dict], *, world_size: int, hosts: list[str]) -> str:
    """The summary of `dumps` (one per rank that wrote one) of a job of `world_size` ranks."""
    by_rank = {d["rank"]: d for d in dumps}
    missing = [r for r in range(world_size) if r not in by_rank]
    groups: dict[str, dict] = {}
    for d in dumps:
        groups.update(d["groups"])
    findings = [
        line
        for name, group in sorted(groups.items(), key=lambda item: len(item[1]["ranks"]))
        for line in _behind_in(name, group, by_rank, hosts)
    ]
    if missing:
        findings.append(
            f"{_ranks(missing, hosts)} wrote no dump: hung where no watchdog bounds it "
            "(resilience.step_timeout_s), or dead; its log says which"
        )
    if not findings:
        findings.append(
            "no rank is behind: every rank entered the same collectives, so the failure is in "
            "one of them (a lost connection, a network fault), not a rank that never arrived"
        )
    details = [_last_collective(d, hosts) for _, d in sorted(by_rank.items())]
    return "\n".join([*findings, "where each rank was:", *details])


def _behind_in(name: str, group: dict, by_rank: dict[int, dict], hosts: list[str]) -> list[str]:
    """One line per set of `group`'s ranks that stopped short of the others in it."""
    last = {}
    for r in group["ranks"]:
        dump = by_rank.get(r)
        if dump is None:
            continue
        seqs = [e["collective_seq_id"] for e in _collectives(dump) if _group(e) == name]
        if seqs:
            last[r] = max(seqs)
        elif not _dropped_older(dump):  # none yet; with older entries dropped, unknown
            last[r] = 0
    if not last:
        return []
    front = max(last.values())
    ahead = [r for r, seq in last.items() if seq == front]
    lines = []
    for seq in sorted({seq for seq in last.values() if seq < front}):
        behind = [r for r, s in last.items() if s == seq]
        entry = _entry(by_rank[ahead[0]], name, seq + 1)
        what = f"{_op(entry)} #{seq + 1}" if entry else f"collective #{seq + 1}"
        sizes = f", sizes {entry['input_sizes']}" if entry else ""
        waited = "waited in it" if front == seq + 1 else f"went on to #{front}"
        lines.append(
            f"{_ranks(behind, hosts)} never entered {what} on {_label(group)}{sizes} "
            f"(its last there: #{seq}); {_ranks(ahead, hosts, short=True)} {waited}"
        )
    return lines


def _last_collective(dump: dict, hosts: list[str]) -> str:
    """Where one rank was: the reason it dumped and the last collective it entered."""
    who = _ranks([dump["rank"]], hosts)
    entries = _collectives(dump)
    if not entries:
        return f"  {who}: {dump['reason']}; no collective recorded (TORCH_FR_BUFFER_SIZE=0?)"
    entry = entries[-1]
    group = dump["groups"].get(_group(entry), {"desc": "", "ranks": []})
    ago = (dump["time_ns"] - entry["time_created_ns"]) / 1e9
    state = "ended" if entry["retired"] else "in flight"
    return (
        f"  {who}: {dump['reason']}; last entered {_op(entry)} #{entry['collective_seq_id']} on "
        f"{_label(group)} ({state}), {ago:.1f} s before the dump"
    )


def _collectives(dump: dict) -> list[dict]:
    # Point-to-point operations (pipeline sends and receives) number themselves apart, by pair.
    return [e for e in dump["entries"] if not e["is_p2p"]]


def _dropped_older(dump: dict) -> bool:
    """Whether torch's ring buffer dropped this rank's oldest entries (record ids start at 0)."""
    entries = dump["entries"]
    return bool(entries) and entries[0]["record_id"] > 0


def _entry(dump: dict, group: str, seq: int) -> dict | None:
    return next(
        (e for e in _collectives(dump) if _group(e) == group and e["collective_seq_id"] == seq),
        None,
    )


def _group(entry: dict) -> str:
    return entry["process_group"][0]


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":")[-1]  # "gloo:all_reduce", "nccl:all_gather"


def _label(group: dict) -> str:
    desc = group["desc"]
    if desc == "default_pg":
        name = "the world"
    elif desc.startswith("mesh_"):
        name = desc.removeprefix("mesh_")
    else:
        name = f"group '{desc}'" if desc else "a group"
    return f"{name} (ranks {_numbers(group['ranks'])})"


def _ranks(ranks: list[int], hosts: list[str], *, short: bool = False) -> str:
    word = "rank" if len(ranks) == 1 else "ranks"
    if short:
        return f"{word} {_numbers(ranks)}"
    named = ", ".join(f"{r} ({hosts[r]})" if r < len(hosts) else str(r) for r in sorted(ranks))
    return f"{word} {named}"


def _numbers(ranks: list[int]) -> str:
    return ",".join(map(str, sorted(ranks)))
