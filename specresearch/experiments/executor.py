"""Independent blocks of work run in this process or as Ray tasks: ``--executor ray [--address HOST:PORT]``.

Sweeps and statistical tests are embarrassingly parallel over prompts, seed blocks and configurations. A caller cuts
its work into blocks, each a picklable argument of one top-level function that returns the block's rows, and hands
them to an executor:

* :class:`LocalExecutor` (the default) calls the function on each block in turn, in this process;
* :class:`RayExecutor` submits each block as a Ray task (``ray.init()`` on this machine with ``workers`` CPUs, or
  ``address=`` an existing cluster: ``ray start --head`` on one node, ``ray start --address=<head>:6379`` on the
  others, then ``--executor ray --address <head>:6379``). A task whose worker process dies (killed, out of memory, a
  lost node) is run again by Ray, up to ``max_retries`` times; its rows reach the caller once, from the attempt that
  finished, so a killed worker neither loses nor duplicates rows.

Both call ``on_result(index, rows)`` as each block finishes (Ray: in the order they finish), so a caller appends to
its records as work lands and a rerun skips the blocks its records already hold. Models are built in the worker, once
per worker process: a block carries a *recipe* (a picklable zero-argument callable, e.g. ``functools.partial`` of a
top-level loader) and the block function calls :func:`loaded` on it, which builds on first use and keeps the result
for the worker's later blocks. Ray is imported only when a :class:`RayExecutor` is made.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["LocalExecutor", "RayExecutor", "make_executor", "add_executor_arguments", "loaded", "recipe_key",
           "run_into_csv"]

_LOADED: dict[Any, Any] = {}


def loaded(recipe: Callable[[], Any]) -> Any:
    """``recipe()``, built once per process and reused by the process's later blocks. A recipe is a top-level function
    or a ``functools.partial`` of one with hashable arguments; it is known again by its function's name and its
    arguments (every block brings its own unpickled copy)."""
    key = recipe_key(recipe)
    if key not in _LOADED:
        _LOADED[key] = recipe()
    return _LOADED[key]


def recipe_key(recipe) -> tuple:
    """A recipe by value: its function's module and name, and a partial's arguments."""
    if isinstance(recipe, functools.partial):
        return (recipe_key(recipe.func), recipe.args, tuple(sorted(recipe.keywords.items())))
    return (getattr(recipe, "__module__", None), getattr(recipe, "__qualname__", repr(recipe)))


class LocalExecutor:
    """Each block in turn, in this process."""

    name = "local"

    def run(self, function: Callable, blocks: Sequence, on_result: Callable[[int, Any], None] | None = None) -> list:
        """``[function(block) for block in blocks]``, calling ``on_result(i, result)`` after each."""
        results = []
        for index, block in enumerate(blocks):
            results.append(function(block))
            if on_result is not None:
                on_result(index, results[-1])
        return results


class RayExecutor:
    """Each block as a Ray task (module docstring).

    Args:
        address: an existing cluster's address (``"auto"``: the one this node joined); None starts Ray on this machine.
        workers: CPUs Ray may use on this machine (with ``address=None``; default all), one task per CPU.
        max_retries: times a task whose worker died is run again.
        cpus_per_task: CPUs each task reserves (its torch threads: the block function sets them).
        start_attempts: times Ray is started when its node does not register within Ray's fixed 30 s (a machine under
            load; ``ray.init``'s "timed out during startup").
    """

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, max_retries: int = 3,
                 cpus_per_task: int = 1, start_attempts: int = 3):
        import ray

        self.ray, self.max_retries, self.cpus_per_task = ray, max_retries, cpus_per_task
        if not ray.is_initialized():
            here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
                                "OMP_NUM_THREADS": str(cpus_per_task)}}
            options = dict(include_dashboard=False, log_to_driver=False) if address is None else {}
            for attempt in range(start_attempts):
                try:
                    ray.init(address=address, num_cpus=workers if address is None else None, runtime_env=env, **options)
                    break
                except Exception as error:  # Ray waits a fixed 30 s for its node to register: a loaded machine misses it
                    if "timed out during startup" not in str(error) or attempt == start_attempts - 1:
                        raise
                    ray.shutdown()

    @property
    def workers(self) -> int:
        return int(self.ray.cluster_resources().get("CPU", 1)) // self.cpus_per_task

    def run(self, function: Callable, blocks: Sequence, on_result: Callable[[int, Any], None] | None = None) -> list:
        """The results of ``function(block)`` for every block, in block order; ``on_result(i, result)`` as each lands.
        A task that raised raises here (after its retries when its worker died)."""
        task = self.ray.remote(num_cpus=self.cpus_per_task, max_retries=self.max_retries)(_call)
        pending = {task.remote(function, block): index for index, block in enumerate(blocks)}
        results: list = [None] * len(blocks)
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            index = pending.pop(done[0])
            results[index] = self.ray.get(done[0])
            if on_result is not None:
                on_result(index, results[index])
        return results

    def shutdown(self) -> None:
        self.ray.shutdown()


def _call(function: Callable, block):
    return function(block)


def add_executor_arguments(parser) -> None:
    """``--executor {local,ray}``, ``--address``, ``--workers`` on an argparse parser."""
    parser.add_argument("--executor", choices=["local", "ray"], default="local",
                        help="run the blocks here (default) or as Ray tasks (experiments.executor)")
    parser.add_argument("--address", help="with --executor ray: an existing cluster's address (default: start Ray here)")
    parser.add_argument("--workers", type=int, help="with --executor ray on this machine: CPUs Ray may use")


def make_executor(args, local=LocalExecutor):
    """The executor ``add_executor_arguments``' flags ask for; without ``--executor ray``, ``local()`` (pass
    ``local=None`` for None: the caller's own in-process path). ``--address`` / ``--workers`` alone raise."""
    if args.executor == "ray":
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        return RayExecutor(address=args.address, workers=args.workers)
    if args.address or args.workers:
        raise ValueError("--address and --workers go with --executor ray")
    return None if local is None else local()


def run_into_csv(executor, function: Callable, blocks: Sequence, keys: Sequence, path, *, key_column: str,
                 resume: bool = True) -> list[dict]:
    """The rows (dicts) of ``function(block)`` for every block, written to the CSV ``path`` after each block lands
    (rows in block order), so a stopped run keeps what finished. ``keys[i]``: block i's value in ``key_column`` of
    its rows; with ``resume``, blocks whose key the file already holds are not run again and their rows are kept."""
    import pandas as pd

    path = Path(path)
    held: dict = {key: [] for key in keys}
    if resume and path.exists() and path.stat().st_size:
        for row in pd.read_csv(path).to_dict("records"):
            if row.get(key_column) in held:
                held[row[key_column]].append(row)
    todo = [(block, key) for block, key in zip(blocks, keys) if not held[key]]

    def landed(index, rows):
        held[todo[index][1]] = list(rows)
        pd.DataFrame([row for key in keys for row in held[key]]).to_csv(path, index=False)

    executor.run(function, [block for block, _ in todo], on_result=landed)
    return [row for key in keys for row in held[key]]
