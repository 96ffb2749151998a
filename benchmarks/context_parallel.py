"""Context parallel on CPU (gloo) at cp = 1, 2, 4 on one long sequence: step time, saved
activations and peak RSS per rank, and the K/V all-gather bytes per step against the count
computed from the shapes.

ModelConfig's default Llama (dim 256, 4 layers, 8 heads, 4 KV heads, ffn 768, vocab 4096), fp32,
batch 1 x --seq tokens, built as `kiln train` builds it, the batch cut by
ContextParallel.shard_batch as TrainStep._prepare does; forward + loss + backward, no optimizer.
cp=1: one process x 2 threads; cp > 1: torchrun, 1 thread per rank (cp=4: 4 ranks on 2 cores).
A warm-up step, --steps timed steps (then the peak RSS is read), and one more step measured: the
tensors autograd saves (saved_tensors_hooks, one count per storage, weights excluded) and the
collectives (torch.profiler with record_shapes; the positions' list all-gather wrapped, as the
profiler records no list shapes).

    python benchmarks/context_parallel.py    # seq 8192, cp 1 2 4 (~4 min on 2 cores)
    python benchmarks/context_parallel.py --seq 4096 --cps 1 2
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BYTES = {"float": 4, "long": 8, "int": 4, "bool": 1, "c10::BFloat16": 2}  # profiler dtype names


def collective_bytes(prof) -> dict[str, list[int]]:
    """What the step's collectives moved, from the profiler's recorded input shapes: op -> [calls,
    bytes of the whole tensor (all-gather: gathered output; reduce-scatter: full input)]. The
    functional ops are kiln's K/V gather (autograd's reduce-scatter in backward); the c10d
    `_base_` ops are FSDP's (their nested coalesced calls would count the K/V twice)."""
    # Which argument holds the whole tensor: (output, input, ...) for c10d's ops; the functional
    # all-gather's input is one rank's part, (input, group_size, group_name).
    whole = {
        "_c10d_functional::all_gather_into_tensor": 0,
        "_c10d_functional::reduce_scatter_tensor": 0,
        "c10d::_allgather_base_": 0,
        "c10d::_reduce_scatter_base_": 1,
    }
    out: dict[str, list[int]] = {}
    for e in (e for e in prof.events() if e.name in whole):
        nbytes = math.prod(e.input_shapes[whole[e.name]]) * BYTES[e.input_dtypes[0]]
        if e.name == "_c10d_functional::all_gather_into_tensor":
            nbytes *= int(e.concrete_inputs[1])
        calls = out.setdefault(e.name, [0, 0])
        calls[0], calls[1] = calls[0] + 1, calls[1] + nbytes
    return out


def worker(seq: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import profile

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
    cfg = config_from_dict({}, overrides, world_size=cp)
    parallel = init_parallel(cfg.distributed, torch.device("cpu"))
    model = apply_parallelism(build_model(cfg.model), cfg, parallel)[0]
    materialize(model, device="cpu", seed=0)
    context = ContextParallel(parallel.cp_mesh()) if cp > 1 else None

    # The same sequence on every rank (cp ranks read the same batch), cut as _prepare cuts it.
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=torch.Generator())
    inputs, labels, kwargs = tokens[:, :-1], tokens[:, 1:], {}
    if context is not None:
        inputs, labels, kwargs = context.shard_batch(inputs, labels, kwargs)
    valid = count_valid(labels) * cp  # what sum_over(valid, data_group) gives

    def step() -> None:
        loss = token_loss_sum(model(inputs, **kwargs), labels) / valid
        loss.backward()
        model.zero_grad(set_to_none=True)

    # Saved tensors, one count per storage; weights (leaves needing grad, or views of them: FSDP's
    # unsharded parameters among them) are model state, not activations.
    saved: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        # The gathered K/V reach SDPA as AsyncCollectiveTensor views: count their buffer.
        storage = getattr(t, "elem", t).untyped_storage()
        # (batch, 1, local seq, seq): SDPA's float copy of kiln's bool mask; (batch, kv heads,
        # seq, head_dim): a view of a layer's gathered K/V (cp > 1 only: cp=1 has no mask).
        shape = tuple(t.shape[2:]) if cp > 1 and t.dim() == 4 else ()
        kind = {(seq // cp, seq): "mask", (seq, cfg.model.resolved_head_dim): "kv"}.get(
            shape, "other"
        )
        saved[storage.data_ptr()] = (storage.nbytes(), kind)
        return t

    # gather_sequence's all-gather of the positions takes lists, whose shapes the profiler does not
    # record: counted here (context_parallel.py calls it as dist.all_gather).
    positions = [0, 0]
    plain_all_gather = dist.all_gather

    def counting_all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, **kw) -> None:
        positions[:] = [positions[0] + 1, positions[1] + sum(p.nbytes for p in parts)]
        plain_all_gather(parts, tensor, **kw)

    rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
    times, cpu = [], []
    for _ in range(steps + 1):  # a warm-up step, then the timed ones
        if cp > 1:
            dist.barrier()  # ranks start together: a step is as slow as the slowest rank
        started, cpu_started = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - started)
        # CPU seconds of this process: the work, whoever else holds the cores meanwhile.
        cpu.append(time.process_time() - cpu_started)
    # Read before the measured step, whose hooks and profiler could raise it.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_gather = counting_all_gather
    with saved_tensors_hooks(pack, lambda t: t), profile(record_shapes=True) as prof:
        step()
    figures = {
        "step_s": statistics.median(times[1:]),
        "cpu_s": statistics.median(cpu[1:]),
        "saved": {k: sum(n for n, kind in saved.values() if kind == k) for k in ("kv", "mask")},
        "saved_total": sum(n for n, _ in saved.values()),
        "rss_before": rss_before,
        "peak_rss": peak_rss,
        "peak_rss_measured": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "collectives": collective_bytes(prof) | {"positions all_gather": positions},
    }
    gathered = [figures] if cp == 1 else [None] * cp
    if cp > 1:
        dist.all_gather_object(gathered, figures)
    if parallel.is_main:
        print("FIGURES " + json.dumps(gathered), flush=True)
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(cp: int, seq: int, steps: int) -> list[dict]:
    """One layout: cp=1 one process x 2 threads, else torchrun, cp ranks x 1 thread."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2" if cp == 1 else "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *(launcher if cp > 1 else []), __file__, "worker"]
    args = [*command, f"--seq={seq}", f"--steps={steps}"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cp={cp} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("FIGURES "))
    return json.loads(line.removeprefix("FIGURES "))


def report(results: dict[int, list[dict]], seq: int) -> None:
    from kiln.config import config_from_dict
    from kiln.plan.activations import gathered_kv_bytes

    mib, base = 2**20, results[1][0]
    cfg = config_from_dict({}, [f"--train.seq_len={seq}", "--train.batch_size=1"])
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("compare", "worker"), default="compare")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.seq, args.steps)
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    results = {}
    for cp in args.cps:
        results[cp] = run(cp, args.seq, args.steps)
        print(f"cp={cp}: {json.dumps(results[cp])}", flush=True)  # everything, for the record
    report(results, args.seq)
    wall, end = time.perf_counter() - started, os.getloadavg()[0]
    print(f"\nload average at start {load:.2f}, at end {end:.2f}; wall {wall:.0f} s")


if __name__ == "__main__":
    main()
