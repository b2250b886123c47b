"""Audit by execution of transformers' speculative decoding across vocabularies, the committed record:
``generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=..., do_sample=True)`` (transformers' own
``UniversalSpeculativeDecodingGenerator`` and ``_speculative_sampling``) on a tiny Llama pair over word tokenizers whose
assistant has 12 words the target lacks (``models.families.tiny_usd_pair``), and on the embedded SmolLM2 with a draft
of its first 4 layers whose tokenizer has one token added (every other token shared), the measured law of the first
two tokens
against the target's and against the law predicted from the draft's own law and the q transformers verifies with
(``specresearch.audit.execute``, engine ``transformers-usd``).

    python benchmarks/audit_usd.py [--out benchmarks/records/audit_usd.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import sys

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_usd_pair

SEED = 0  # the pair's weights
PROMPT = (11, 14, 32)  # "w9 w12 w30" in the target's words


def build_embedded(layers: int = 4):
    """The embedded SmolLM2-135M-Instruct (float32, CPU) and a draft of its first ``layers`` layers, norm and head, the
    draft's tokenizer SmolLM2's with one token added (and the draft's embeddings and head grown by one row): every
    token but that one shared, the shape of a real pair of related vocabularies."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    from specresearch.models.embedded import load_embedded

    target_lm, tokenizer = load_embedded(device="cpu", skinny_linear=False, fuse_projections=False)
    target = target_lm.model
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # the first layers, the embeddings, the norm
    assistant_tokenizer = copy.deepcopy(tokenizer)
    assistant_tokenizer.add_tokens(["<draft-only>"])
    draft.resize_token_embeddings(len(assistant_tokenizer))
    return target, draft, {}, dict(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)


# encode_chat(["Name a colour."]) with SmolLM2's tokenizer and chat template
CHAT_PROMPT = (1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
               2, 198, 1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198)


def build():
    target, draft, target_tokenizer, assistant_tokenizer = tiny_usd_pair(seed=SEED)
    return target, draft, {}, dict(tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)


def _run(n: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny Llama pair over word tokenizers, the assistant with 12 words of its own (seed {SEED})", build,
                   "transformers-usd", 2, n, temperature, options or {}, PROMPT)


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(8000), _run(6000, 0.7), _run(6000, options={"num_assistant_tokens": 3}),
        TinyRun("SmolLM2 pair (the embedded SmolLM2-135M-Instruct; the draft its first 4 layers and head, its "
                "tokenizer with one token added)", build_embedded, "transformers-usd", 2, 800, prompt=CHAT_PROMPT)]


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_usd", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
