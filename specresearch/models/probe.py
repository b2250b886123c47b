"""A probe of a family the matrices do not check: does its cache score a draft tree as uncached forwards do?

``CausalLM`` is exact on a family when the family's attention takes each token's position from the position ids the
wrapper passes and applies the masks it hands over (:mod:`specresearch.models.attention`). The families of
``models.families`` are held to that by the matrices of ``tests/test_families.py``; transformers builds some two
hundred more. Tried tiny and random (``benchmarks/family_sweep.py``), most are exact, and some are not, without an
error: RoBERTa's kin used as decoders (CamemBERT, XLM-R, Data2Vec-Text) count positions from the padding index,
RoFormer and TrOCR from the cache's length, Moshi windows over slots, GIT widens a 2-D mask by image tokens it
assumes are cached, and HRM's recurrent loops amplify rounding past it; seq2seq decoders (BART,
Blenderbot, ProphetNet), XLM and CPM-Ant fail inside transformers on a tree.

So ``CausalLM`` probes any model of another family before its first use (:func:`check_cached_tree`): two prompts,
one left-padded; two draft trees of 6 nodes in two branches (nodes sit slots past their positions), each row keeping
another path (dead slots inside the cache); a token after them; each node's and call's logits against an uncached
forward of the same tokens through the same model. A model that differs by more than its dtype's rounding, or fails,
is refused in one line. The prompt is 3 tokens, and as long again as a sliding window its config names (up to
``MAX_WINDOW``), so that a window the model applies itself, over slots rather than positions, beside the masks'
(Moshi's) shows. It costs 4 cached calls and 28 uncached forwards of the prompt and up to 8 more tokens, once per
``CausalLM``; ``probe=False`` skips it. A model with recurrent layers (``models.recurrent``), whose trees are scored
path by path, is probed with chains as well: after the trees, two calls of 4 tokens, each followed by rollbacks of
different counts per row (the second undoing one row's whole call), three calls of one token rolled back across them
(a draft's pattern), then the token after them, at float32's tolerance whatever its dtype: transformers' recurrent
kernels compute in float32, and an uncached forward runs a chunked form of the recurrence that a float64 Qwen3.5 put
1.7e-4 away from its own one-token decoding, which the wrapper's calls match to 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CHECKED_TYPES", "logit_gap", "check_cached_tree", "static_form_calls", "static_chain_calls", "tree_visibility", "tree_path",
           "error_line"]

# a model's max |cached - uncached| logit difference allowed, relative to its logits' scale, by its weights' dtype
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
LOW_PRECISION_TOLERANCE = 5e-2  # bfloat16 / float16: a call of k tokens rounds otherwise than k calls of one
MAX_WINDOW = 4096  # a config's sliding window the probe's prompt spans, at most


# the transformers ``model_type`` s of ``models.families``' FAMILIES and MORE_FAMILIES, which the matrices check and
# which are not probed (tests/test_probe.py holds the two lists equal)
CHECKED_TYPES = frozenset({
    "biogpt", "bloom", "codegen", "cohere", "cohere2", "deepseek_v3", "exaone4", "falcon", "gemma", "gemma2",
    "gemma3_text", "gemma3n_text", "gemma4_text", "glm4", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_oss", "gptj", "granite", "llama",
    "llama4_text",
    "ministral", "mistral", "mixtral", "mpt", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen3", "qwen3_moe", "smollm3",
    "stablelm", "starcoder2", "xglm"})


def logit_gap(cached: torch.Tensor, want: torch.Tensor) -> float:
    """max |cached - want| over the logits' scale, ``1 + max |want|``: the measure :data:`TOLERANCE` bounds."""
    return (cached - want).abs().max().item() / (1.0 + want.abs().max().item())


def check_cached_tree(lm) -> None:
    """Raise ``ValueError`` (one line) unless ``lm`` (a ``CausalLM``) scores the probe's calls as uncached forwards of
    the same tokens do (module docstring). ``lm`` is left with the probe's batch in its cache: start another with
    ``prefill``."""
    model, name = lm.model, f"{type(lm.model).__name__} ({lm.model.config.model_type})"
    config = model.config.get_text_config()
    vocab = min(lm.own_vocab_size, int(getattr(config, "vocab_size", lm.own_vocab_size)))
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    length = 3 + (min(int(window), MAX_WINDOW) if isinstance(window, int) and window > 0 else 0)
    ids = [(5 + 7 * i) % vocab for i in range(length + 12)]
    histories = [ids[:length], ids[2:length]]  # the second row left-padded by two
    device = lm.device
    calls = []  # (what, cached logits [V], the tokens an uncached forward reads)
    try:
        padded = torch.tensor([histories[0], [0, 0, *histories[1]]], device=device)
        logits = lm.prefill(padded, torch.tensor([[1] * length, [0, 0] + [1] * (length - 2)], device=device))
        calls += [("the prompt", logits[row], histories[row]) for row in range(2)]
        for step in range(2):
            nodes = [[ids[length + 6 * step + i] for i in range(6)]] * 2
            lm.begin_tree()
            tree = lm.score_tree(torch.tensor(nodes, device=device), torch.tensor([TREE_DEPTHS] * 2),
                                 tree_visibility(TREE_PARENTS).expand(2, -1, -1))
            for row in range(2):
                calls += [(_NODE_NAMES[i], tree[row, i], histories[row] + tree_path(nodes[row], i)) for i in range(6)]
            lm.end_tree(torch.tensor(KEPT))  # each row keeps another path: dead slots inside the cache
            for row in range(2):
                histories[row] = histories[row] + [t for t, kept in zip(nodes[row], KEPT[row]) if kept]
        if lm.recurrent:  # chains: rows roll back different counts, within a call and across calls
            calls += _chain_calls(lm, ids[length:], histories)
        after = lm.score(torch.tensor([[ids[0]], [ids[1]]], device=device))
        calls += [("a token after dead slots", after[row, -1], histories[row] + [ids[row]]) for row in range(2)]
        worst, where = 0.0, ""
        for what, cached, tokens in calls:
            with torch.no_grad():
                want = model(input_ids=torch.tensor([tokens], device=device)).logits[0, -1].float()
            width = min(want.shape[-1], cached.shape[-1])
            gap = logit_gap(cached[:width].to(want.device), want[:width])
            if not gap <= worst:  # NaN included
                worst, where = gap, what
    except Exception as error:  # noqa: BLE001 -- a family's own failure, reported in one line
        detail = error_line(error)
        what = "a cached draft tree and chains" if lm.recurrent else "a cached draft tree"
        raise ValueError(f"{name} fails CausalLM's probe of {what} ({detail}): a family the matrices "
                         "do not check (models.probe); use a model of another family") from error
    tolerance = TOLERANCE.get(model.dtype, LOW_PRECISION_TOLERANCE)
    if lm.recurrent:  # transformers' recurrent kernels compute in float32 whatever the model's dtype
        tolerance = max(tolerance, TOLERANCE[torch.float32])
    if not worst <= tolerance:
        raise ValueError(f"{name} scores {where} otherwise than an uncached forward of the same tokens (max |difference| "
                         f"{worst:.3g} of the logits' scale, allowed {tolerance:g}): its attention does not take "
                         "positions and masks as CausalLM passes them, so its speculative outputs would be wrong "
                         "(models.probe); use a model of another family, or probe=False to run it unchecked")


TREE_PARENTS = (-1, 0, 1, 0, 3, 2)  # two branches off the root, one two deep
TREE_DEPTHS = (0, 1, 2, 1, 2, 3)
KEPT = ((True, True, True, False, False, True), (True, False, False, True, True, False))
_NODE_NAMES = ("a tree's root", "a tree's node", "a tree's node", "a tree's node past a sibling's slots",
               "a tree's node past a sibling's slots", "a tree's node")


def tree_visibility(parents) -> torch.Tensor:
    """A tree's ``visible [1, n, n]`` from each node's parent index (-1: the root): each node sees itself and its
    ancestors."""
    visible = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            visible[i] |= visible[parent]
    return visible[None]


def tree_path(tokens: list[int], i: int, parents=TREE_PARENTS) -> list[int]:
    """The tokens of node ``i``'s path from the root, root first."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def static_form_calls(form):
    """Calls of a static form (``CausalLM.static_form()``, the captured steps' cache) and what each logit row must
    equal: yields ``(logits [V], sequence)`` for an uncached forward of ``sequence``. Two left-padded rows of 9 and 4
    tokens (past a 6-slot window), a chain call whose last token is dropped, a tree call of five nodes (two branches),
    the tree's path kept to 3 and 2 nodes, a token after (``tests/test_static.py``, ``tests/test_probe.py`` and
    ``benchmarks/family_sweep.py`` compare them)."""
    rows = [[5, 9, 3, 7, 2, 11, 4, 8, 6], [12, 13, 14, 15]]
    form.allocate(2, 64)
    form.prefill(torch.tensor([rows[0], [0] * 5 + rows[1]]), torch.tensor([[1] * 9, [0] * 5 + [1] * 4]))  # left-padded
    chain = [[20, 21], [22, 23]]
    logits, _ = form.forward(torch.tensor(chain))
    for b, row in enumerate(rows):
        yield logits[b, 1], row + chain[b]
    form.commit(1)  # keep the first chain token; the second is rolled back
    rows = [row + [links[0]] for row, links in zip(rows, chain)]
    parents = [-1, 0, 1, 0, 3]  # root, then two branches of two nodes
    tokens = [[30, 31, 32, 33, 34], [35, 36, 37, 38, 39]]
    logits, _ = form.forward(torch.tensor(tokens), depth=torch.tensor([[0, 1, 2, 1, 2]] * 2),
                             visible=tree_visibility(parents).expand(2, -1, -1))
    for b, row in enumerate(rows):
        for i in range(5):
            yield logits[b, i], row + tree_path(tokens[b], i, parents)
    form.keep_path(torch.tensor([[0, 3, 4], [0, 3, 4]]), torch.tensor([3, 2]))  # rows keep 3 and 2 of the path
    kept = [rows[0] + [30, 33, 34], rows[1] + [35, 38]]
    logits, _ = form.forward(torch.tensor([[40], [41]]))
    for b, row in enumerate(kept):
        yield logits[b, 0], row + [40 + b]


def static_chain_calls(form):
    """Calls of the static form of a model with recurrent layers (chains only: ``models.static_states``) and what each
    logit row must equal, as :func:`static_form_calls`: two left-padded rows of 9 and 4 tokens, a chain of four kept
    to 1 and 3 tokens, a draft's three one-token calls kept to 2 and 0 across them, then a chain of two."""
    rows = [[5, 9, 3, 7, 2, 11, 4, 8, 6], [12, 13, 14, 15]]
    form.allocate(2, 64, span=8)
    form.prefill(torch.tensor([rows[0], [0] * 5 + rows[1]]), torch.tensor([[1] * 9, [0] * 5 + [1] * 4]))
    chain = [[20, 21, 22, 23], [24, 25, 26, 27]]
    logits, _ = form.forward(torch.tensor(chain))
    for b, row in enumerate(rows):
        for i in range(4):
            yield logits[b, i], row + chain[b][: i + 1]
    form.commit(torch.tensor([1, 3]))
    rows = [rows[0] + chain[0][:1], rows[1] + chain[1][:3]]
    drafted = [[30, 31], [32, 33], [34, 35]]  # per call, a token per row
    for offset, tokens in enumerate(drafted):
        logits, _ = form.forward(torch.tensor(tokens)[:, None], offset=offset)
        for b, row in enumerate(rows):
            yield logits[b, 0], row + [call[b] for call in drafted[: offset + 1]]
    form.commit(torch.tensor([2, 0]))
    rows = [rows[0] + [30, 32], rows[1]]
    last = [[40, 41], [42, 43]]
    logits, _ = form.forward(torch.tensor(last))
    for b, row in enumerate(rows):
        for i in range(2):
            yield logits[b, i], row + last[b][: i + 1]


CHAIN_ROLLBACKS = ((1, 3), (4, 2))  # per row, after the chain probe's two calls of 4 tokens
CALLS_ROLLBACK = (3, 1)  # per row, after three calls of one token (a draft's pattern: a rollback across calls)


def _chain_calls(lm, ids: list[int], histories: list[list[int]]) -> list:
    """A model with recurrent layers (``models.recurrent``): two calls of 4 tokens, each followed by rollbacks of
    different counts per row (the second undoing one row's whole call). -> the probe's calls."""
    calls = []
    for step, counts in enumerate(CHAIN_ROLLBACKS):
        tokens = [ids[4 * step : 4 * step + 4]] * 2
        scored = lm.score(torch.tensor(tokens, device=lm.device))
        for row in range(2):
            calls += [(f"a chain's token {i + 1}", scored[row, i], histories[row] + tokens[row][: i + 1])
                      for i in range(4)]
        lm.rollback(list(counts))
        for row in range(2):
            histories[row] = (histories[row] + tokens[row])[: len(histories[row]) + 4 - counts[row]]
    for i, token in enumerate(ids[8:11]):
        scored = lm.score(torch.tensor([[token], [token]], device=lm.device))
        calls += [(f"a drafted token {i + 1}", scored[row, 0], histories[row] + ids[8 : 9 + i]) for row in range(2)]
    lm.rollback(list(CALLS_ROLLBACK))
    for row in range(2):
        histories[row] = histories[row] + ids[8 : 11 - CALLS_ROLLBACK[row]]
    return calls


def error_line(error: BaseException, limit: int = 300) -> str:
    """``error`` in one line of at most ``limit`` characters: its type and message, or, for an error with no message
    of its own (a bare ``assert``), where it was raised (``file:line: code``, the file from its package down)."""
    return " ".join(f"{type(error).__name__}: {str(error) or _raised_at(error)}".split())[:limit]


def _raised_at(error: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "no message"
    frame = frames[-1]
    path = Path(frame.filename).parts
    root = (path.index("site-packages") + 1 if "site-packages" in path
            else len(path) - 1 - path[::-1].index("specresearch") if "specresearch" in path else len(path) - 2)
    short = "/".join(path[root:])
    return f"raised at {short}:{frame.lineno}: {frame.line}" if frame.line else f"raised at {short}:{frame.lineno}"
