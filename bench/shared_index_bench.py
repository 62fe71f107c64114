"""Publish and ingest cost of the shared drafter index per RL step, many replicas simulated.

Each of R replicas generates ``--requests`` responses per step (groups of ``--n``), taken from the
recorded GRPO rollouts in shared/traces, and runs the real path: ``SharedIndexClient.publish``
(split by router affinity, one flat array per coordinator shard), the coordinator's copy, then
``poll`` (one pull reply per replica through the object store) and ``apply``
(``NgramDrafter.add_sequences``). A machine
cannot hold R engine processes, so ``--hosts`` Ray actors each carry R/hosts replicas, every
replica with its own client and drafter, run one after another; per-replica times are therefore
uncontended by the other replicas of the host, while the hosts and the coordinator share the CPUs.

Routing ``sticky``: groups are placed by ``GroupRouter.assign`` (verl/OpenRLHF hooks on);
``scattered``: groups land on random replicas (a framework without the hooks).

    python bench/shared_index_bench.py                           # 64 replicas x 512 requests
    python bench/shared_index_bench.py --replicas 8 --routing scattered
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import ray

from rollout_spec.cli_args import DefaultsParser, int_arg, load_trace_arg
from rollout_spec.config import SpecConfig
from rollout_spec.distributed import GroupRouter, SharedIndexClient, SharedIndexConfig, create_coordinators
from rollout_spec.drafter import NgramDrafter
from rollout_spec.replay import Trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "grpo_smollm2_t0.6.json.gz"  # shared/ sits beside the checkout
NAME = "bench-index"
MAX_RESPONSES = 1 << 20
"""Most responses per step (--replicas x --requests): 4x the largest documented run (512 x 512).
The coordinators keep retain_steps x affinity_k copies of each (about 0.8 KB a copy), 3.3 GB at
this limit with the defaults; the options' own limits (65536 x 1048576) would ask for terabytes."""


def responses_by_group(trace: Trace) -> list[dict[int, list[list[int]]]]:
    """Per recorded step of ``trace``: group id -> its responses."""
    steps = []
    for step in trace.steps:
        groups: dict[int, list[list[int]]] = {}
        for group_id, response in step:
            groups.setdefault(group_id, []).append(response)
        steps.append(groups)
    return steps


class CountingSink:
    """Stands in for the drafter when only the transport is measured (``--sink count``): at 512
    simulated replicas, 512 real drafters do not fit in one small machine's memory."""

    def __init__(self) -> None:
        self.tokens = 0

    def add_sequences(self, group_ids: list, sequences: list) -> None:
        """Count what would be indexed."""
        self.tokens += sum(len(s) for s in sequences)

    def stats(self) -> dict:
        """The drafter's ``index_tokens`` field, for the bench's bookkeeping."""
        return {"index_tokens": self.tokens}

    def end_step(self) -> None:
        """Nothing ages in a counter."""


@ray.remote(num_cpus=0)
class SimHost:
    """Several simulated replicas in one process, each with its own drafter and index client."""

    def __init__(self, replica_ids: list[int], num_replicas: int, affinity_k: int, shards: int,
                 trace: list[dict[int, list[list[int]]]], sink: str) -> None:
        self.trace = trace  # responses_by_group of the recorded trace
        self.keys = [sorted(s) for s in self.trace]
        spec = SpecConfig(capacity_tokens=8_000_000, history_steps=2)
        self.reps = {}
        for r in replica_ids:
            drafter = NgramDrafter(spec) if sink == "drafter" else CountingSink()
            cfg = SharedIndexConfig(replica_id=r, num_replicas=num_replicas, affinity_k=affinity_k,
                                    name=NAME, num_shards=shards, apply_in_thread=False)
            self.reps[r] = (drafter, SharedIndexClient(drafter, cfg, start=False))
            self.reps[r][1].poll()  # a live replica's puller has caught up before its first publish

    def publish(self, step: int, work: dict[int, list[int]], n: int) -> list[dict]:
        """Record each replica's responses for ``work[r]`` (group ids) and publish them."""
        recorded = self.trace[step % len(self.trace)]
        keys = self.keys[step % len(self.trace)]
        costs = []
        for r, groups in work.items():
            client = self.reps[r][1]
            for g in groups:
                for resp in recorded[keys[g % len(keys)]][:n]:
                    client.record(g, resp)
            costs.append(client.publish(step))
        t0 = time.perf_counter()
        for _, client in self.reps.values():
            client.flush()
        for c in costs:
            c["ack_s"] = time.perf_counter() - t0  # host-level: all of this host's publishes acked
        return costs

    def ingest(self) -> list[dict]:
        """Pull, fetch and apply for every replica; per-replica deltas of the client's counters."""
        out = []
        for drafter, client in self.reps.values():
            before = client.stats()
            t0 = time.perf_counter()
            client.poll()
            client.apply()
            wall = time.perf_counter() - t0
            after = client.stats()
            delta = {k: after[k] - before[k] for k in ("fetch_s", "apply_s", "fetched_bytes", "fetched_tokens",
                                                       "entries_fetched")}
            delta["wall_s"] = wall
            delta["apply_max_s"] = after["apply_max_s"]  # longest single chunk so far
            delta["index_tokens"] = drafter.stats()["index_tokens"]
            drafter.end_step()
            out.append(delta)
        return out


def place_groups(num_groups: int, replicas: int, n: int, routing: str, rng: np.random.Generator) -> np.ndarray:
    """Replica of each group for one step."""
    if routing == "sticky":
        return GroupRouter(replicas).assign(np.arange(num_groups, dtype=np.int64), weights=[n] * num_groups)
    # contiguous chunks of a shuffled prompt list: OpenRLHF's split without the routing hook
    return (np.argsort(rng.permutation(num_groups)) * replicas // num_groups).astype(np.int32)


def pct(values: list[float], q: float) -> float:
    """Percentile in milliseconds of values in seconds."""
    return float(np.percentile(values, q)) * 1e3


def run_step(hosts: list, coords: list, step: int, placed: np.ndarray, n: int) -> dict[str, float]:
    """One step: every replica publishes, then every replica ingests; returns the table row."""
    work: list[dict[int, list[int]]] = [dict() for _ in hosts]
    for g, r in enumerate(placed.tolist()):
        work[r % len(hosts)].setdefault(r, []).append(g)
    busy0 = _coordinator_busy(coords)
    t0 = time.perf_counter()
    pubs = [c for part in ray.get([h.publish.remote(step, w, n) for h, w in zip(hosts, work)]) for c in part]
    t1 = time.perf_counter()
    ings = [d for part in ray.get([h.ingest.remote() for h in hosts]) for d in part]
    t2 = time.perf_counter()
    busy = _coordinator_busy(coords) - busy0
    mb = 1 / 2**20
    return {
        "step": step,
        "pub MB/rep": np.mean([p["bytes"] for p in pubs]) * mb,
        "buckets/rep": np.mean([p["buckets"] for p in pubs]),
        "pub ms p50": pct([p["seconds"] for p in pubs], 50),
        "pub ms p99": pct([p["seconds"] for p in pubs], 99),
        "in MB/rep": np.mean([d["fetched_bytes"] for d in ings]) * mb,
        "fetch ms p50": pct([d["fetch_s"] for d in ings], 50),
        "fetch ms p99": pct([d["fetch_s"] for d in ings], 99),
        "apply ms p50": pct([d["apply_s"] for d in ings], 50),
        "apply ms p99": pct([d["apply_s"] for d in ings], 99),
        "chunk ms max": max(d["apply_max_s"] for d in ings) * 1e3,
        "coord s": busy[:, 0].sum(),
        "coord s max shard": busy[:, 0].max(),
        "coord ms/call": busy[:, 0].sum() / max(busy[:, 1].sum(), 1) * 1e3,
        "publish+ack s": t1 - t0,
        "ingest s": t2 - t1,
    }


def _coordinator_busy(coords: list) -> np.ndarray:
    """Per shard: seconds spent in publish and pull, and calls served so far, float[S, 2]."""
    stats = ray.get([c.stats.remote() for c in coords])
    return np.array([[s["busy_s"], s["publishes"] + s["pulls"]] for s in stats], dtype=np.float64)


def print_table(rows: list[dict[str, float]]) -> None:
    """Markdown table (pastes into docs/scale_out.md)."""
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> None:
    """Parse options, start a local Ray cluster, run the steps, print one row per step."""
    ap = DefaultsParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int_arg("--replicas", 1, 1 << 16), default=64)
    ap.add_argument("--requests", type=int_arg("--requests", 1, 1 << 20), default=512, help="requests per replica per step")
    ap.add_argument("--n", type=int_arg("--n", 1, 1024), default=8,
                    help="samples per prompt (group size; at most the trace's smallest group)")
    ap.add_argument("--steps", type=int_arg("--steps", 1, 100_000), default=4,
                    help="RL steps (the trace's recorded steps repeat if it has fewer)")
    ap.add_argument("--hosts", type=int_arg("--hosts", 1, 1 << 16), default=2,
                    help="Ray actors carrying the simulated replicas (at most --replicas)")
    ap.add_argument("--affinity-k", type=int_arg("--affinity-k", 1, 1 << 16), default=2)
    ap.add_argument("--shards", type=int_arg("--shards", 1, 4096), default=1, help="coordinator actors")
    ap.add_argument("--retain-steps", type=int_arg("--retain-steps", 1, 1 << 20), default=2)
    ap.add_argument("--routing", choices=("sticky", "scattered"), default="sticky")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--sink", choices=("drafter", "count"), default="drafter",
                    help="ingest into real NgramDrafters, or only count tokens (transport cost alone)")
    args = ap.parse_args(argv)
    if args.requests % args.n:
        ap.error(f"--requests {args.requests} must be a multiple of --n {args.n}")
    if args.hosts > args.replicas:
        ap.error(f"--hosts {args.hosts} must be at most --replicas {args.replicas} (a host carries replicas)")
    if args.shards > args.replicas:
        ap.error(f"--shards {args.shards} must be at most --replicas {args.replicas} "
                 "(shard s serves the replicas r with r % shards == s: one beyond them serves none)")
    if args.replicas * args.requests > MAX_RESPONSES:
        ap.error(f"--replicas {args.replicas} x --requests {args.requests} = {args.replicas * args.requests} "
                 f"responses per step; at most {MAX_RESPONSES}")
    recorded = responses_by_group(load_trace_arg(ap, "--trace", args.trace, need_responses=True))
    smallest = min((len(r) for step in recorded for r in step.values()), default=0)
    if args.n > smallest:
        ap.error(f"--n {args.n}: the groups of trace {args.trace} hold as few as {smallest} responses")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    coords = create_coordinators(NAME, args.shards, args.retain_steps)
    recorded_ref = ray.put(recorded)
    hosts = [SimHost.remote([r for r in range(args.replicas) if r % args.hosts == h], args.replicas,
                            args.affinity_k, args.shards, recorded_ref, args.sink) for h in range(args.hosts)]
    num_groups = args.replicas * args.requests // args.n
    rng = np.random.default_rng(0)
    rows = []
    for step in range(args.steps):
        rows.append(run_step(hosts, coords, step, place_groups(num_groups, args.replicas, args.n, args.routing, rng), args.n))
        print(f"  [step {step + 1}/{args.steps}: published and ingested in "
              f"{rows[-1]['publish+ack s'] + rows[-1]['ingest s']:.1f}s]", file=sys.stderr, flush=True)
    retained = ray.get([c.stats.remote() for c in coords])
    print(f"replicas={args.replicas} requests/replica={args.requests} n={args.n} routing={args.routing} "
          f"affinity_k={args.affinity_k} shards={args.shards} hosts={args.hosts} sink={args.sink} "
          f"coordinator retained={sum(s['bytes'] for s in retained) / 2**20:.1f} MB "
          f"in {sum(s['entries'] for s in retained)} buckets")
    print_table(rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
