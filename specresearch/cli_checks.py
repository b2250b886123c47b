"""What the command line checks before any model loads: the flags alone reveal these errors, and a model takes seconds
to load. Each raises ``ValueError`` with one line naming the flag (``cli.main`` prints it and exits with code 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specresearch.config import CUDA_GRAPH_MODES, GENERATE_DRAFT

TREE_RULES = ("rrs", "rrs_without_replacement", "kseq", "gbv", "traversal", "onehot")  # engine.tree.TREE_VERIFIERS


def check_prompts_file(flag: str, path: str | None) -> None:
    """Read a prompts file now, before any model loads, so a wrong file fails in a second with its name."""
    if path is None:
        return
    from specresearch.engine.prompts import load_prompts

    if not Path(path).is_file():
        raise ValueError(f"{flag} {path}: no such file")
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {path}: line {number} is not JSON ({exc.msg}); "
                             "expected one object per line (JSON Lines, schema in data/README.md)") from None
        if not isinstance(row, dict):
            raise ValueError(f"{flag} {path}: line {number} is {type(row).__name__}, not an object with "
                             "id, category and turns (schema in data/README.md)")
    try:
        rows = load_prompts(path)
    except ValueError as exc:
        got = str(exc).split(", got ", 1)[-1]  # distill.load_prompts names the first offending row
        raise ValueError(f"{flag} {path}: every line needs the fields id, category and non-empty turns "
                         f"(schema in data/README.md); got {shorten(got)}") from None
    if not rows:
        raise ValueError(f"{flag} {path}: the file holds no prompt")


def shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_device(device: str) -> None:
    """``--device``: a device torch knows and this machine has (before any model loads; the API's message, flagged)."""
    from specresearch.models.causal_lm import resolve_device

    try:
        resolve_device(device)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def check_graph_device(args) -> None:
    """``--compile reduce-overhead`` / ``cudagraph`` (CUDA graphs) where the run will not be on a CUDA device."""
    mode, device = getattr(args, "compile", None), getattr(args, "device", None) or "auto"
    if mode not in CUDA_GRAPH_MODES:
        return
    import torch

    anywhere = device == "auto" or getattr(args, "device_map", None) is not None  # where torch finds a device
    if torch.cuda.is_available() if anywhere else torch.device(device).type == "cuda":
        return
    where = "torch sees no CUDA device on this machine" if anywhere else f"the run is on --device {device}"
    raise ValueError(f"--compile {mode} captures CUDA graphs, and {where}: --compile on compiles the step for the device "
                     "(inductor off CUDA), --compile static runs the captured steps eagerly, --compile off the growing loop")


def check_common_flags(args) -> None:
    """The flags several commands share (``--threads``, ``--device``, ``--model`` / ``--target``, ``--draft``), checked
    for every command before it runs: one line and exit code 2 instead of a traceback after a model load."""
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    check_graph_device(args)
    embedded_only = args.command in ("distill", "feature-distill", "warm-cache")  # these train or cache the embedded model
    for flag in ("model", "target"):
        if getattr(args, flag, None) is not None:
            check_model_name(f"--{flag}", getattr(args, flag), embedded_only=embedded_only)
    if args.command == "bench":
        check_draft_name(args.draft)
    from specresearch.drafts.registry import without_weight_prefix

    if getattr(args, "draft", None) and without_weight_prefix(args.draft) == "mtp":  # fp16:mtp, int8:mtp too
        check_mtp_model(getattr(args, "model", None) or getattr(args, "target", None))


def check_mtp_model(name: str | None) -> None:
    """``--draft mtp``: the model's own checkpoint announces MTP layers (its ``config.json``), before anything loads."""
    config = Path(str(name)) / "config.json"
    if not config.is_file():
        if os.environ.get("HF_HUB_OFFLINE", "1") == "0" and name not in known_names("model"):
            return  # a hub id: transformers resolves it, and load_mtp says what it lacks
        raise ValueError(f"--draft mtp drafts with the MTP layers of the model's own checkpoint, and {name!r} is no "
                         "checkpoint directory (the embedded models have none)")
    settings = json.loads(config.read_text())
    text = settings.get("text_config") or settings
    if not (text.get("num_nextn_predict_layers") or text.get("num_mtp_layers")):
        raise ValueError(f"--draft mtp: {name}'s config announces no MTP layers (num_nextn_predict_layers)")


def check_model_name(flag: str, name: str, *, embedded_only: bool = False) -> None:
    """An embedded model's name, a transformers checkpoint directory, or, where downloads are allowed
    (``HF_HUB_OFFLINE=0``), a hub id."""
    known = known_names("model")
    if name in known:
        return
    if embedded_only:
        raise ValueError(f"{flag} {name!r}: this command works on an embedded model ({', '.join(known)})")
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {name}: a directory without config.json is not a transformers checkpoint "
                             "(model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR) write one)")
        return
    if os.environ.get("HF_HUB_OFFLINE", "1") == "0":
        return  # downloads allowed: transformers resolves the hub id (or says why not)
    hub = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    raise ValueError(f"{flag} {name!r} is neither a known name ({', '.join(known)}) nor a checkpoint directory"
                     + ("; to download it from the Hugging Face hub, allow downloads: HF_HUB_OFFLINE=0 specresearch ..."
                        if hub else ""))


def check_draft_name(name: str | None) -> None:
    """``--draft``: a described draft, a shipped one or an existing directory (before any model loads)."""
    from specresearch.drafts.registry import without_weight_prefix

    if name is None:
        return
    base = without_weight_prefix(name)
    described = base in ("ngram", "mtp") or base.startswith(("ngram+", "truncated:", "dial-"))
    if not (described or base in known_names("draft") or Path(base).exists()):
        raise ValueError(f"--draft {name!r} is neither a known name ({', '.join(known_names('draft'))}) "
                         "nor an existing checkpoint directory")
    if Path(base).is_dir():
        from specresearch.drafts.registry import draft_format

        try:
            draft_format(base)
        except ValueError as error:
            raise ValueError(f"--draft {name}: {error}") from None


def check_generate_flags(args) -> None:
    """Every error the flags alone reveal, before any model loads (a model takes seconds to load)."""
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give the text to answer (or continue, with --raw)")
    for flag, value in (("--gamma", args.gamma), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_draft_name(args.draft)
    if args.method != "speculative" and (args.verifier is not None or args.gamma_given or args.num_drafts != 1):
        raise ValueError(f"--method {args.method} decodes without a draft: --verifier, --gamma and --num-drafts are for "
                         "--method speculative")
    args.verifier = args.verifier or ("onehot" if args.draft_law in ("dynamic", "static") else "block")  # their one rule
    check_tree_flags(args)
    check_compile_flags(args)


def check_compile_flags(args) -> None:
    """``--compile`` asking for captured steps where the flags alone show the run has none (engine.static)."""
    if args.compile in ("auto", "off") or args.autoregressive or args.method != "speculative":
        return
    draft = args.draft or GENERATE_DRAFT
    lookup = draft.startswith("ngram+")  # generate's default draft plans the length chosen (engine.cost.fit_default_draft)
    planned = next((o.partition("=")[2] for o in draft.split("@")[1:] if o.startswith("draft-gamma=")), "1")
    tree = args.num_drafts > 1 or args.draft_law != "iid"
    why = (f"prompt lookup's length plan (@draft-gamma={planned}: tokens a step without a match) is decided per "
           f"step on the host; --gamma {planned}, or {draft.split('@')[0]}@draft-gamma=none, drafts every step"
           if lookup and not tree and planned.isdigit() and args.gamma > int(planned)
           and args.draft not in (None, GENERATE_DRAFT)
           else "adaptive chains (--stop-below) decide on the host" if args.stop_below is not None
           else "GBV's verifier reads the host" if args.verifier == "gbv" else None)
    if why:
        raise ValueError(f"--compile {args.compile} runs captured steps, but {why} (draft {draft}): use --draft "
                         "eagle3-v8k (a feature head) or another whole-model draft, or --compile off")


def check_tree_flags(args) -> None:
    """The tree flags' errors, before any model loads."""
    if args.num_drafts < 1:
        raise ValueError(f"--num-drafts must be >= 1, got {args.num_drafts}")
    if (args.num_drafts > 1 or args.draft_law != "iid") and args.verifier not in TREE_RULES:
        raise ValueError(f"--num-drafts {args.num_drafts} / --draft-law {args.draft_law} draft a tree: choose a multi-draft "
                         f"--verifier ({', '.join(TREE_RULES)}), not {args.verifier}")
    if args.stop_below is not None and not 0 <= args.stop_below <= 1:
        raise ValueError(f"--stop-below must be a probability in [0, 1], got {args.stop_below}")
    if args.verifier == "kseq" and args.gamma != 1:
        raise ValueError(f"--verifier kseq is single-step: use --gamma 1, not {args.gamma}")
    if args.draft_law in ("dynamic", "static") and args.verifier != "onehot":
        raise ValueError(f"--draft-law {args.draft_law} drafts a deterministic top-k tree: verify it with --verifier onehot, "
                         f"not {args.verifier}")
    if args.tree_nodes is not None and (args.draft_law not in ("dynamic", "static") or args.tree_nodes < 1):
        raise ValueError(f"--tree-nodes is a count >= 1 for --draft-law dynamic or static; got {args.tree_nodes} with "
                         f"--draft-law {args.draft_law}")


def known_names(flag: str) -> list[str]:
    if flag != "draft":
        from specresearch.models.embedded import EMBEDDED

        return sorted(EMBEDDED)
    from specresearch.drafts.store import shipped_drafts

    return ["ngram", "ngram+NAME[@OPTION]", "truncated:N", "mtp", "fp16:NAME", "int8:NAME", "dial-mix:LAM[:DRAFT]",
            "dial-uniform:LAM", "dial-temp:S", *shipped_drafts()]
