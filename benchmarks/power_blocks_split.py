"""A power run's stored seed blocks, tested in parts against the target law its record row holds: whether a finding
comes from all of the blocks or from some of them (a run resumed elsewhere may have drawn some on another machine,
by that machine's build of the engine).

For ``llamacpp-simple``'s first power run (its blocks kept in
``benchmarks/records/blocks/llamacpp-simple-1fbcfbff49d7.superseded.jsonl.gz``, its row, ``power_n`` 18,000, in the
``superseded`` list of ``benchmarks/records/audit_executed.json``): every generation outside the target's lists lies in the first 8 blocks,
4,000 generations drawn at twice the others' seconds a block (another machine), and the other 28 blocks keep the
target's law.

    PYTHONPATH=. .venv/bin/python benchmarks/power_blocks_split.py --engine llamacpp-simple --power 18000 --split 8 --superseded
    PYTHONPATH=. .venv/bin/python benchmarks/power_blocks_split.py --record benchmarks/records/audit_libraries.json \
        --engine flashspec --power 22000 --split 26   # its 26 blocks that name no machine against the 18 that do

The two PyPI libraries' power runs (``flashspec``, ``seqspecdecod.naive_hsd``) pooled 26 blocks written before blocks
named their machine with 18 drawn on this one; each part keeps the target's law on its own (flashspec p = 0.80 and
0.76, naive HSD 0.80 and 0.10; N 13,000 and 9,000).

Each part's generations are placed in the row's cells as the law places them (``stats.SequenceLaw.index``: along the
prefixes the cells expand, into the rest cell of the last one; a sequence the cells cannot place counts in the row's
``tail`` cell: the record keeps no law to tell the tail from outside the support, so a part is never rejected for a
sequence it merely holds alone); a chi-square p-value and the TV with its noise floor per part (``audit.execute``'s
comparison), and how many generations in no named cell each part holds that the other part never drew.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

RECORD = Path("benchmarks/records/audit_executed.json")
BLOCKS = Path("benchmarks/records/blocks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="llamacpp-simple", help="an engine, or a library of --record")
    parser.add_argument("--record", default=str(RECORD), help="the record holding the run's row "
                        "(benchmarks/records/audit_libraries.json for a library)")
    parser.add_argument("--power", type=int, default=18000, help="the row's power_n")
    parser.add_argument("--split", type=int, default=8, help="blocks before this index form the first part")
    parser.add_argument("--superseded", action="store_true", help="the record's superseded row of that run, not its current one")
    parser.add_argument("--file", help="the block file (plain or packed; default: the engine's run at --power)")
    args = parser.parse_args()
    from specresearch.audit.blocks import BlockStore
    from specresearch.audit.execute import compare_counts
    from specresearch.experiments.stats import detectable_tv

    record = json.loads(Path(args.record).read_text())
    row = next(r for r in record["superseded" if args.superseded else "rows"]
               if args.engine in (r.get("engine"), r.get("library")) and r.get("power_n") == args.power)
    if args.file or row.get("blocks"):  # a superseded row names where its blocks were put aside
        path = Path(args.file or row["blocks"])
    else:
        prefix = f"library-{args.engine}" if "library" in row else args.engine
        (path,) = [p for p in sorted(BLOCKS.glob(f"{prefix}-*.jsonl*"))
                   if (BlockStore.stored(p)[0] or {}).get("run", {}).get("num_samples") == args.power]
    _, blocks, _ = BlockStore.stored(path)
    cells = [ast.literal_eval(c) for c in row["cells"]]
    seqs = {c[1]: i for i, c in enumerate(cells) if c[0] == "seq"}
    rests = {c[1]: i for i, c in enumerate(cells) if c[0] == "rest"}
    tail = next(i for i, c in enumerate(cells) if c[0] == "tail")
    expanded = {s[:n] for s in seqs for n in range(1, len(s) + 1)} | set(rests)

    def cell(draw: tuple) -> int | None:  # the law's walk (stats.SequenceLaw.index) over the prefixes the cells name
        prefix = ()
        for token in draw:
            if prefix + (token,) not in expanded:
                return rests.get(prefix)
            prefix += (token,)
        return seqs.get(prefix)

    probs = np.array(row["target_probs"])
    parts = {f"blocks 0-{args.split - 1}": blocks[: args.split], f"blocks {args.split}-{len(blocks) - 1}": blocks[args.split:]}
    unnamed = {name: Counter(tuple(d) for b in part for d in b["draws"] if cell(tuple(d)) is None)
               for name, part in parts.items()}
    (first, second) = parts
    only = {first: sorted(set(unnamed[first]) - set(unnamed[second])),
            second: sorted(set(unnamed[second]) - set(unnamed[first]))}
    print(f"{path}: {len(blocks)} blocks; row: {row['finding']}")
    for name, part in parts.items():
        counts = np.zeros(len(cells))
        for block in part:
            for draw in map(tuple, block["draws"]):
                index = cell(draw)
                counts[tail if index is None else index] += 1
        result = compare_counts(counts, probs, probs)
        n = int(counts.sum())
        print(f"{name}: N {n}, p = {result.p_value:.3g}, TV {result.tv:.3f} (floor {result.tv_floor:.3f}, detects "
              f"{detectable_tv(n, len(cells)):.3f}); in no named cell and never drawn by the other part: "
              f"{sum(unnamed[name][s] for s in only[name])} generations ({len(only[name])} sequences: "
              f"{only[name][:6]}{' ...' if len(only[name]) > 6 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
