"""One BLAS thread for the host's linear algebra: bytes that do not depend on the thread count.

NumPy's and SciPy's BLAS (OpenBLAS in their wheels, MKL in some builds) split
a factorisation, a product or a long dot product over as many threads as the
process is given (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, else the CPUs it
may run on), and the partial sums meet in an order that follows the split. A
Cholesky factorisation, a triangular solve, an eigendecomposition, a dot
product and even some matrix products come out a last bit apart with one
thread and with two. JAX on the CPU calls the same library for its linear
algebra (jaxlib's LAPACK kernels are SciPy's), so GPTQ's factor of H moved
with the thread count, a near-tie code flipped, and the same unit, under the
same key, wrote other bytes under Ray (one thread per one-CPU task) than in a
plain run (every core). A key that names a unit must name its bytes, however
it ran.

``one_blas_thread`` holds every BLAS library the process has loaded at one
thread while the work inside it runs (threadpoolctl), whatever the caller's
environment, and gives back the caller's settings after. One thread, not a
fixed count: OpenBLAS never runs more threads than the CPUs it sees, so no
count above one is the same on every machine. The work inside must be finished
when the block ends (a JAX result read back to the host): the limit is the
process's, not a program's.

XLA's own thread pool (its matrix products, reductions and loops) splits work
over output elements, never a sum: a unit's bytes did not move with 1, 4 or 16
threads in it (``PJRT_NPROC``) or on one CPU (``taskset``;
tests/test_thread_determinism.py), so it is left alone.

What it costs: the host's BLAS work inside runs on one core. On a CPU the
units' heavy work is XLA's, whose pool is untouched, and OpenBLAS's threads
only competed with it for the same cores: on the 2-core machine GPTQ got
faster, not slower (bench/RESULTS.md, Reliability). On a many-core GPU host
the largest host BLAS work a unit does is the calibrate unit's float64
products of the shared expert's statistics, now on one core.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Every loaded BLAS library at one thread inside the block, the caller's settings restored after.

    Usable as a decorator too. SciPy's linear algebra is imported first: jaxlib's
    CPU LAPACK calls into SciPy's BLAS, which must be loaded for the limit to
    find it.
    """
    import scipy.linalg  # noqa: F401  (loads SciPy's BLAS, the library JAX's CPU LAPACK calls)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield
