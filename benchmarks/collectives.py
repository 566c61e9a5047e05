"""gloo's collectives against the strategy's point-to-point ones (``lightning_tpp.core.collectives``), not a test:
the all-gather and reduce-scatter FSDP2 runs per unit, in CPU processes on this machine. Each size and kind alternates
the two, round by round, so that both see the same machine; the median time of each and their ratio (direct / gloo:
below 1 is faster) are printed.

    python benchmarks/collectives.py                   # 2 and 4 processes, 0.5 / 6 / 24 MB; about a minute
    python benchmarks/collectives.py --ranks 4 --mb 1 96 --rounds 12

"reduce-scatter (gloo)" is what FSDP2 ran here before: gloo's all-reduce of its input in place plus a copy of this
rank's part (gloo's ``reduce_scatter_single`` clones the input first, and is slower still: printed on its own line).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tpp.core.collectives import all_gather_into, reduce_scatter_into


def _rank(rank: int, ranks: int, store: str, sizes: list[float], rounds: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    rows = []
    for mb in sizes:
        numel = int(mb * 2**20 / 4) // ranks * ranks
        whole, part = torch.randn(numel), torch.randn(numel // ranks)
        scratch = torch.empty_like(whole)
        kinds = {
            "all-gather": (lambda: dist.all_gather_single(whole, part),
                           lambda: all_gather_into(whole, part, None)),
            "reduce-scatter": (lambda: (dist.all_reduce(scratch.copy_(whole)),
                                        part.copy_(scratch.view(ranks, -1)[rank])),
                               lambda: reduce_scatter_into(part, scratch.copy_(whole), None)),
            "reduce-scatter (gloo's own)": (lambda: dist.reduce_scatter_single(part, whole),
                                            lambda: reduce_scatter_into(part, scratch.copy_(whole), None)),
        }
        for kind, pair in kinds.items():
            times: list[list[float]] = [[], []]
            for i in range(rounds + 1):
                for which, run in enumerate(pair):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    if i:  # the first round warms the connections
                        times[which].append(time.perf_counter() - start)
            slowest = torch.tensor([statistics.median(t) for t in times])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append((ranks, mb, kind, *slowest.tolist()))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, nargs="+", default=[0.5, 6, 24], help="the whole tensor's size")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'MB':>6}  {'collective':<28} {'gloo (ms)':>9} {'direct (ms)':>11} {'direct / gloo':>13}")
    context = mp.get_context("spawn")
    for ranks in args.ranks:
        queue = context.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [context.Process(target=_rank, args=(r, ranks, f"{tmp}/store", args.mb, args.rounds, queue))
                     for r in range(ranks)]
            for p in procs:
                p.start()
            rows = queue.get(timeout=900)
            for p in procs:
                p.join(timeout=60)
        for n, mb, kind, gloo, direct in rows:
            print(f"{n:>5} {mb:>6g}  {kind:<28} {gloo * 1e3:>9.2f} {direct * 1e3:>11.2f} {direct / gloo:>13.2f}")


if __name__ == "__main__":
    main()
