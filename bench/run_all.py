"""All benchmarks, one after the other (about fifteen minutes on 2 cores): `make bench`."""

from __future__ import annotations

import bench_consistency
import bench_extraction
import bench_overhead
import bench_producer
import bench_scaling
import bench_store
import bench_throughput
import bench_training

if __name__ == "__main__":
    for mod in (bench_throughput, bench_scaling, bench_producer, bench_overhead, bench_extraction,
                bench_consistency, bench_training, bench_store):
        mod.main()
