"""Memory bandwidth of this machine, STREAM-style: the roofline's memory side (issue 21).

A small C program (built here with the system C compiler, ``-O3 -march=native -fopenmp``)
streams arrays far larger than the last-level cache with every thread and times five
kernels, each ``--trials`` times, keeping the best (noise on a shared VM only slows a trial):

* ``read``: a sum over one array, vectorised (``omp simd``: many partial sums, not one
  serial chain), bytes read only: what a decode step's weight and KV reads are;
* ``write``: a fill (bytes written);
* ``copy``: ``b[i] = a[i]``; ``scale``: ``b[i] = s * a[i]``; ``triad``: ``c[i] = a[i] + s *
  b[i]``, counted as STREAM counts them (read + written bytes, no write-allocate traffic).

Each kernel's loop is split statically over the OpenMP threads, and the arrays are first
touched by the same split, so each thread streams pages it placed.

```
.venv/bin/python bench/membw.py [--mib 512] [--threads N] [--trials 20]
```

Prints one JSON object: GB/s per kernel (best and median trial), with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

SOURCE = r"""
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

static double now(void) { return omp_get_wtime(); }

int main(int argc, char **argv) {
    long n = atol(argv[1]);
    int trials = atoi(argv[2]);
    float *a = aligned_alloc(64, n * sizeof(float));
    float *b = aligned_alloc(64, n * sizeof(float));
    float *c = aligned_alloc(64, n * sizeof(float));
    if (!a || !b || !c) { fprintf(stderr, "out of memory\n"); return 1; }
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) { a[i] = 1.0f; b[i] = 2.0f; c[i] = 0.0f; }
    const float s = 3.0f;
    volatile float sink = 0.0f;
    printf("threads %d\n", omp_get_max_threads());
    for (int t = 0; t < trials; t++) {
        double t0 = now();
        float acc = 0.0f;
        #pragma omp parallel for simd schedule(static) reduction(+:acc)
        for (long i = 0; i < n; i++) acc += a[i];
        double t1 = now();
        sink += acc;
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) c[i] = s;
        double t2 = now();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) b[i] = a[i];
        double t3 = now();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) b[i] = s * a[i];
        double t4 = now();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) c[i] = a[i] + s * b[i];
        double t5 = now();
        printf("read %.9f\nwrite %.9f\ncopy %.9f\nscale %.9f\ntriad %.9f\n",
               t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4);
    }
    fprintf(stderr, "%f\n", (double)sink + c[n / 2]);
    free(a); free(b); free(c);
    return 0;
}
"""

# bytes moved per element, as STREAM counts them (4-byte floats)
BYTES = {"read": 4, "write": 4, "copy": 8, "scale": 8, "triad": 12}


def build(workdir: Path) -> Path:
    src, exe = workdir / "membw.c", workdir / "membw"
    src.write_text(SOURCE)
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(src)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise SystemExit(f"membw: no C compiler ({cc}); set CC") from e
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"membw: {' '.join(cmd)} failed:\n{e.stderr}") from e
    return exe


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB per array (three arrays)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP threads")
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args(argv)
    if args.mib < 1 or args.threads < 1 or args.trials < 1:
        raise SystemExit("membw: --mib, --threads and --trials must be positive")
    n = args.mib * 2**20 // 4
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_PROC_BIND="spread")
    with tempfile.TemporaryDirectory() as d:
        exe = build(Path(d))
        out = subprocess.run(
            [str(exe), str(n), str(args.trials)], env=env, capture_output=True, text=True
        )
    if out.returncode:
        raise SystemExit(f"membw: the stream program failed: {out.stderr.strip()}")
    times: dict[str, list[float]] = {k: [] for k in BYTES}
    for line in out.stdout.splitlines():
        name, value = line.split()
        if name in times:
            times[name].append(float(value))
    result = {"bench": "membw", "mib_per_array": args.mib, "threads": args.threads}
    for name, ts in times.items():
        gb = n * BYTES[name] / 1e9
        result[f"{name}_gb_s"] = round(gb / min(ts), 2)
        result[f"{name}_gb_s_median"] = round(gb / statistics.median(ts), 2)
    result["machine"] = machine_info()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
