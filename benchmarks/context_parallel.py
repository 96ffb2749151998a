"""Context parallel on CPU (gloo) at cp = 1, 2, 4 on one long sequence: step time, saved
activations and peak RSS per rank, and the K/V all-gather bytes per step against the count
computed from the shapes.

ModelConfig's default Llama (dim 256, 4 layers, 8 heads, 4 KV heads, ffn 768, vocab 4096), fp32,
batch 1 x --seq tokens, built as `kiln train` builds it, the batch cut by
ContextParallel.shard_batch as TrainStep._prepare does; forward + loss + backward, no optimizer.
cp=1: one process x 2 threads; cp > 1: torchrun, 1 thread per rank (cp=4: 4 ranks on 2 cores).
A warm-up step, --steps timed steps (then the peak RSS is read), and one more step measured: the
tensors autograd saves in the forward (saved_tensors_hooks, one count per storage, weights
excluded), the CPU allocations the step holds at its peaks (torch.profiler's profile_memory) and
the collectives (torch.profiler with record_shapes; the positions' list all-gather wrapped, as
the profiler records no list shapes).

--cp-modes all_gather ring all_to_all runs every cp > 1 case in each distributed.cp_mode named
and sets them side by side against the all-gather (the all-to-alls counted from the profiler too,
the ring's sends by wrapping batch_isend_irecv, by pass), with what kiln's planner
(cp_exchange_bytes, cp_held_bytes) assumes for the same shapes.

    python benchmarks/context_parallel.py    # seq 8192, cp 1 2 4 (~4 min on 2 cores)
    python benchmarks/context_parallel.py --seq 4096 --cps 1 2
    python benchmarks/context_parallel.py --seq 4096 8192 --cps 2 4 --steps 2 \\
        --cp-modes all_gather ring all_to_all
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("forward", "backward")
ALLOCATED = ("forward", "at backward", "backward")  # allocated_peaks' figures
BYTES = {"float": 4, "long": 8, "int": 4, "bool": 1, "c10::BFloat16": 2}  # profiler dtype names


def collective_bytes(prof) -> dict[str, list[int]]:
    """What the step's collectives moved, from the profiler's recorded input shapes: op -> [calls,
    bytes of the whole tensor (all-gather: gathered output; reduce-scatter, all-to-all: full
    input)]. The functional ops are kiln's K/V gather (autograd's reduce-scatter in backward) or
    its all-to-alls (forward and backward alike); the c10d `_base_` ops are FSDP's (their nested
    coalesced calls would count the K/V twice)."""
    # Which argument holds the whole tensor: (output, input, ...) for c10d's ops; the functional
    # all-gather's input is one rank's part, (input, group_size, group_name).
    whole = {
        "_c10d_functional::all_gather_into_tensor": 0,
        "_c10d_functional::reduce_scatter_tensor": 0,
        "_c10d_functional::all_to_all_single": 0,
        "c10d::_allgather_base_": 0,
        "c10d::_reduce_scatter_base_": 1,
        "gloo:send": 0,  # the ring's sends, under c10d::send (whose tensor list has no shapes)
    }
    out: dict[str, list[int]] = {}
    for e in (e for e in prof.events() if e.name in whole):
        nbytes = math.prod(e.input_shapes[whole[e.name]]) * BYTES[e.input_dtypes[0]]
        if e.name == "_c10d_functional::all_gather_into_tensor":
            nbytes *= int(e.concrete_inputs[1])
        calls = out.setdefault(e.name, [0, 0])
        calls[0], calls[1] = calls[0] + 1, calls[1] + nbytes
    return out


def allocated_peaks(prof) -> dict[str, int]:
    """The bytes the step allocated and still holds (the profiler's running total of CPU
    allocations made while it records): at the forward's peak, at the backward's start (what the
    forward left for it) and at the backward's peak."""
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder, "trace.json")
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    start = next(e["ts"] for e in events if e.get("name") == "step: backward")
    memory = [
        (e["ts"] >= start, e["args"]["Total Allocated"])
        for e in sorted(events, key=lambda e: e["ts"])
        if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0
    ]
    forward = [total for late, total in memory if not late]
    backward = [total for late, total in memory if late]
    return {"forward": max(forward), "at backward": forward[-1], "backward": max(backward)}


def worker(seq: int, steps: int, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import profile, record_function

    import kiln.model.llama.model as llama_model
    from kiln.config import config_from_dict
    from kiln.model import build_model, materialize
    from kiln.parallel.apply import apply_parallelism
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.mesh import init_parallel
    from kiln.train.loss import count_valid, token_loss_sum

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = f"--train.seq_len={seq} --model.max_seq_len={seq} --train.batch_size=1".split()
    overrides += (
        f"--train.mixed_precision=fp32 --distributed.cp={cp} --distributed.dp_shard=1".split()
    )
    overrides.append(f"--distributed.cp_mode={mode}")
    cfg = config_from_dict({}, overrides, world_size=cp)
    parallel = init_parallel(cfg.distributed, torch.device("cpu"))
    model = apply_parallelism(build_model(cfg.model), cfg, parallel)[0]
    materialize(model, device="cpu", seed=0)
    context = ContextParallel(parallel.cp_mesh(), mode=mode) if cp > 1 else None

    # The same sequence on every rank (cp ranks read the same batch), cut as _prepare cuts it.
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=torch.Generator())
    inputs, labels, kwargs = tokens[:, :-1], tokens[:, 1:], {}
    if context is not None:
        inputs, labels, kwargs = context.shard_batch(inputs, labels, kwargs)
    valid = count_valid(labels) * cp  # what sum_over(valid, data_group) gives

    phase = ["forward"]  # the pass running: the ring's sends are counted by pass

    def step() -> None:
        # As TrainStep's forward_options pass it: without it the layers attend locally.
        phase[0] = "forward"
        logits = model(inputs, **kwargs, context_parallel=context)
        loss = token_loss_sum(logits, labels) / valid
        phase[0] = "backward"
        with record_function("step: backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)

    # Saved tensors, one count per storage; weights (leaves needing grad, or views of them: FSDP's
    # unsharded parameters among them) are model state, not activations.
    saved: dict[int, tuple[int, str]] = {}
    m = cfg.model
    # Heads split over, queries, keys of one attention: all_gather every head, the local queries
    # over every key; ring the local queries, keys and values; all_to_all 1/cp of the heads, all.
    heads_split, queries, keys = {
        "all_gather": (1, seq // cp, seq),
        "ring": (1, seq // cp, seq // cp),
        "all_to_all": (cp, seq, seq),
    }[mode]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        # The backward packs only the ring's recomputed blocks, freed block by block.
        if phase[0] == "backward" or (base.is_leaf and base.requires_grad):
            return t
        # The gathered K/V reach SDPA as AsyncCollectiveTensor views: count their buffer.
        storage = getattr(t, "elem", t).untyped_storage()
        # What attention keeps (cp > 1 only: cp=1 has no mask), (batch, ...): SDPA's float copy
        # of kiln's bool mask, (1, queries, keys) (the ring's Function holds its bool masks as an
        # attribute, unseen here); keys and values (a view of the gathered buffer, the re-split
        # K/V of all-to-all, the ring's own); queries and output (the ring's as it returns it).
        kind = {
            (1, queries, keys): "mask",
            (m.n_kv_heads // heads_split, keys, m.resolved_head_dim): "kv",
            (m.n_heads // heads_split, queries, m.resolved_head_dim): "q_out",
        }.get(tuple(t.shape[1:]) if cp > 1 and t.dim() == 4 else (), "other")
        saved[storage.data_ptr()] = (storage.nbytes(), kind)
        return t

    # gather_sequence's all-gather of the positions takes lists, whose shapes the profiler does not
    # record: counted here (context_parallel.py calls it as dist.all_gather).
    positions = [0, 0]
    plain_all_gather = dist.all_gather

    def counting_all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, **kw) -> None:
        positions[:] = [positions[0] + 1, positions[1] + sum(p.nbytes for p in parts)]
        plain_all_gather(parts, tensor, **kw)

    # The ring's sends (ring_attention.py calls dist.batch_isend_irecv): pass -> [calls, bytes].
    sends = {p: [0, 0] for p in PASSES}
    plain_batch_isend_irecv = dist.batch_isend_irecv

    def counting_batch_isend_irecv(ops: list) -> list:
        counted = sends[phase[0]]
        counted[0] += 1
        counted[1] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return plain_batch_isend_irecv(ops)

    # The bool masks one forward builds and its layers share (the ring's Function keeps them).
    built_masks = [0]
    plain_layer_masks = llama_model.layer_masks

    def measured_layer_masks(*args, **kw):
        masks = plain_layer_masks(*args, **kw)
        for mask in (masks or {}).values():
            built_masks[0] += sum(t.nbytes for t in (mask if isinstance(mask, tuple) else (mask,)))
        return masks

    rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
    times, cpu, system = [], [], []
    for _ in range(steps + 1):  # a warm-up step, then the timed ones
        if cp > 1:
            dist.barrier()  # ranks start together: a step is as slow as the slowest rank
        started, cpu_started = time.perf_counter(), os.times()
        step()
        times.append(time.perf_counter() - started)
        # CPU seconds of this process, user + system: the work, whoever else holds the cores
        # meanwhile. The system's share is mostly the page faults of large fresh buffers.
        spent = os.times()
        system.append(spent.system - cpu_started.system)
        cpu.append(spent.user - cpu_started.user + system[-1])
    # Read before the measured step, whose hooks and profiler could raise it.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_gather, dist.batch_isend_irecv = counting_all_gather, counting_batch_isend_irecv
    llama_model.layer_masks = measured_layer_masks
    with (
        saved_tensors_hooks(pack, lambda t: t),
        profile(record_shapes=True, profile_memory=True) as prof,
    ):
        step()
    figures = {
        "step_s": statistics.median(times[1:]),
        "cpu_s": statistics.median(cpu[1:]),
        "system_s": statistics.median(system[1:]),
        "top ops": [  # of the measured step, whose profiler adds its own overhead
            (e.key, e.self_cpu_time_total / 1e6)
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
        ],
        "saved": {
            k: sum(n for n, kind in saved.values() if kind == k) for k in ("kv", "mask", "q_out")
        },
        "saved_total": sum(n for n, _ in saved.values()),
        "rss_before": rss_before,
        "peak_rss": peak_rss,
        "peak_rss_measured": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "collectives": collective_bytes(prof) | {"positions all_gather": positions},
        "ring sends": sends,
        "masks built": built_masks[0],
        "allocated": allocated_peaks(prof),
    }
    gathered = [figures] if cp == 1 else [None] * cp
    if cp > 1:
        dist.all_gather_object(gathered, figures)
    if parallel.is_main:
        print("FIGURES " + json.dumps(gathered), flush=True)
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(cp: int, seq: int, steps: int, mode: str) -> list[dict]:
    """One layout: cp=1 one process x 2 threads, else torchrun, cp ranks x 1 thread."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2" if cp == 1 else "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *(launcher if cp > 1 else []), __file__, "worker"]
    args = [*command, f"--seq={seq}", f"--steps={steps}", f"--cp-modes={mode}"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("FIGURES ")]
    if not lines:
        sys.exit(f"cp={cp} {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if done.returncode != 0:
        # Seen once in a few dozen cp=4 runs: a rank aborts in gloo's teardown ("terminate
        # called without an active exception") after every rank's figures were gathered.
        print(f"cp={cp} {mode}: exit {done.returncode} after its figures", file=sys.stderr)
    return json.loads(lines[0].removeprefix("FIGURES "))


def report(results: dict[int, list[dict]], seq: int) -> None:
    from kiln.config import config_from_dict
    from kiln.plan.activations import gathered_kv_bytes

    mib, base = 2**20, results[1][0]
    cfg = config_from_dict(
        {}, [f"--train.seq_len={seq}", f"--model.max_seq_len={seq}", "--train.batch_size=1"]
    )
    m = cfg.model
    print(f"\n### seq_len {seq}, batch 1, fp32, {m.n_layers} layers, dim {m.dim}\n")
    print(
        "| cp | step s (slowest rank) | vs cp=1 | CPU s/step, all ranks | saved MiB (max rank) | "
        "vs cp=1 | gathered K/V | mask | rest | rest x cp / cp=1 | peak RSS MiB (max rank) | "
        "RSS before the steps + growth to peak MiB |"
    )
    print("|" + "---|" * 12)
    for cp, ranks in results.items():
        step = max(r["step_s"] for r in ranks)
        top = max(ranks, key=lambda r: r["saved_total"])
        total, kv, mask = top["saved_total"], top["saved"]["kv"], top["saved"]["mask"]
        rest, peak = total - kv - mask, max(r["peak_rss"] for r in ranks)
        print(
            f"| {cp} | {step:.2f} | {step / base['step_s']:.2f} | "
            f"{sum(r['cpu_s'] for r in ranks):.1f} | {total / mib:.0f} | "
            f"{total / base['saved_total']:.2f} | {kv / mib:.0f} | {mask / mib:.0f} | "
            f"{rest / mib:.0f} | {rest * cp / base['saved_total']:.2f} | {peak / mib:.0f} | "
            f"{top['rss_before'] / mib:.0f} + {(top['peak_rss'] - top['rss_before']) / mib:.0f} |"
        )
    print(
        "\n| cp | K/V all-gather MiB/step (calls) | K/V reduce-scatter MiB/step (calls) | computed "
        "MiB/step, each | match | of which from / to other ranks MiB | gathered_kv_bytes x 2 x "
        "layers MiB | positions all-gather B/step (calls) | FSDP all-gather / reduce-scatter MiB |"
    )
    print("|" + "---|" * 9)
    for cp, ranks in list(results.items())[1:]:
        col = ranks[0]["collectives"]
        ag = col.get("_c10d_functional::all_gather_into_tensor", [0, 0])
        rs = col.get("_c10d_functional::reduce_scatter_tensor", [0, 0])
        fsdp = [col.get(f"c10d::_{op}_base_", [0, 0])[1] for op in ("allgather", "reduce_scatter")]
        # From the shapes: per layer per forward one (seq, 2, batch, kv heads, head_dim) fp32
        # tensor is gathered; the backward reduce-scatters one of the same size.
        computed = m.n_layers * 2 * 1 * m.n_kv_heads * seq * m.resolved_head_dim * 4
        formula = m.n_layers * gathered_kv_bytes(cfg, {"cp": cp, "tp": 1, "pp": 1}) * 2  # fp32
        same = all(r["collectives"] == col for r in ranks)  # every rank moved the same
        match = "yes" if same and ag == rs == [m.n_layers, computed] else "NO"
        pos = col["positions all_gather"]
        print(
            f"| {cp} | {ag[1] / mib:.1f} ({ag[0]}) | {rs[1] / mib:.1f} ({rs[0]}) | "
            f"{computed / mib:.1f} | {match} | {computed * (cp - 1) / cp / mib:.1f} | "
            f"{formula / mib:.1f} | {pos[1]} ({pos[0]}) | "
            f"{fsdp[0] / mib:.1f} / {fsdp[1] / mib:.1f} |"
        )
    for cp, ranks in results.items():
        per_rank = [
            (round(r["step_s"], 2), round(r["peak_rss"] / mib), round(r["peak_rss_measured"] / mib))
            for r in ranks
        ]
        print(f"cp={cp} per rank (step s, peak RSS MiB, after the measured step): {per_rank}")


def planned_fp32(cfg, degrees: dict[str, int]) -> tuple[float, float, float]:
    """The planner's bytes one layer sends in forward and in backward and keeps beyond its own
    tokens', in fp32: its bf16 terms doubled, the ring's fp32 gradients not."""
    from kiln.plan.activations import cp_exchange_bytes, cp_held_bytes

    forward = cp_exchange_bytes(cfg, degrees)
    backward = cp_exchange_bytes(cfg, degrees, backward=True)
    held = 2 * cp_held_bytes(cfg, degrees)
    if cfg.distributed.cp_mode == "ring":
        # Its backward: the forward's bf16 K/V sends again, then the fp32 gradients.
        return 2 * forward, forward + backward, held
    return 2 * forward, 2 * backward, held


def report_modes(results: dict[tuple[int, str], list[dict]], seq: int) -> None:
    """ring and all_to_all against all_gather at each cp > 1: time, memory and bytes per layer,
    side by side, and what the planner (kiln.plan.activations) assumes for the same shapes."""
    from kiln.config import config_from_dict

    mib = 2**20
    modes = [m for m in ("all_gather", "ring", "all_to_all") if any(m == k for _, k in results)]
    cps = sorted({cp for cp, _ in results if cp > 1})
    print(f"\n### seq_len {seq}: each cp_mode against all_gather (fp32, per rank)\n")
    print(
        "| cp | mode | step s (slowest rank) | CPU s/step, all ranks | of it system | "
        "peak RSS MiB (max rank) | "
        "RSS growth to peak MiB | allocated: forward's peak | at the backward's start | "
        "backward's peak | saved MiB (max rank) | mask | saved without the mask | K/V held | "
        "queries + output | rest | bool masks built per forward |"
    )
    print("|" + "---|" * 17)
    unmasked = {}  # (cp, mode) -> saved bytes without the mask (a CPU-only term)
    for cp in cps:
        rows = {}
        for mode in modes:
            ranks = results[cp, mode]
            top = max(ranks, key=lambda r: r["saved_total"])
            kv, mask, q_out = (top["saved"][k] for k in ("kv", "mask", "q_out"))
            total = top["saved_total"]
            rows[mode] = [
                max(r["step_s"] for r in ranks),
                sum(r["cpu_s"] for r in ranks),
                sum(r["system_s"] for r in ranks),
                max(r["peak_rss"] for r in ranks),
                max(r["peak_rss"] - r["rss_before"] for r in ranks),
                *(max(r["allocated"][k] for r in ranks) for k in ALLOCATED),
                total,
                mask,
                total - mask,
                kv,
                q_out,
                total - mask - kv - q_out,
                top["masks built"],
            ]
            unmasked[cp, mode] = total - mask
        for mode in modes:
            row = rows[mode]
            cells = [f"{row[0]:.2f}", f"{row[1]:.1f}", f"{row[2]:.1f}"]
            cells += [f"{x / mib:.0f}" for x in row[3:]]
            print(f"| {cp} | {mode} | " + " | ".join(cells) + " |")
            if mode != "all_gather":
                base = rows["all_gather"]
                ratio = [f"{a / g:.2f}" if g else "–" for a, g in zip(row, base, strict=True)]
                print(f"| {cp} | {mode} / all_gather | " + " | ".join(ratio) + " |")
    print(
        "\n| cp | mode | exchange calls/step | sent MiB/layer, forward | backward | planner "
        "cp_exchange_bytes (fp32), forward | backward | measured / planner | K/V held MiB/layer "
        "| of it beyond the own tokens' | saved without the mask minus all_gather's, MiB/layer | "
        "planner's difference (cp_held_bytes, fp32) | positions all-gather calls, B |"
    )
    print("|" + "---|" * 13)
    for cp in cps:
        overrides = [f"--train.seq_len={seq}", f"--model.max_seq_len={seq}"]
        overrides += ["--train.batch_size=1", f"--distributed.cp={cp}", "--distributed.dp_shard=1"]
        held_gather = None
        for mode in modes:
            ranks = results[cp, mode]
            col = ranks[0]["collectives"]
            assert all(r["collectives"] == col for r in ranks), "ranks moved different bytes"
            cfg = config_from_dict({}, [*overrides, f"--distributed.cp_mode={mode}"], world_size=cp)
            layers, degrees = cfg.model.n_layers, {"cp": cp, "tp": 1, "pp": 1}
            if mode == "all_gather":
                calls, whole = col["_c10d_functional::all_gather_into_tensor"]
                back = col["_c10d_functional::reduce_scatter_tensor"]
                assert back == [calls, whole], "the backward's reduce-scatter mirrors the gather"
                op = f"all_gather {calls} + reduce_scatter {back[0]}"
                forward = backward = whole * (cp - 1) / cp
            elif mode == "all_to_all":
                calls, whole = col["_c10d_functional::all_to_all_single"]
                op = f"all_to_all_single {calls}"
                forward = backward = whole / 2 * (cp - 1) / cp  # forward and backward alike
            else:
                (calls, forward), (back, backward) = (ranks[0]["ring sends"][p] for p in PASSES)
                same = all(r["ring sends"] == ranks[0]["ring sends"] for r in ranks)
                assert same, "ranks sent different bytes"
                sent = col.get("gloo:send", [0, 0])[1]
                assert sent == forward + backward, "the profiler's gloo:send agrees"
                op = f"batch_isend_irecv {calls} + {back}"
            planned = planned_fp32(cfg, degrees)
            kv = max(r["saved"]["kv"] for r in ranks) / layers
            # This rank's own tokens' keys and values: the whole sequence's over cp.
            m = cfg.model
            own = 2 * seq * m.n_kv_heads * m.resolved_head_dim * 4 / cp
            pos = col["positions all_gather"]
            held_gather = planned[2] if mode == "all_gather" else held_gather
            more = (unmasked[cp, mode] - unmasked[cp, "all_gather"]) / layers
            print(
                f"| {cp} | {mode} | {op} | {forward / layers / mib:.2f} | "
                f"{backward / layers / mib:.2f} | {planned[0] / mib:.2f} | {planned[1] / mib:.2f} | "
                f"{forward / layers / planned[0]:.3f} / {backward / layers / planned[1]:.3f} | "
                f"{kv / mib:.2f} | {(kv - own) / mib:.2f} | {more / mib:.2f} | "
                f"{(planned[2] - held_gather) / mib:.2f} | {pos[0]}, {pos[1]} |"
            )
    for (cp, mode), ranks in results.items():
        ops = ", ".join(f"{name} {spent:.2f}" for name, spent in ranks[0]["top ops"])
        print(f"cp={cp} {mode}, rank 0's measured step, self CPU s: {ops}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("compare", "worker"), default="compare")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192], help="one run each")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--cp-modes",
        nargs="+",
        choices=("all_gather", "ring", "all_to_all"),
        default=["all_gather"],
        help="distributed.cp_mode of each cp > 1 run (cp=1 runs once)",
    )
    args = parser.parse_args()
    if len(args.cp_modes) > 1 and "all_gather" not in args.cp_modes:
        parser.error("--cp-modes: the modes are set side by side against all_gather; name it too")
    if args.mode == "worker":
        worker(args.seq[0], args.steps, args.cp_modes[0])
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    for seq in args.seq:
        results: dict[tuple[int, str], list[dict]] = {}
        for cp in args.cps:
            for mode in args.cp_modes if cp > 1 else args.cp_modes[:1]:
                results[cp, mode] = run(cp, seq, args.steps, mode)
                # Everything, for the record.
                print(f"seq={seq} cp={cp} {mode}: {json.dumps(results[cp, mode])}", flush=True)
        gather = {cp: ranks for (cp, mode), ranks in results.items() if mode == "all_gather"}
        if 1 in args.cps and "all_gather" in args.cp_modes:
            report(gather, seq)
        if len(args.cp_modes) > 1:
            report_modes(results, seq)
        print(f"load average after seq {seq}: {os.getloadavg()[0]:.2f}", flush=True)
    wall, end = time.perf_counter() - started, os.getloadavg()[0]
    print(f"\nload average at start {load:.2f}, at end {end:.2f}; wall {wall:.0f} s")


if __name__ == "__main__":
    main()
