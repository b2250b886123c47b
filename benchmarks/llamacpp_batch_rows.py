"""Why ``llama-speculative-simple`` emits tokens its target's sampler chain cuts: the target's logits after the audit's
prompt as llama.cpp computes them in the batch shapes the server and the example use, side by side.

The audit's power run of ``llamacpp-simple`` (``benchmarks/records/audit_executed.json``: T = 0.8, top-k 40 / top-p
0.95 / min-p 0.05, N = 18,000) rejects the target's law on a handful of tokens that lie just under min-p's cut. The
example decodes the prompt without its last token and takes its first token's logits from the batch [last prompt
token, drafts...] (``examples/speculative-simple/speculative-simple.cpp`` l. 129, l. 223-228; llama.cpp 0c1e570);
``llama-server``, whose lists are the audit's target law, decodes the whole prompt as one batch. This computes the
three rows with llama.cpp itself (``benchmarks/llamacpp_rows.cpp``, built here against the library
``scripts/build_llamacpp.sh`` built): the whole prompt; the last token alone after the rest; the example's
verification batch, with its drafts taken from the example's own log (the scaled draft's top tokens, as
``audit.execute``'s ``llamacpp-simple`` runs it). For each row: the server's sampler chain (top-k, top-p, then min-p
on the probabilities before the temperature, as llama.cpp's default order applies them) and the tokens it keeps, each
kept-or-cut token's ratio to the top token (min-p keeps ratio >= 0.05), and the largest logit difference between the
rows; the server's own final list after the prompt (``LlamaServer.row``) beside them.

    bash scripts/build_llamacpp.sh      # once per machine
    PYTHONPATH=. .venv/bin/python benchmarks/llamacpp_batch_rows.py --out benchmarks/records/llamacpp_batch_rows.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROWS = ("whole", "single", "verify")
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # the server's defaults, T = 0.8


def build(home: Path) -> Path:
    """``llamacpp_rows`` compiled against the library ``scripts/build_llamacpp.sh`` built (once)."""
    source = Path(__file__).with_name("llamacpp_rows.cpp")
    binary = home / "bin" / "llamacpp_rows"
    if binary.exists() and binary.stat().st_mtime >= source.stat().st_mtime:
        return binary
    src, lib = home / f"llama_cpp_python-{home.name}" / "vendor" / "llama.cpp", home / "build"
    archives = [lib / "src" / "libllama.a", lib / "ggml" / "src" / "libggml.a",
                lib / "ggml" / "src" / "libggml-cpu.a", lib / "ggml" / "src" / "libggml-base.a"]
    missing = [str(a) for a in archives if not a.exists()]
    if missing:
        raise FileNotFoundError(f"llama.cpp's libraries are not built ({', '.join(missing)}): run "
                                "bash scripts/build_llamacpp.sh")
    subprocess.run(["g++", "-O2", "-std=c++17", str(source), "-I", str(src / "include"), "-I", str(src / "ggml" / "include"),
                    "-o", str(binary), *map(str, archives), *map(str, archives), "-fopenmp", "-lpthread", "-ldl", "-lm"],
                   check=True)
    return binary


def chain(logits: np.ndarray, sampling: dict) -> dict[int, float]:
    """The server's sampler chain on one logit row (``audit.real.llamacpp_chain``) -> {kept token: probability}."""
    import torch

    from specresearch.audit.real import llamacpp_chain

    probs = torch.from_numpy(logits.astype(np.float64)).softmax(-1)[None]
    law = llamacpp_chain(probs, **sampling)[0]
    return {int(t): float(law[t]) for t in law.nonzero().flatten()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Name a colour.")
    parser.add_argument("--seed", type=int, default=1, help="the example's run whose log gives the drafts")
    parser.add_argument("--draft-max", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/records/llamacpp_batch_rows.json")
    args = parser.parse_args()

    from specresearch.audit.llamacpp import (
        LlamaServer,
        llamacpp_home,
        run_speculative,
        simple_steps,
        write_scaled_draft,
    )
    from specresearch.engine.prompts import encode_chat
    from specresearch.experiments.records import record_header, write_json_record
    from specresearch.models.embedded import gguf_path, load_embedded
    from specresearch.paths import cache_dir

    binary = build(llamacpp_home())
    model, scale = gguf_path(), 1.5  # the draft audit.execute's llamacpp-simple runs (its default draft_scale)
    draft = write_scaled_draft(model, cache_dir("llamacpp", f"draft-scaled-{scale:g}.gguf"), scale)
    ids = encode_chat([args.prompt], load_embedded(device="cpu")[1])[0].tolist()
    with LlamaServer(model) as server:
        text = server.detokenize(ids)
        prompt = server.tokenize(text)  # as the audit's runner: llama.cpp's own tokens for the prompt's text
        version = server.version()
        _, log = run_speculative(model, draft, text, seed=args.seed, n_predict=2, sampling=SAMPLING,
                                 draft_max=args.draft_max, threads=args.threads, simple=True, with_log=True)
        steps = simple_steps(log)
        if not steps or not steps[0][0]:
            raise RuntimeError("the example's log names no token drafted for its first step")
        drafts = steps[0][0]
        out_rows = Path(args.out).with_suffix(".f32")
        done = subprocess.run([str(binary), str(model), str(args.threads), ",".join(map(str, prompt)),
                               ",".join(map(str, drafts)), str(out_rows)], capture_output=True, text=True, check=True)
        n_vocab = int(done.stdout.split()[-1])
        server_list = server.row(prompt, n_vocab, SAMPLING)
    logits = dict(zip(ROWS, np.fromfile(out_rows, dtype=np.float32).reshape(len(ROWS), n_vocab)))
    out_rows.unlink()

    kept = {name: chain(row, SAMPLING) for name, row in logits.items()}
    served = {int(t): float(p) for t, p in enumerate(server_list.tolist()) if p > 0}
    tokens = sorted(set().union(*kept.values(), served))
    ratio = {name: {t: float(np.exp(float(row[t]) - float(row.max()))) for t in tokens} for name, row in logits.items()}
    rows = {name: {"kept": sorted(kept[name]), "n_kept": len(kept[name]),
                   "ratio_to_top": {str(t): round(ratio[name][t], 5) for t in tokens},
                   "same_list_as_server": sorted(kept[name]) == sorted(served)}
            for name in ROWS}
    differ = {f"{a} vs {b}": float(np.abs(logits[a] - logits[b]).max())
              for i, a in enumerate(ROWS) for b in ROWS[i + 1:]}
    only = {f"{a} not {b}": sorted(set(kept[a]) - set(kept[b])) for a in ROWS for b in ROWS if a != b}
    record = record_header("benchmarks/llamacpp_batch_rows.py", sys.argv[1:], engine_version=version,
                           draft_gguf=f"the target's GGUF with its logits scaled by {scale:g} (write_scaled_draft)", prompt=args.prompt, prompt_ids=prompt, drafts=drafts,
                           sampling=SAMPLING, server_list=sorted(served), rows=rows, max_logit_difference=differ,
                           kept_only_in=only)
    write_json_record(Path(args.out), record)
    for name in ROWS:
        print(name, rows[name]["n_kept"], "kept; same list as the server's:", rows[name]["same_list_as_server"])
    print("largest logit differences:", differ)
    print("kept in one row, cut in another:", {k: v for k, v in only.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
