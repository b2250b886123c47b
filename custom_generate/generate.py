"""transformers ``custom_generate`` entry point: speculative decoding with specresearch's engine.

    target.generate(input_ids, assistant_model=draft, custom_generate="<this repository>", trust_remote_code=True,
                    do_sample=True, temperature=0.8, max_new_tokens=64, verifier="block", gamma=4)

``assistant_model`` is the draft (a causal LM with the target's tokenizer). Extra arguments: ``verifier``
("token", "block" or "greedy"), ``gamma`` (draft tokens per step), ``seed`` / ``generator``, ``allow``.
Everything else is ``generate``'s own; see ``specresearch.engine.hf`` (and docs/transformers.md) for what is
supported and what raises.
"""

from specresearch.engine.hf import generate

__all__ = ["generate"]
