"""A power run's seed blocks on disk: :class:`BlockStore`, the JSON-lines file an :func:`~specresearch.audit.execute.execute`
run with ``blocks_file=`` keeps each finished block in, so that a run of hours resumes where it stopped, and
:func:`block_machine`, what each block records of the machine that drew it (a run's blocks must share it).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

__all__ = ["BlockStore", "block_machine", "packed_path", "block_notes"]


def block_machine() -> dict:
    """What an engine's numbers depend on where a seed block is drawn: the CPU's model and vector extensions (which
    kernels llama.cpp's native build and torch's CPU kernels take), torch's and transformers' versions and the GPU.
    A token at a truncation's edge (min-p, top-p) moves with them: blocks of one run must share it
    (:class:`BlockStore`)."""
    from specresearch.experiments.records import machine_info

    info = machine_info()
    return {key: info[key] for key in ("cpu", "cpu_flags", "torch", "transformers", "gpu") if key in info}


class BlockStore:
    """A JSON-lines file of one :func:`execute` run's finished seed blocks, so a long run resumes where it stopped:
    a first line naming the run (engine, prompt ids, settings, N, block size, seed), then one line a block
    (``size``, ``seed``, its generations, its seconds, the machine that drew it: :func:`block_machine`, and the commit
    of the code that drew it: ``records.git_commit``, recorded, not compared). A last line cut short (the run killed
    while writing it) is dropped and its block drawn again; a file naming another run is refused, and so is a block
    drawn on another kind of machine than the blocks before it (:meth:`check_machine`): pooled, two machines' laws
    make a finding of their own (the first ``llamacpp-simple`` power run's, docs/audit.md).
    Blocks written before blocks recorded their machine carry none; they are counted (``unstamped``), not checked
    (those written before blocks recorded their commit name none either).

    A finished run's file may be packed (:meth:`pack`: ``<path>.gz``, a quarter of the size): it reads the same, and a
    run that draws more blocks into it unpacks it first."""

    def __init__(self, path, run: dict):
        self.path, self.run = Path(path), run
        self.machine: dict | None = None  # the machine every stamped block so far was drawn on
        self.unstamped = 0

    @staticmethod
    def stored(path) -> tuple[dict | None, list[dict], bool]:
        """What a block file holds, read only: ``(header, blocks, cut)`` -- its first line (``None`` for a missing or
        empty file), one dict a block (``size``, ``seed``, ``seconds``, ``draws``) and whether a last line was cut
        short (that block is left out)."""
        text = [line for line in BlockStore._text(path).splitlines() if line.strip()]
        try:
            json.loads(text[-1] if text else "{}")
            cut = False
        except json.JSONDecodeError:  # a run killed while it wrote its last block
            text, cut = text[:-1], True
        lines = [json.loads(line) for line in text]
        return (lines[0] if lines else None), lines[1:], cut

    @staticmethod
    def _text(path) -> str:
        """The file's text, from ``path`` or its packed ``path.gz`` (or ``path`` itself packed: a name ending in
        ``.gz``); "" where neither exists."""
        path = Path(path)
        if path.exists() and path.suffix != ".gz":
            return path.read_text()
        packed = path if path.suffix == ".gz" else packed_path(path)
        return gzip.decompress(packed.read_bytes()).decode() if packed.exists() else ""

    @staticmethod
    def finished(path) -> bool:
        """Whether the run stored at ``path`` (plain or packed) holds all of its ``num_samples`` generations."""
        header, blocks, _ = BlockStore.stored(path)
        return header is not None and sum(b["size"] for b in blocks) >= header["run"]["num_samples"]

    @staticmethod
    def pack(path) -> Path:
        """Pack a finished run's file into ``path.gz`` (gzip, no time stamp: the same bytes each time) and remove the
        plain one; ``ValueError`` for a run still drawing. Returns the packed path."""
        path = Path(path)
        if not BlockStore.finished(path):
            raise ValueError(f"{path}: the run has not drawn all its generations; pack it when it has")
        packed = packed_path(path)
        if path.exists():
            packed.write_bytes(_gzip(path.read_text()))
            path.unlink()
        return packed

    @staticmethod
    def set_aside(path, aside) -> Path | None:
        """Move the blocks stored at ``path`` (plain or packed, finished or not) to ``aside``, packed, so that a run at
        ``path`` starts from nothing. Returns ``aside``, or None where nothing was stored."""
        path = Path(path)
        stored = [p for p in (path, packed_path(path)) if p.exists()]
        if not stored:
            return None
        Path(aside).write_bytes(_gzip(BlockStore._text(path)))
        for p in stored:
            p.unlink()
        return Path(aside)

    def _unpack(self) -> None:
        """Before a packed run draws more blocks: back to the plain file it appends to."""
        packed = packed_path(self.path)
        if not self.path.exists() and packed.exists():
            self.path.write_text(self._text(self.path))
            packed.unlink()

    @staticmethod
    def progress(path, num_samples: int) -> str:
        """How far the run stored at ``path`` is, read only: its runs of ``num_samples`` in how many blocks and, at its
        blocks' seconds a run, the worker-hours it still needs (a block's seconds are its wall time on the worker that
        ran it, beside any others: W workers side by side finish in about 1/W of it)."""
        _, blocks, _ = BlockStore.stored(path)  # a block cut short is drawn again when the run resumes
        runs, seconds = sum(b["size"] for b in blocks), sum(b["seconds"] for b in blocks)
        left = (f", about {(num_samples - runs) * seconds / runs / 3600:.1f} worker-hours left at {seconds / runs:.2f} s "
                "a run") if runs else ""
        return f"{runs} of {num_samples} runs in {len(blocks)} blocks ({path}){left}"

    def read(self) -> dict:
        """``{(size, seed): (generations, seconds, machine, commit)}`` of the blocks already stored (None for what a
        block does not name); writes the header if new and drops a last line cut short (its block is drawn again).
        ``ValueError`` where they were drawn on different machines."""
        header, blocks, cut = self.stored(self.path)
        if header is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"run": self.run}) + "\n")
            return {}
        if header.get("run") != json.loads(json.dumps(self.run)):
            raise ValueError(f"{self.path} holds the blocks of another run ({header.get('run')}); this one is "
                             f"{self.run}: pass another path, or remove the file to start again")
        if cut:  # keep the whole lines as they were written, without the cut one
            self._unpack()
            kept = [line for line in self.path.read_text().splitlines() if line.strip()][:-1]
            self.path.write_text("".join(line + "\n" for line in kept))
        for row in blocks:
            self.check_machine(row.get("machine"), f"block (size {row['size']}, seed {row['seed']})")
        return {(row["size"], row["seed"]): ([tuple(s) for s in row["draws"]], row["seconds"], row.get("machine"),
                                             row.get("commit")) for row in blocks}

    def check_machine(self, machine: dict | None, what: str) -> None:
        """Hold a block's ``machine`` against the run's: the first stamped block sets it, every later one must match
        (``ValueError`` naming both); None (an older block) is counted in ``unstamped``."""
        if machine is None:
            self.unstamped += 1
            return
        machine = json.loads(json.dumps(machine))
        if self.machine is None:
            self.machine = machine
        elif machine != self.machine:
            raise ValueError(f"{self.path}: {what} was drawn on {machine}, the run's earlier blocks on {self.machine}. "
                             "One run's seed blocks must come from one kind of machine (an engine's logits, and the "
                             "tokens at a truncation's edge, move with the CPU's kernels and the libraries' versions): "
                             "draw this run on that machine, or pass another blocks_file to start it here")

    def append(self, size: int, seed: int, draws, seconds: float, machine: dict | None = None,
               commit: str | None = None) -> None:
        """Store a finished block: its generations, seconds, the machine that drew it (checked against the run's) and
        the commit of the code that drew it."""
        if machine is not None:
            self.check_machine(machine, f"the new block (size {size}, seed {seed})")
        row = {"size": size, "seed": seed, "seconds": round(seconds, 3)}
        row |= ({} if machine is None else {"machine": machine}) | ({} if commit is None else {"commit": commit})
        self._unpack()
        with self.path.open("a") as handle:
            handle.write(json.dumps(row | {"draws": [list(s) for s in draws]}, separators=(",", ":")) + "\n")


def _gzip(text: str) -> bytes:
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)  # no time stamp: the same bytes each time


def packed_path(path) -> Path:
    """Where :meth:`BlockStore.pack` puts the blocks stored at ``path``: ``path`` with ``.gz`` added."""
    path = Path(path)
    return path.with_name(path.name + ".gz")


def block_notes(store) -> tuple[str, ...]:
    """The notes a result carries for its stored blocks: how many of them name no machine."""
    if store is None or not store.unstamped:
        return ()
    return (f"{store.unstamped} of the stored seed blocks carry no machine (written before blocks recorded it): "
            "whether they share the others' machine is not checked",)
